"""The prefix-reuse benchmark, --quick: every path happens and computes the
cold run's tokens (tiny model, one round, five engines; ~30-60 s on 2 cores)."""

from __future__ import annotations

import importlib.util
import json
import pathlib
import subprocess
import sys

from vllm_overlay.testing.redis import missing_server

ROOT = pathlib.Path(__file__).resolve().parents[2]
PATHS = [
    "cold recompute",
    "device hit (stock prefix cache)",
    "host reload, cross-layer",
    "host reload, per-layer (CL-09 off)",
    "pool reload, 2nd engine",
]


def test_prefix_reuse_quick_prints_every_path(tmp_path):
    # The benchmark's default pool server (Valkey): the harness installs it.
    assert missing_server() is None, missing_server()
    json_path, png_path = tmp_path / "out.json", tmp_path / "out.png"
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "bench_prefix_reuse.py"),
            "--quick",
            "--json",
            str(json_path),
            "--png",
            str(png_path),
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    lines = proc.stdout.splitlines()
    head = next(ln for ln in lines if ln.startswith("| path |"))
    columns = [c.strip() for c in head.strip("|").split("|")]
    rows = {}
    for line in lines:
        cells = [c.strip() for c in line.strip("|").split("|")]
        if line.startswith("| ") and cells[0] in PATHS:
            rows[cells[0]] = dict(zip(columns, cells))
    assert sorted(rows) == sorted(PATHS), proc.stdout
    for path, row in rows.items():
        assert row["path happened (rounds)"] == "1/1", (path, row)
        assert row["same tokens as cold (rounds)"] == "1/1", (path, row)
        assert row["TTFT ms: median [min, max]"][0].isdigit(), (path, row)
    loaded = next(c for c in columns if c.startswith("KV loaded per request"))
    for path in PATHS[2:]:  # the connectors' own counters saw blocks loaded
        assert " blocks, " in rows[path][loaded], (path, rows[path])

    result = json.loads(json_path.read_text())
    assert not result["problems"]
    assert [r["path"] for r in result["rows"]] == PATHS
    run = result["runs"][0]["paths"]
    assert run["cold"]["cached_tokens"] == 0
    assert run["hit"]["cached_tokens"] == result["meta"]["cacheable_tokens"] > 0
    assert (
        run["host_pl"]["moved"]["load_copy_calls"]
        > (run["host_cl"]["moved"]["load_copy_calls"])
    )  # per-layer: 2 x layers copies per block; cross-layer: one
    # the pool read's time, from the kernel's accounting in the engine
    usage = run["pool"]["read_usage"]
    assert usage["wall_s"] >= usage["cpu_s"] > 0 and usage["runq_s"] >= 0
    assert usage["process_cpu_s"] >= usage["cpu_s"] - 0.01
    assert "server_cpu_s" in usage  # the benchmark's Valkey, by its pid
    assert not run["host_cl"].get("read_usage")  # no pool there
    assert "| the load thread on a core |" in proc.stdout
    if importlib.util.find_spec("matplotlib") is not None:
        assert png_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    else:
        assert "PNG: skipped" in proc.stdout
