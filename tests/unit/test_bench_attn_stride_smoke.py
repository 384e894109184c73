"""The CPU_ATTN stride benchmark, a few steps on the release this
interpreter has: vLLM's decode op gives the same output, bit for bit, on
per-layer caches and on cross-layer views of the same bytes, and the
A/A control builds two stock allocations (seconds)."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("control", [False, True])
def test_attn_stride_outputs_match(tmp_path, control):
    json_path = tmp_path / "out.json"
    argv = [
        sys.executable,
        str(ROOT / "benchmarks" / "bench_attn_stride.py"),
        "--reps",
        "2",
        "--contexts",
        "256",
        "--batches",
        "2",
        "--layers",
        "4",
        "--json",
        str(json_path),
    ]
    proc = subprocess.run(
        argv + ["--control"] * control, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert ("CONTROL run" in proc.stdout) is control
    (row,) = json.loads(json_path.read_text())["rows"]
    assert row["same_output"] is True
    assert (row["context"], row["batch"], row["reps"]) == (256, 2, 2)
    assert row["stock_ms"]["min"] > 0 and row["cross_ms"]["min"] > 0
    assert "| yes |" in proc.stdout
