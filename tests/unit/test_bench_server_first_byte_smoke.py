"""bench_server_first_byte.py on tiny values: a row per server that runs
here, batch and idle time, each with a first byte no later than the last
(ms)."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

from vllm_overlay.testing.redis import missing_server

ROOT = pathlib.Path(__file__).resolve().parents[2]
ROW = re.compile(
    r"^\| (\w+) [\d.]+ \| (\d+) \| ([\d.]+) \| ([\d.]+) \[.*?\] \| ([\d.]+) \[", re.M
)


def test_it_prints_a_row_per_server_batch_and_idle_time():
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "bench_server_first_byte.py"),
            *("--values", "3", "--mib", "0.25", "--repeats", "2"),
            *("--idle", "0", "--idle", "0.1", "--batch", "3", "--batch", "1"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = ROW.findall(proc.stdout)
    kinds = [k for k in ("valkey", "redis") if missing_server(k) is None]
    assert kinds, "no pool server here"
    assert sorted((k, b, idle) for k, b, idle, _, _ in rows) == sorted(
        (k, b, idle) for k in kinds for b in ("1", "3") for idle in ("0", "0.1")
    ), proc.stdout
    for _, _, _, first, last in rows:
        assert 0 <= float(first) <= float(last)
