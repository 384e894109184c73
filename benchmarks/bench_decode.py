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
and summarised as median [min, max] over rounds.

Each release runs in its own interpreter (``--python``, one per release,
default: this one); in it both engines are forked children, idle while the
other is measured, one OpenMP thread each (``--threads``).

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
``benchmarks/results/decode.json``; ``--quick``: a temporary folder).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_prefix_reuse import Engine, _loadavg, _stats, prompt_ids  # noqa: E402

LAYOUTS = ("stock", "cross-layer")
# KV-heavy shape (see the docstring): build_bench_llama.Shape fields.
MODEL_SHAPE = {
    "layers": 16,
    "hidden": 512,
    "heads": 8,
    "kv_heads": 8,
    "head_dim": 64,
    "intermediate": 1024,
}


def engine_spec(release: str, layout: str) -> dict:
    """How each release gets each layout (see the docstring)."""
    cross = layout == "cross-layer"
    if release.startswith("0.11."):
        return {
            "connector": {
                "kv_connector": "CrossLayerProbeConnector",
                "kv_role": "kv_both",
                "kv_connector_extra_config": {"prefer_cross_layer_blocks": cross},
            },
            "env": {},
        }
    return {
        "connector": None,
        "env": {"VLLM_KV_CACHE_LAYOUT": "BLHNC"} if cross else {},
    }


# -- engine side (a forked child) ---------------------------------------------
def kv_layout(worker) -> dict:
    """Runs in the worker (collective_rpc): every attention layer's KV tensor
    and how many layers' pages its block stride spans."""
    import torch
    import vllm

    runner = worker.model_runner
    num_blocks = runner.cache_config.num_gpu_blocks
    # Block dimension: 0.11.2's CPU_ATTN shape is (2, blocks, heads, tokens,
    # head_size); 0.32's is (blocks, heads, tokens, 2 * head_size).
    block_dim = 1 if vllm.__version__.startswith("0.11.") else 0
    layers = []
    for layer in runner.compilation_config.static_forward_context.values():
        cache = getattr(layer, "kv_cache", None)
        if cache is None:
            continue
        t = cache[0] if isinstance(cache, (list, tuple)) else cache
        if not isinstance(t, torch.Tensor) or not t.numel():
            continue
        assert t.shape[block_dim] == num_blocks, (t.shape, num_blocks)
        page = t.numel() // num_blocks  # one layer's KV of one block
        layers.append(
            {
                "shape": list(t.shape),
                "stride": list(t.stride()),
                "storage": t.untyped_storage().data_ptr(),
                "layers_per_block_stride": t.stride(block_dim) / page,
            }
        )
    resolved = getattr(runner.cache_config, "get_resolved_kv_cache_layout", None)
    return {
        "vllm": vllm.__version__,
        "num_layers": len(layers),
        "num_blocks": num_blocks,
        "block_size": runner.cache_config.block_size,
        "buffers": len({x["storage"] for x in layers}),
        "layers_per_block_stride": sorted(
            {x["layers_per_block_stride"] for x in layers}
        ),
        "layer0": layers[0] if layers else None,
        "resolved_layout": resolved().name if resolved else None,
        "cross_layer_buffer": getattr(runner, "cross_layers_kv_cache", None)
        is not None,
    }


