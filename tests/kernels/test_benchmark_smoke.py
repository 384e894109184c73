"""The transfer benchmark runs (CPU mode, tiny sizes) and checks its bytes.

CI skips the C++ swap_blocks port (``--no-stock-port``: its build takes
over a minute on a 2-core machine); the benchmark then says so and uses the
labelled Python loop as the unit.  The port itself is byte-checked by every
full benchmark run."""

from __future__ import annotations

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_benchmark_prints_a_table_after_checking_bytes():
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "bench_block_transfer.py"),
            "--cpu",
            "--blocks",
            "1",
            "3",
            "--repeats",
            "1",
            "--shapes",
            "llama3.1-70b-tp8",
            "--no-stock-port",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [
        ln for ln in proc.stdout.splitlines() if ln.startswith("| llama3.1-70b-tp8")
    ]
    assert "stock column skipped (--no-stock-port)" in proc.stdout
    assert "| py-loop | cross-dma | contig |" in proc.stdout
    assert len(rows) == 4  # 2 block counts x 2 directions
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[3] == "640 KiB"  # 80 layers x 2 x 16 x 1 x 128 x 2 B
        assert cells[4] == "1.00x"  # the unit column
        assert cells[-2].endswith("%") and cells[-1].endswith("%")
