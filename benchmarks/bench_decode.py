"""Decode throughput: does the cross-layer KV layout slow CPU_ATTN's decode?

Under the cross-layer layout every layer's KV cache is a strided view of one
buffer: a block's stride spans every layer's page of that block, where the
stock layout has one layer's page.  This benchmark measures decode tokens/s
of the two layouts side by side, on each vLLM release the overlay supports,
with everything else the same:

* vLLM 0.11.2: both engines run the overlay with its
  ``CrossLayerProbeConnector`` (a connector that moves nothing):
  ``stock`` = ``prefer_cross_layer_blocks: false`` (vLLM's own per-layer
  allocation, ``(2, blocks, heads, tokens, head_size)`` per layer),
  ``cross-layer`` = ``prefer_cross_layer_blocks: true`` (patch CL-09: one
  ``[blocks, layers, 2, heads, tokens, head_size]`` buffer).  The connector
  is in both, so the layout is the only difference.
* vLLM 0.32: both engines run the overlay; ``stock`` = the default layout
  (``LBHNC``), ``cross-layer`` = ``VLLM_KV_CACHE_LAYOUT=BLHNC`` (patch
  CL32-01: upstream's own cross-layer allocation, offered to CPU_ATTN).

Each engine's layout is checked, not assumed: the worker reports every
attention layer's KV tensor, and ``cross-layer`` must be one buffer whose
block stride spans all layers, ``stock`` one whose block stride spans one.

What is timed: the decode phase only.  The script drives the engine itself
(``LLMEngine.add_request`` / ``step``, in-process, no front-end process)
and times every ``step()``; a round's decode tok/s is the tokens the batch
generated in the steps after every request had its first token, over those
steps' seconds.  Prefill, engine start and the first token are left out.
The prompts are random token ids, one per batch slot, none sharing a block
with another; each is prefilled once in a warm-up, and afterwards vLLM's
prefix cache serves all its full blocks (checked in every round: cached
tokens = full blocks), so a round's prefill is the one uncached token.
Greedy, ``ignore_eos``: both layouts must generate the same tokens in every
round (checked; a difference is a problem and exit status 1).

Rounds are interleaved and paired: in each round every (context, batch)
cell runs on both engines back to back, the order swapped from round to
round (ABBA...); the ratio cross-layer / stock is taken within the round
and summarised as median [min, max] over rounds, with a distribution-free
95% confidence interval of the median (sign test; 6+ rounds).  A second
ratio uses each run's median step time instead of its total: a step that
another process stalled moves the total, not the median, so on a shared
machine that ratio is the one to read.  Every step's seconds are in the
JSON.  ``--control`` is the A/A run: the second engine is a stock one too,
so its ratios are what two engines of the same layout differ by (a layout
effect smaller than that floor is not resolved).

Each release runs in its own interpreter (``--python``, one per release,
default: this one; ``decode_release.py`` is that half); in it both engines
are forked children, idle while the other is measured, one OpenMP thread
each (``--threads``).

The default model is a Llama-shaped random-weight model whose decode is
dominated by KV reads at long contexts (``build_bench_llama.Shape``:
16 layers, hidden 512, 8 query and 8 KV heads of 64, MLP 1024: 42 M
parameters, 168 MB in float32, and 64 KiB of KV per token, as much as the
prefix-reuse benchmark's 190 M-parameter model: at 2048 tokens a sequence
holds 128 MiB of KV against 168 MB of weights).  ``--model`` takes another
folder.  ``--quick`` is the smoke test (tiny 4-layer model, short contexts,
one round).

    python benchmarks/bench_decode.py --python .venv/bin/python \\
        --python .venv-0.32/bin/python --rounds 12
    python benchmarks/bench_decode.py --quick

Prints the table; writes ``--json`` (default
``benchmarks/results/decode.json``; ``--quick``: a temporary folder);
``--replot JSON`` prints a saved run's table again.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
sys.path.insert(0, str(ROOT / "benchmarks"))
from decode_release import (  # noqa: E402
    LAYOUTS,
    as_built,
    engine_spec,
    kv_bytes_per_token,
    run_release,
)
from prefix_reuse_report import loadavg, spread  # noqa: E402

# KV-heavy shape (see the docstring): build_bench_llama.Shape fields.
MODEL_SHAPE = {
    "layers": 16,
    "hidden": 512,
    "heads": 8,
    "kv_heads": 8,
    "head_dim": 64,
    "intermediate": 1024,
}


# -- driver ----------------------------------------------------------------------
def summarise(releases: list[dict]) -> list[dict]:
    rows = []
    for rel in releases:
        n_cells = len(rel["rounds"][0]["cells"]) if rel["rounds"] else 0
        for c in range(n_cells):
            cells = [rnd["cells"][c] for rnd in rel["rounds"]]
            tok = {k: [x["runs"][k]["decode_tok_s"] for x in cells] for k in LAYOUTS}
            ratio = [b / a for a, b in zip(tok["stock"], tok["cross-layer"])]
            step_ratio = [
                x["runs"]["stock"]["median_step_s"]
                / x["runs"]["cross-layer"]["median_step_s"]
                for x in cells
            ]
            rows.append(
                {
                    "release": rel["release"],
                    "context": cells[0]["context"],
                    "batch": cells[0]["batch"],
                    "decode_steps": cells[0]["runs"]["stock"]["decode_steps"],
                    "stock_tok_s": spread(tok["stock"]),
                    "cross_tok_s": spread(tok["cross-layer"]),
                    "ratio": spread(ratio),
                    "ratio_ci": median_ci(ratio),
                    "median_step_ratio": spread(step_ratio),
                    "median_step_ratio_ci": median_ci(step_ratio),
                    "same_tokens": sum(
                        x["runs"]["stock"]["tokens"]
                        == x["runs"]["cross-layer"]["tokens"]
                        for x in cells
                    ),
                    "rounds": len(cells),
                }
            )
    return rows


def median_ci(values: list[float]) -> tuple[float, float, float] | None:
    """A distribution-free confidence interval of the median (the sign
    test's order statistics): the k-th smallest and k-th largest values,
    k the largest rank whose binomial tail stays within 2.5 %; returns
    (low, high, coverage), or None when fewer than 6 values allow none."""
    n = len(values)
    tail, k = 0.0, 0
    while True:
        nxt = tail + math.comb(n, k) / 2**n  # P(X <= k)
        if nxt > 0.025:
            break
        tail, k = nxt, k + 1
    if k == 0:
        return None
    x = sorted(values)
    return x[k - 1], x[n - k], 1 - 2 * tail


def _ci(ci: tuple | None) -> str:
    return "-" if ci is None else "[{:.3f}, {:.3f}] ({:.1%})".format(*ci)


def _fmt(s: dict, f: str) -> str:
    return f"{s['median']:{f}} [{s['min']:{f}}, {s['max']:{f}}]"


def print_table(rows: list[dict], meta: dict) -> None:
    print(
        f"Decode on CPU: {meta['layers']}-layer Llama-shaped model (hidden "
        f"{meta['hidden']}, {meta['kv_heads']} KV heads x {meta['head_dim']}, "
        f"float32, random weights, {meta['kv_bytes_per_token'] // 1024} KiB of KV "
        f"per token), {meta['max_tokens']} tokens generated per request "
        f"(greedy); {meta['threads']} OpenMP thread(s) per engine, {meta['cpus']} "
        f"CPUs, load average {meta['loadavg_start']} at the start, "
        f"{meta['loadavg_end']} at the end."
    )
    if meta.get("control"):
        print(
            "CONTROL run (A/A): the cross-layer columns are a second stock "
            "engine; the ratios are two engines' noise floor."
        )
    print()
    head = [
        "vLLM",
        "context (cached prompt tokens)",
        "batch",
        "decode steps / round",
        "stock decode tok/s: median [min, max]",
        "cross-layer decode tok/s: median [min, max]",
        "cross-layer / stock tok/s (paired): median [min, max]",
        "ratio's median: 95% CI (sign test)",
        "cross-layer / stock by each run's median step (paired): median, 95% CI",
        "same tokens (rounds)",
        "rounds",
    ]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for row in rows:
        cells = [
            row["release"],
            str(row["context"]),
            str(row["batch"]),
            str(row["decode_steps"]),
            _fmt(row["stock_tok_s"], ".1f"),
            _fmt(row["cross_tok_s"], ".1f"),
            _fmt(row["ratio"], ".3f"),
            _ci(row["ratio_ci"]),
            f"{row['median_step_ratio']['median']:.3f}, "
            + _ci(row["median_step_ratio_ci"]),
            f"{row['same_tokens']}/{row['rounds']}",
            str(row["rounds"]),
        ]
        print("| " + " | ".join(cells) + " |")
    print()
    print(
        "decode tok/s = tokens the batch generated in the steps after every "
        "request had its first token / those steps' seconds (each "
        "LLMEngine.step() timed in the engine's process); prefill and the "
        "first token excluded.  Ratio > 1: cross-layer faster; a CI (its "
        "coverage in brackets) needs 6+ rounds.  The median-step ratio (a "
        "run's median step time, stock's over cross-layer's) ignores the "
        "few steps another process stalled: on a shared machine, trust it "
        "over the tok/s ratio."
    )
    for rel in meta["releases"]:
        for layout, i in rel["engines"].items():
            how = (
                f"{i['buffers']} buffer(s) for {i['num_layers']} layers, block "
                f"stride = {i['layers_per_block_stride']} x one layer's block"
            )
            if i.get("resolved_layout"):
                how = f"{i['resolved_layout']}, " + how
            print(
                f"vLLM {rel['release']} {layout}: {rel['how'][layout]}; {how}; "
                f"layer 0 KV {i['layer0']['shape']} strides {i['layer0']['stride']}; "
                f"built in {i['engine_s']:.1f} s, max RSS {i['max_rss_mib']:.0f} MiB"
            )


def how(release: str, layout: str) -> str:
    spec = engine_spec(release, layout)
    if spec["probe_prefer"] is not None:
        return (
            "CrossLayerProbeConnector, prefer_cross_layer_blocks "
            f"{str(spec['probe_prefer']).lower()}"
        )
    return " ".join(f"{k}={v}" for k, v in spec["env"].items()) or "default layout"


def ensure_model(args, python: str) -> str:
    if args.model:
        return args.model
    if args.quick:
        code = (
            "from vllm_overlay.testing import tiny_model_path; print(tiny_model_path())"
        )
    else:
        code = (
            "from vllm_overlay.models.build_bench_llama import Shape, ensure; "
            f"print(ensure(Shape(**{MODEL_SHAPE!r})))"
        )
    built = subprocess.run(
        [python, "-c", code],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    if built.returncode:
        raise SystemExit(f"building the model failed:\n{built.stderr[-3000:]}")
    return built.stdout.splitlines()[-1]


def cells_of(args) -> list[tuple[int, int]]:
    contexts = args.contexts or ([128, 256] if args.quick else [128, 2048])
    batches = args.batches or ([1, 2] if args.quick else [1, 8])
    return [(c, b) for c in contexts for b in batches]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny model, 1 round")
    ap.add_argument(
        "--python",
        action="append",
        help="an interpreter with a vLLM release; repeat for each (default: this one)",
    )
    ap.add_argument("--rounds", type=int, help="default 12 (--quick: 1)")
    ap.add_argument(
        "--contexts",
        type=lambda s: [int(x) for x in s.split(",")],
        help="cached prompt tokens, multiples of 128 (default 128,2048)",
    )
    ap.add_argument(
        "--batches",
        type=lambda s: [int(x) for x in s.split(",")],
        help="requests decoded together (default 1,8)",
    )
    ap.add_argument(
        "--max-tokens", type=int, help="decode steps timed per run (default 32)"
    )
    ap.add_argument("--threads", type=int, default=1, help="OpenMP threads/engine")
    ap.add_argument("--model", help="a model folder (default: built/cached)")
    ap.add_argument("--json", help="default benchmarks/results/decode.json")
    ap.add_argument("--seed", type=int, default=7000)
    ap.add_argument(
        "--control",
        action="store_true",
        help="A/A: a second stock engine in place of the cross-layer one",
    )
    ap.add_argument("--replot", metavar="JSON", help="print the table of a run")
    ap.add_argument("--child", metavar="OUT", help=argparse.SUPPRESS)
    ap.add_argument("--child-model", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.replot:
        saved = json.loads(pathlib.Path(args.replot).read_text())
        print_table(summarise(saved["releases"]), saved["meta"])
        for p in saved["problems"]:
            print(f"PROBLEM: {p}")
        return 0
    args.rounds = args.rounds or (1 if args.quick else 12)
    args.max_tokens = args.max_tokens or (8 if args.quick else 32)
    cells = cells_of(args)
    if any(c % 128 for c, _ in cells):
        raise SystemExit("--contexts: multiples of 128 (CPU_ATTN's block)")
    if args.child:
        run_release(args, args.child_model, cells, args.child)
        return 0

    started = time.perf_counter()
    load_start = loadavg()
    pythons = args.python or [sys.executable]
    model = ensure_model(args, pythons[0])
    cfg = json.loads((pathlib.Path(model) / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    tmp = tempfile.mkdtemp(prefix="bench-decode-out-")
    releases, problems = [], []
    for k, python in enumerate(pythons):
        out = os.path.join(tmp, f"release{k}.json")
        argv = [a for a in sys.argv[1:]]
        code = subprocess.run(
            [python, __file__, *argv, "--child", out, "--child-model", model],
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        ).returncode
        if code or not os.path.exists(out):
            problems.append(f"{python}: the release's run failed (exit {code})")
            continue
        rel = json.loads(pathlib.Path(out).read_text())
        rel["python"] = python
        rel["how"] = {
            k: how(rel["release"], as_built(k, args.control)) for k in LAYOUTS
        }
        releases.append(rel)
        problems += [f"vLLM {rel['release']}: {p}" for p in rel["problems"]]
    shutil.rmtree(tmp, ignore_errors=True)
    meta = {
        "model": model,
        "layers": cfg["num_hidden_layers"],
        "hidden": cfg["hidden_size"],
        "kv_heads": cfg["num_key_value_heads"],
        "head_dim": head_dim,
        "kv_bytes_per_token": kv_bytes_per_token(cfg),
        "max_tokens": args.max_tokens,
        "rounds": args.rounds,
        "threads": args.threads,
        "cpus": os.cpu_count(),
        "loadavg_start": load_start,
        "loadavg_end": loadavg(),
        "wall_s": time.perf_counter() - started,
        "quick": args.quick,
        "control": args.control,
        "releases": [
            {k: r[k] for k in ("release", "python", "engines", "how", "wall_s")}
            for r in releases
        ],
    }
    rows = summarise(releases)
    print()
    print_table(rows, meta)
    for p in problems:
        print(f"PROBLEM: {p}")
    if args.json:
        json_path = pathlib.Path(args.json)
    elif args.quick:
        json_path = pathlib.Path(tempfile.mkdtemp(prefix="bench-decode-out-"))
        json_path /= "decode.json"
    else:
        json_path = RESULTS / "decode.json"
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(
        json.dumps(
            {"meta": meta, "rows": rows, "releases": releases, "problems": problems},
            indent=1,
        )
    )
    print(f"JSON: {json_path}")
    print(f"wall time {meta['wall_s']:.0f} s")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