class DecodeServer:
    def __init__(self, spec: dict) -> None:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # worker in-process
        os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # collective_rpc
        os.environ.update(spec["env"])
        import torch
        from vllm import LLM
        from vllm.config import KVTransferConfig

        torch.set_num_threads(spec["threads"])
        kv = KVTransferConfig(**spec["connector"]) if spec["connector"] else None
        started = time.perf_counter()
        self.llm = LLM(
            model=spec["model"],
            dtype="float32",
            max_model_len=spec["max_model_len"],
            max_num_seqs=spec["max_batch"],
            num_gpu_blocks_override=spec["num_blocks"],
            enforce_eager=True,
            seed=0,
            kv_transfer_config=kv,
        )
        self.engine_s = time.perf_counter() - started
        self.runs = 0

    def handle(self, op: str, cmd: dict):
        if op == "run":
            return self.run(cmd)
        if op == "describe":
            import resource

            return {
                **self.llm.collective_rpc(kv_layout)[0],
                "engine_s": self.engine_s,
                "max_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
                / 1024,
            }
        raise ValueError(f"unknown op {op!r}")

    def run(self, cmd: dict) -> dict:
        """The batch's prompts at once; every step timed."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        engine = self.llm.llm_engine
        params = SamplingParams(
            temperature=0.0,
            max_tokens=cmd["max_tokens"],
            ignore_eos=True,
            output_kind=RequestOutputKind.DELTA,
        )
        self.runs += 1
        names = [f"run{self.runs}-{i:03d}" for i in range(len(cmd["seeds"]))]
        for name, seed in zip(names, cmd["seeds"]):
            ids = prompt_ids(seed, cmd["n"], cmd["vocab"])
            engine.add_request(name, TokensPrompt(prompt_token_ids=ids), params)
        tokens: dict[str, list[int]] = {}
        cached: dict[str, int] = {}
        steps = []  # (seconds, tokens generated, every request had a token before)
        while engine.has_unfinished_requests():
            decoding = len(tokens) == len(names)
            t0 = time.perf_counter()
            outs = engine.step()
            dt = time.perf_counter() - t0
            new = 0
            for o in outs:
                got = list(o.outputs[0].token_ids)
                tokens.setdefault(o.request_id, []).extend(got)
                new += len(got)
                if o.finished:
                    cached[o.request_id] = o.num_cached_tokens or 0
            steps.append((dt, new, decoding))
        order = sorted(tokens)  # the names, possibly with a suffix vLLM added
        decode = [(dt, n) for dt, n, d in steps if d]
        decode_s = sum(dt for dt, _ in decode)
        decode_tokens = sum(n for _, n in decode)
        return {
            "tokens": [tokens[r] for r in order],
            "cached_tokens": [cached.get(r) for r in order],
            "steps": len(steps),
            "decode_steps": len(decode),
            "decode_tokens": decode_tokens,
            "decode_s": decode_s,
            "decode_tok_s": decode_tokens / decode_s if decode_s > 0 else None,
            "median_step_s": statistics.median(dt for dt, _ in decode)
            if decode
            else None,
            "prefill_s": sum(dt for dt, _, d in steps if not d),
            "step_s": [round(dt, 6) for dt, _ in decode],
        }


# -- one release, in its own interpreter -----------------------------------------
def run_release(args, model: str, cells: list[tuple[int, int]], out: str) -> None:
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # before torch is imported
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    sys.path.insert(0, str(ROOT))
    from vllm_overlay.demo import _quiet, cpu_defaults

    cpu_defaults()
    workdir = tempfile.mkdtemp(prefix="bench-decode-")
    with _quiet(os.path.join(workdir, "import.log")):
        import vllm
        from vllm import LLM  # noqa: F401  (imported once, before the forks)
    release = vllm.__version__
    cfg = json.loads((pathlib.Path(model) / "config.json").read_text())
    vocab = cfg["vocab_size"]
    block = 128  # CPU_ATTN's block size on both releases (checked below)
    max_batch = max(b for _, b in cells)
    contexts = sorted({c for c, _ in cells})
    # A prompt of context + 1 tokens: its context tokens are full blocks the
    # prefix cache serves; the one token left is the round's prefill.
    cached_blocks = max_batch * sum(c // block for c in contexts)
    work_blocks = max_batch * (2 + (1 + args.max_tokens) // block)
    base = {
        "model": model,
        "threads": args.threads,
        "max_model_len": max(contexts) + 1 + args.max_tokens + block,
        "max_batch": max_batch,
        "num_blocks": cached_blocks + 2 * work_blocks + 8,
    }
    kv_bytes = base["num_blocks"] * block * kv_bytes_per_token(cfg)
    # The CPU platform sizes its KV space from this (GiB); the override sets
    # the block count within it.
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(-(-kv_bytes // 2**30) + 1)
    print(
        f"[{release}] engines starting (logs in {workdir}); "
        f"{base['num_blocks']} KV blocks each",
        flush=True,
    )
    started = time.perf_counter()
    engines: dict[str, Engine] = {}
    result: dict = {"release": release, "rounds": [], "problems": []}
    try:
        for layout in LAYOUTS:
            spec = {**base, **engine_spec(release, layout)}
            engines[layout] = Engine(layout, spec, workdir, server=DecodeServer)
        for e in engines.values():
            e.wait_ready()
        info = {k: e.call("describe") for k, e in engines.items()}
        result["engines"] = info
        result["problems"] += check_layouts(info)
        if any(i["block_size"] != block for i in info.values()):
            raise SystemExit(f"block size is not {block}: {info}")
        print(
            f"[{release}] engines up in {time.perf_counter() - started:.0f} s; "
            "warm-up (every prompt prefilled once)",
            flush=True,
        )

        def cmd(ctx: int, batch: int, max_tokens: int) -> dict:
            seeds = [args.seed + 1000 * ctx + i for i in range(batch)]
            return {
                "seeds": seeds,
                "n": ctx + 1,
                "vocab": vocab,
                "max_tokens": max_tokens,
            }

        for ctx in contexts:  # the largest batch's prompts hold every batch's
            for e in engines.values():
                e.call("run", **cmd(ctx, max_batch, 2))
        print(
            f"[{release}] {time.perf_counter() - started:.0f} s, warm-up done",
            flush=True,
        )
        for r in range(args.rounds):
            order = LAYOUTS if r % 2 == 0 else LAYOUTS[::-1]
            rec = {"round": r + 1, "order": list(order), "cells": []}
            for ctx, batch in cells:
                runs = {}
                for layout in order:
                    time.sleep(0.2)  # the other engine's threads go idle
                    runs[layout] = engines[layout].call(
                        "run", **cmd(ctx, batch, args.max_tokens + 1)
                    )
                rec["cells"].append({"context": ctx, "batch": batch, "runs": runs})
                result["problems"] += check_cell(r + 1, ctx, batch, runs, block)
            result["rounds"].append(rec)
            line = ", ".join(
                f"{c['context']}x{c['batch']} "
                + "/".join(f"{c['runs'][k]['decode_tok_s']:.1f}" for k in LAYOUTS)
                for c in rec["cells"]
            )
            print(
                f"[{release}] {time.perf_counter() - started:.0f} s, "
                f"round {r + 1}/{args.rounds}: decode tok/s "
                f"stock/cross-layer {line}",
                flush=True,
            )
    finally:
        for e in engines.values():
            e.stop()
    result["wall_s"] = time.perf_counter() - started
    pathlib.Path(out).write_text(json.dumps(result))
    if not result["problems"]:
        shutil.rmtree(workdir, ignore_errors=True)


def check_layouts(info: dict) -> list[str]:
    """stock: block stride spans one layer; cross-layer: all of them, one buffer."""
    out = []
    for layout, i in info.items():
        spans = i["layers_per_block_stride"]
        if layout == "cross-layer":
            ok = spans == [i["num_layers"]] and i["buffers"] == 1
        else:
            ok = len(spans) == 1 and spans[0] <= 1
        if not ok or i["num_layers"] < 2:
            out.append(
                f"engine {layout}: block stride spans {spans} layer(s) in "
                f"{i['buffers']} buffer(s) of {i['num_layers']} layers"
            )
    return out


def check_cell(r: int, ctx: int, batch: int, runs: dict, block: int) -> list[str]:
    out = []
    where = f"round {r}, context {ctx}, batch {batch}"
    if runs["stock"]["tokens"] != runs["cross-layer"]["tokens"]:
        out.append(f"{where}: the layouts generated different tokens")
    for layout, res in runs.items():
        if res["cached_tokens"] != [ctx // block * block] * batch:
            out.append(
                f"{where}, {layout}: cached tokens {res['cached_tokens']} "
                f"(expected {ctx // block * block} each)"
            )
        if not res["decode_tok_s"] or res["decode_tokens"] < batch:
            out.append(f"{where}, {layout}: no decode steps")
    return out


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
                    "stock_tok_s": _stats(tok["stock"]),
                    "cross_tok_s": _stats(tok["cross-layer"]),
                    "ratio": _stats(ratio),
                    "ratio_ci": median_ci(ratio),
                    "median_step_ratio": _stats(step_ratio),
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
    if spec["connector"]:
        extra = spec["connector"]["kv_connector_extra_config"]
        return f"{spec['connector']['kv_connector']} {extra}"
    return " ".join(f"{k}={v}" for k, v in spec["env"].items()) or "default layout"


def ensure_model(args, python: str) -> str:
    if args.model:
        return args.model
    if args.quick:
        code = "from vllm_overlay.demo import tiny_model_path; print(tiny_model_path())"
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


def kv_bytes_per_token(cfg: dict) -> int:
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim * 4


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
    load_start = _loadavg()
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
        rel["how"] = {k: how(rel["release"], k) for k in LAYOUTS}
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
        "loadavg_end": _loadavg(),
        "wall_s": time.perf_counter() - started,
        "quick": args.quick,
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
    out_dir = (
        pathlib.Path(tempfile.mkdtemp(prefix="bench-decode-out-"))
        if args.quick
        else RESULTS
    )
    json_path = pathlib.Path(args.json or out_dir / "decode.json")
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
