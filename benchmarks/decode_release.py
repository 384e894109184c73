"""One vLLM release's half of ``bench_decode.py``, run in that release's
interpreter: the two engines (forked children, one per KV layout), how each
gets its layout, the interleaved rounds and their checks.  The driver,
the summary and the table are in ``bench_decode.py``."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import statistics
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))  # vllm_overlay of this checkout
from prefix_reuse_engine import Engine, prompt_ids  # noqa: E402

LAYOUTS = ("stock", "cross-layer")


def engine_spec(release: str, layout: str) -> dict:
    """How each release gets each layout (bench_decode.py's docstring):
    0.11.2, the probe connector asking for cross-layer blocks or not; 0.32,
    VLLM_KV_CACHE_LAYOUT for cross-layer, vLLM's default otherwise."""
    from vllm_overlay.testing.v0_32 import CROSS_LAYER

    cross = layout == "cross-layer"
    if release.startswith("0.11."):
        return {"probe_prefer": cross, "env": {}}
    return {
        "probe_prefer": None,
        "env": {"VLLM_KV_CACHE_LAYOUT": CROSS_LAYER} if cross else {},
    }


def kv_bytes_per_token(cfg: dict) -> int:
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim * 4


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
        from vllm_overlay.testing import in_process_engine

        in_process_engine()  # worker in this process; collective_rpc allowed
        os.environ.update(spec["env"])
        import torch
        from vllm import LLM

        torch.set_num_threads(spec["threads"])
        kv = None
        if spec["probe_prefer"] is not None:
            from vllm_overlay.testing.v0_11_2 import probe_connector

            kv = probe_connector(prefer=spec["probe_prefer"])
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
    from vllm_overlay.testing import cpu_defaults, quiet

    cpu_defaults()
    workdir = tempfile.mkdtemp(prefix="bench-decode-")
    with quiet(os.path.join(workdir, "import.log")):
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
            # --control (A/A): the second engine is a stock one too.
            spec = {**base, **engine_spec(release, as_built(layout, args.control))}
            engines[layout] = Engine(layout, spec, workdir, server=DecodeServer)
        for e in engines.values():
            e.wait_ready()
        info = {k: e.call("describe") for k, e in engines.items()}
        result["engines"] = info
        result["problems"] += check_layouts(info, args.control)
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


def as_built(layout: str, control: bool) -> str:
    return "stock" if control else layout


def check_layouts(info: dict, control: bool = False) -> list[str]:
    """stock: block stride spans one layer; cross-layer: all of them, one buffer."""
    out = []
    for layout, i in info.items():
        spans = i["layers_per_block_stride"]
        if as_built(layout, control) == "cross-layer":
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
