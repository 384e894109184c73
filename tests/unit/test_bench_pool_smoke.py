"""The pool benchmark runs against a real redis-server and redis-benchmark
and prints its read and write tables."""

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
            "16",
            "--repeats",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    read, write = [ln for ln in proc.stdout.splitlines() if ln.startswith("| 256")]
    cells = [c.strip() for c in read.strip("|").split("|")]
    assert len(cells) == 11 and cells[1] == "16"
    assert all(float(c.split()[0]) > 0 for c in cells[2:7])  # GB/s columns
    assert all(c.endswith("]x") for c in cells[7:11])  # ratios
    cells = [c.strip() for c in write.strip("|").split("|")]
    assert float(cells[3].split()[0]) > 0 and cells[4].endswith("]x")
