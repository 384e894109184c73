"""The pool benchmark runs against a real redis-server and redis-benchmark."""

from __future__ import annotations

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_pool_benchmark_prints_its_table():
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "bench_pool.py"),
            "--quick",
            "--count",
            "8",
            "--no-decode",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    row = next(ln for ln in proc.stdout.splitlines() if ln.startswith("| 256"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert all(c.endswith("GB/s") for c in cells[1:5])
    assert all(c.endswith("x") for c in cells[5:7])
