"""The decode benchmark, --quick, on the release this interpreter has: both
layouts are what they claim (the engines' own KV tensors), every cell has
decode steps, and the layouts generate the same tokens (tiny model, one
round, one context and batch size; about 1 min on vLLM 0.32, 2 min on
0.11.2 (slower engine start) on 2 shared cores)."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_decode_quick_compares_both_layouts(tmp_path):
    json_path = tmp_path / "out.json"
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "bench_decode.py"),
            "--quick",
            "--contexts",
            "256",
            "--batches",
            "2",
            "--max-tokens",
            "4",
            "--json",
            str(json_path),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    lines = proc.stdout.splitlines()
    head = next(ln for ln in lines if ln.startswith("| vLLM |"))
    columns = [c.strip() for c in head.strip("|").split("|")]
    rows = [
        dict(zip(columns, (c.strip() for c in ln.strip("|").split("|"))))
        for ln in lines
        if ln.startswith("| 0.")
    ]
    assert len(rows) == 1, proc.stdout
    row = rows[0]
    assert row["context (cached prompt tokens)"] == "256"
    assert row["batch"] == "2"
    assert row["decode steps / round"] == "4"
    assert row["same tokens (rounds)"] == "1/1"
    ratio = row["cross-layer / stock tok/s (paired): median [min, max]"]
    assert float(ratio.split()[0]) > 0

    result = json.loads(json_path.read_text())
    assert not result["problems"]
    (release,) = result["releases"]
    engines = release["engines"]
    layers = engines["stock"]["num_layers"]
    assert layers == 4
    # Stock: a block's stride spans one layer's block (0.11.2: K or V alone,
    # half of it); cross-layer: one buffer whose block stride spans them all.
    assert engines["stock"]["layers_per_block_stride"] in ([0.5], [1.0])
    assert engines["cross-layer"]["layers_per_block_stride"] == [float(layers)]
    assert engines["cross-layer"]["buffers"] == 1
    (rnd,) = release["rounds"]
    (cell,) = rnd["cells"]
    for layout in ("stock", "cross-layer"):
        run = cell["runs"][layout]
        assert run["cached_tokens"] == [256, 256]  # the prefix cache served it
        assert run["decode_tokens"] == 2 * 4 and run["decode_s"] > 0
        assert [len(t) for t in run["tokens"]] == [5, 5]  # first token + 4
    assert cell["runs"]["stock"]["tokens"] == cell["runs"]["cross-layer"]["tokens"]
