"""CPU_ATTN's decode kernel alone: per-layer KV caches against views of one
cross-layer buffer.

``bench_decode.py`` times whole decode steps; this times only vLLM's own
decode attention op (``cpu_attention_with_kv_cache``, called through
``vllm._custom_ops`` as CPU_ATTN calls it) on the two KV layouts, holding
the same bytes, so that what the block stride costs is not hidden behind
the rest of a step:

* vLLM 0.11.2: ``stock`` = one ``(2, blocks, heads, tokens, head_size)``
  tensor per layer (vLLM's own allocation), K and V by ``unbind(0)``;
  ``cross-layer`` = one ``[blocks, layers, 2, heads, tokens, head_size]``
  buffer (the overlay's CL-09 layout), each layer a strided view of it.
* vLLM 0.32: ``stock`` = ``LBHNC`` (``[layers, blocks, heads, tokens,
  2 * head_size]``), ``cross-layer`` = ``BLHNC`` (blocks outermost), each
  layer's 4-D view split into K and V with the backend's own
  ``view(...).chunk(2, dim=2)``.

A timed "step" is the op called once per layer for every layer, as a decode
step does (one query token per request, every request's blocks distinct and
random).  The two layouts alternate step by step (ABAB...); every output is
compared bit for bit between the layouts first.  Cells: per-step
milliseconds, median and min over ``--reps`` steps; the ratio cross-layer /
stock of the per-pair times, median and a sign-test 95% CI of that median
(min is the least disturbed by other processes on a shared machine).

    python benchmarks/bench_attn_stride.py            # in each release's venv
    python benchmarks/bench_attn_stride.py --reps 200 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_decode import median_ci  # noqa: E402


def layer_views(release: str, layout: str, shape: dict, generator):
    """Per layer (K, V) as CPU_ATTN hands them to the op, filled from one
    seeded generator in logical order, so both layouts hold the same
    bytes."""
    import torch

    L, B, H, N, D = (shape[k] for k in ("layers", "blocks", "heads", "tokens", "dim"))
    if release.startswith("0.11."):
        if layout == "stock":
            layers = [torch.empty(2, B, H, N, D) for _ in range(L)]
        else:
            buf = torch.empty(B, L, 2, H, N, D)
            layers = [buf[:, i].transpose(0, 1) for i in range(L)]
        for t in layers:
            t.copy_(torch.randn(t.shape, generator=generator))
        return [t.unbind(0) for t in layers]
    if layout == "stock":
        buf = torch.empty(L, B, H, N, 2 * D)
        layers = [buf[i] for i in range(L)]
    else:
        buf = torch.empty(B, L, H, N, 2 * D)
        layers = [buf[:, i] for i in range(L)]
    out = []
    for t in layers:
        t.copy_(torch.randn(t.shape, generator=generator))
        out.append(t.view(B, H, 2 * N, D).chunk(2, dim=2))
    return out


def attention_call(
    release: str, shape: dict, ctx: int, batch: int, seed: int, sequential: bool
):
    """A function running the op on one layer's (K, V), and its inputs."""
    import torch
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends import cpu_attn

    H, N, D = shape["heads"], shape["tokens"], shape["dim"]
    g = torch.Generator().manual_seed(seed)
    per_seq = ctx // N + 1  # the context's blocks and the decode token's
    if sequential:  # as a fresh engine hands them out: one run per request
        ids = torch.arange(batch * per_seq)
    else:
        ids = torch.randperm(shape["blocks"], generator=g)[: batch * per_seq]
    block_table = ids.view(batch, per_seq).to(torch.int32).contiguous()
    seq_lens = torch.full((batch,), ctx + 1, dtype=torch.int32)
    qsl = torch.arange(batch + 1, dtype=torch.int32)
    query = torch.randn(batch, H, D, generator=g)
    isa = cpu_attn._get_attn_isa(torch.float32, N)
    common = dict(
        num_reqs=batch,
        num_heads=H,
        num_kv_heads=H,
        head_dim=D,
        seq_lens=seq_lens,
        dtype=torch.float32,
        query_start_loc=qsl,
        causal=True,
        sliding_window_size=-1,
        isa=isa,
    )
    if release.startswith("0.11."):
        meta = ops.cpu_attn_get_scheduler_metadata(**common, enable_kv_split=True)
        window = (-1, -1)
    else:
        import vllm.envs as envs

        meta = ops.cpu_attn_get_scheduler_metadata(
            **common, enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV
        )
        window = -1

    def run(k, v, out):
        ops.cpu_attention_with_kv_cache(
            query=query,
            key_cache=k,
            value_cache=v,
            output=out,
            query_start_loc=qsl,
            seq_lens=seq_lens,
            scale=D**-0.5,
            causal=True,
            alibi_slopes=None,
            sliding_window=window,
            block_table=block_table,
            softcap=0.0,
            scheduler_metadata=meta,
            s_aux=None,
        )

    return run, isa


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=100, help="steps per layout")
    ap.add_argument("--contexts", default="128,2048")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--heads", type=int, default=8, help="KV heads (= query heads)")
    ap.add_argument("--dim", type=int, default=64, help="head size")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument(
        "--block-ids",
        choices=("random", "sequential"),
        default="random",
        help="each request's blocks: random distinct ids, or consecutive ones",
    )
    ap.add_argument(
        "--control",
        action="store_true",
        help="A/A: a second stock allocation in place of the cross-layer one",
    )
    ap.add_argument("--json")
    args = ap.parse_args()
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    import torch
    import vllm

    torch.set_num_threads(args.threads)
    release = vllm.__version__
    contexts = [int(x) for x in args.contexts.split(",")]
    batches = [int(x) for x in args.batches.split(",")]
    N = 128
    blocks = max(batches) * (max(contexts) // N + 1) + 8
    shape = dict(
        layers=args.layers, blocks=blocks, heads=args.heads, tokens=N, dim=args.dim
    )
    # --control: the "cross-layer" column is a second stock allocation (an
    # A/A run: what two allocations of the same layout differ by).
    caches = {
        key: layer_views(
            release,
            "stock" if args.control else key,
            shape,
            torch.Generator().manual_seed(1),
        )
        for key in ("stock", "cross-layer")
    }
    rows, problems = [], []
    for ctx in contexts:
        for batch in batches:
            run, isa = attention_call(
                release, shape, ctx, batch, ctx + batch, args.block_ids == "sequential"
            )
            outs = {}
            for layout, kv in caches.items():  # correctness first
                outs[layout] = [torch.zeros(batch, args.heads, args.dim) for _ in kv]
                for (k, v), out in zip(kv, outs[layout]):
                    run(k, v, out)
            same = all(
                torch.equal(a, b) for a, b in zip(outs["stock"], outs["cross-layer"])
            )
            if not same:
                problems.append(f"context {ctx}, batch {batch}: outputs differ")
            times = {k: [] for k in caches}
            for rep in range(args.reps + 2):  # the first two pairs: warm-up
                order = ("stock", "cross-layer")[:: 1 if rep % 2 == 0 else -1]
                for layout in order:
                    kv, out = caches[layout], outs[layout]
                    t0 = time.perf_counter()
                    for (k, v), o in zip(kv, out):
                        run(k, v, o)
                    if rep >= 2:
                        times[layout].append(time.perf_counter() - t0)
            ratio = [c / s for s, c in zip(times["stock"], times["cross-layer"])]
            row = {
                "release": release,
                "isa": isa,
                "context": ctx,
                "batch": batch,
                "kv_mib_per_step": batch
                * (ctx + 1)
                * args.layers
                * 2
                * args.heads
                * args.dim
                * 4
                / 2**20,
                "stock_ms": {
                    "median": 1e3 * statistics.median(times["stock"]),
                    "min": 1e3 * min(times["stock"]),
                },
                "cross_ms": {
                    "median": 1e3 * statistics.median(times["cross-layer"]),
                    "min": 1e3 * min(times["cross-layer"]),
                },
                "ratio_median": statistics.median(ratio),
                "ratio_ci": median_ci(ratio),
                "ratio_of_mins": min(times["cross-layer"]) / min(times["stock"]),
                "same_output": same,
                "reps": args.reps,
            }
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
    print(
        f"CPU_ATTN decode op (vLLM {release}, ISA {rows[0]['isa']}), "
        f"{args.layers} layers x {args.heads} KV heads x {args.dim}, float32, "
        f"128-token blocks ({args.block_ids} block ids), {args.threads} "
        f"thread(s); {args.reps} interleaved steps per layout; load average "
        f"{[round(x, 2) for x in os.getloadavg()]}."
    )
    if args.control:
        print("CONTROL run: the cross-layer column is a 2nd stock allocation.")
    head = [
        "vLLM",
        "context",
        "batch",
        "KV read per step (MiB)",
        "stock ms/step: median (min)",
        "cross-layer ms/step: median (min)",
        "cross / stock time (paired): median, 95% CI",
        "ratio of mins",
        "same output",
    ]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for r in rows:
        ci = r["ratio_ci"]
        print(
            "| "
            + " | ".join(
                [
                    r["release"],
                    str(r["context"]),
                    str(r["batch"]),
                    f"{r['kv_mib_per_step']:.0f}",
                    f"{r['stock_ms']['median']:.3f} ({r['stock_ms']['min']:.3f})",
                    f"{r['cross_ms']['median']:.3f} ({r['cross_ms']['min']:.3f})",
                    f"{r['ratio_median']:.3f}"
                    + ("" if ci is None else f", [{ci[0]:.3f}, {ci[1]:.3f}]"),
                    f"{r['ratio_of_mins']:.3f}",
                    "yes" if r["same_output"] else "NO",
                ]
            )
            + " |"
        )
    print("Ratio < 1: the cross-layer views are faster.")
    for p in problems:
        print(f"PROBLEM: {p}")
    if args.json:
        pathlib.Path(args.json).write_text(
            json.dumps({"rows": rows, "problems": problems, "shape": shape}, indent=1)
        )
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
