"""Serving with a router that cannot keep a conversation on the node holding
its KV: two real ``vllm serve`` nodes (vLLM 0.32; ``--nodes``) behind a
small proxy (serving/proxy.py), a real client (serving/client.py) replaying
a seeded synthetic multi-turn chat workload (serving/workload.py) over HTTP.

Configurations, measured in one run, their order rotated each repeat:

* (a) round-robin, no connector;
* (b) sticky routing, no connector: the ideal router (each conversation
      always on one node, so its prefix is always in that node's device
      prefix cache);
* (c) round-robin + the pool tier: upstream's ``TieringOffloadingSpec``
      with a small CPU primary tier (only the staging area the spec goes
      through) and the overlay's ``SharedPoolTier`` on a pool server
      (valkey-server by default, ``--server redis``);
* (d) round-robin + host + pool tiers (a large primary tier);
* (e) ``--with-0112``: (d) on vLLM 0.11.2, ``MultiConnector`` of the
      overlay's host connector and its pool connector.

(a) and (b) share their nodes; (c), (d) and (e) have their own; all are
up for the whole run, one proxy per configuration in front of its nodes.
Each repeat replays a new workload (its own seed; the same one for every
configuration of the repeat), so no configuration finds another one's or
an earlier repeat's prefixes; before each replay the nodes' device prefix
caches are reset, each node gets the system prompts once (steady state:
shared system prompts are hot on every node), and at the start of each
repeat the pool is emptied.

Measured: TTFT per request at the client (request sent to first streamed
token, through the proxy), p50/p90 per replay; requests per second (the
replay's requests over its wall time); cache hit tokens by source from each
node's ``/metrics`` (vLLM's own counters, before/after the replay:
serving/metrics.py).  Cells: median [min, max] over repeats; ratios are
paired within a repeat.  ``ideal`` = the hit tokens of a router that always
finds a turn's previous prompt (its full blocks) where the turn runs.

The model (built locally once, no hub: build_bench_llama) is sized so that
prefill dominates on CPU, like a real model on a GPU: 16 layers, hidden
1024, GQA with 4 KV heads: 32 KiB of KV per token (float32); a 2000-token
prefill takes seconds on one core, reading its KV back takes milliseconds.
One OpenMP thread per node (``--threads``).  Memory: a node of this model
is about 2.5 GB (API server, engine core and worker processes, 730 MB of
weights, 512 MiB of device KV) plus its host tier: 6 nodes for a-d, 8
with (e).

    python benchmarks/bench_serving_pool.py                 # 3 repeats
    python benchmarks/bench_serving_pool.py --with-0112     # + (e)
    python benchmarks/bench_serving_pool.py --smoke         # tiny: a, b, c

``--smoke``: the tiny model, 2 conversations of 3 turns, one user at a
time, one repeat (node start-up dominates: ~1 min on a quiet 2-core
machine, ~3 min on a loaded one).  A loaded machine can make the pool
miss its lookup deadline (``lookup_wait_s``, 250 ms): the tier then
pauses and requests recompute (shown in the run's line and the ``pool
pauses`` column); ``--pool-option lookup_wait_s=1.0`` widens it (--smoke
uses the tests' pool deadlines, ``TEST_POOL_OPTIONS``).

Writes ``benchmarks/results/serving_pool.{json,png}`` (``--smoke``: a
temporary folder unless ``--json``/``--png``).  Exit status 1 when a
request failed or a configuration's hits did not come from where they
should (b: the device only, all of the ideal; a: no host or pool; c: pool
hits on a node serving a turn whose previous turn ran on another node,
unless the pool tier failed or paused in that repeat: a note then, since
those turns recompute by design).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks" / "serving"))
sys.path.insert(0, str(ROOT))
import checks  # noqa: E402
import metrics  # noqa: E402
import nodes  # noqa: E402
import report  # noqa: E402
from client import replay  # noqa: E402
from control import Proxy, pool_backend, reset_prefix_cache, warm  # noqa: E402
from workload import WorkloadSpec, generate  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
BLOCK = 128  # the CPU backend's block size on both releases
# key: (label, node kind, routing)
CONFIGS = {
    "a": ("round-robin, no connector", "plain", "rr"),
    "b": ("sticky (ideal router), no connector", "plain", "sticky"),
    "c": ("round-robin + pool tier (host tier as staging only)", "pool", "rr"),
    "d": ("round-robin + host + pool tiers", "hostpool", "rr"),
    "e": ("(d) on vLLM 0.11.2: MultiConnector(host, pool)", "hostpool_0112", "rr"),
}
SERVE_SHAPE = dict(
    layers=16, hidden=1024, heads=16, kv_heads=4, head_dim=64, intermediate=2816
)
FULL = dict(
    workload=WorkloadSpec(),
    repeats=3,
    concurrency=4,
    think_s=1.0,
    max_tokens=16,
    # 16384 tokens = 512 MiB per node.  A repeat's workload holds 14-17k
    # distinct tokens (430-540 MiB of KV): a node's share under sticky
    # routing fits (b is the ideal router); a round-robin node, which sees
    # nearly every conversation, is at the edge.
    device_blocks=128,
    staging_mib=256,  # (c): the primary tier as staging only
    host_mib=512,  # (d), (e): about a repeat's distinct KV
    max_model_len=4096,
)
SMOKE = dict(
    workload=WorkloadSpec(
        conversations=2,
        system_prompts=1,
        system_tokens=256,
        turns=(3, 3),
        user_tokens=(100, 200),
        answer_tokens=(100, 200),
    ),
    repeats=1,
    concurrency=1,
    think_s=2.0,  # the stores reach the pool before the next turn
    max_tokens=4,
    device_blocks=64,
    staging_mib=16,
    host_mib=32,
    max_model_len=2048,
)


def model_path(args) -> str:
    if args.model:
        return args.model
    if args.smoke:
        from vllm_overlay.testing import tiny_model_path

        return tiny_model_path()
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in SERVE_SHAPE.items()]
    built = subprocess.run(
        [sys.executable, "-m", "vllm_overlay.models.build_bench_llama", *flags],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    if built.returncode:
        raise SystemExit(f"building the model failed:\n{built.stderr[-3000:]}")
    return built.stdout.splitlines()[0]


def block_bytes(model: str) -> int:
    """One KV block of the model (float32, K and V, every layer)."""
    cfg = json.loads((pathlib.Path(model) / "config.json").read_text())
    head = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    layers, kv_heads = cfg["num_hidden_layers"], cfg["num_key_value_heads"]
    return 2 * layers * kv_heads * head * 4 * BLOCK


def start_nodes(stack, args, p: dict, model: str, kinds: set, pool: dict, logs):
    # The device KV cache: exactly these blocks (not VLLM_CPU_KVCACHE_SPACE's
    # whole GiB, which vLLM also checks is free before it starts).
    served = {
        "model_name": model,
        "model_args": {
            "dtype": "float32",
            "max_model_len": p["max_model_len"],
            "enforce_eager": True,
            "seed": 0,
            "num_gpu_blocks_override": p["device_blocks"],
            "kv_cache_memory_bytes": p["device_blocks"] * block_bytes(model),
        },
    }
    sizes = {
        "pool": p["staging_mib"] * 2**20,
        "hostpool": p["host_mib"] * 2**20,
        "hostpool_0112": p["host_mib"] * 2**20,
    }
    specs = []
    for kind in sorted(kinds):
        kv = nodes.kv_transfer_config(kind, sizes, {**pool, "namespace": kind})
        bin_dir = (
            pathlib.Path(args.venv_0112) / "bin" if kind.endswith("0112") else None
        )
        for i in range(args.nodes):
            specs.append(
                nodes.node_spec(
                    f"{kind}-{i}",
                    served,
                    kv,
                    threads=args.threads,
                    **({"bin_dir": bin_dir} if bin_dir else {}),
                )
            )
    return stack.enter_context(nodes.node_group(specs, logs, args.startup_s))


def run_config(key: str, repeat: int, work: dict, ports, proxy, p: dict) -> dict:
    label, _, routing = CONFIGS[key]
    for port in ports:
        reset_prefix_cache(port)
        warm(port, work["systems"])
    before = [metrics.scrape(port) for port in ports]
    sent_before = proxy.sent()
    result = asyncio.run(
        replay(
            proxy.url,
            work,
            nodes.SERVED_NAME,
            concurrency=p["concurrency"],
            think_s=p["think_s"],
            max_tokens=p["max_tokens"],
            timeout_s=600.0,
        )
    )
    routed = [a - b for a, b in zip(proxy.sent(), sent_before)]
    after = metrics.wait_finished(ports, before, routed)
    cached = [0] * len(ports)  # what the answers said, per node
    for r in result["requests"]:
        if r.get("node") is not None:
            cached[int(r["node"])] += r.get("cached_tokens") or 0
    per_node = [
        metrics.hits(metrics.delta(b, a), BLOCK, c)
        for b, a, c in zip(before, after, cached)
    ]
    return {
        "config": key,
        "label": label,
        "routing": routing,
        "repeat": repeat,
        "seed": work["seed"],
        "wall_s": result["wall_s"],
        "requests": result["requests"],
        "routed": routed,
        "nodes": per_node,
        "hits": metrics.add(per_node),
        "ideal_hits": checks.ideal_hits(work, BLOCK),
    }


def pool_options(items: list[str]) -> dict:
    """KEY=VALUE pairs; a VALUE that parses as JSON is taken as such."""
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--pool-option {item!r}: KEY=VALUE")
        try:
            out[key] = json.loads(value)
        except ValueError:
            out[key] = value
    return out


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny model, a few requests")
    ap.add_argument("--configs", help="comma-separated keys (default a,b,c,d)")
    ap.add_argument("--with-0112", action="store_true", help="add (e)")
    ap.add_argument("--venv-0112", default=str(ROOT / ".venv"))
    ap.add_argument(
        "--secondary",
        default="pool",
        choices=["pool", "fs"],
        help="fs: upstream's fs tier in the pool's place (plumbing check)",
    )
    ap.add_argument(
        "--pool-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="more pool keys (core/pool PoolConfig), e.g. lookup_wait_s=1.0",
    )
    ap.add_argument(
        "--server",
        choices=["valkey", "redis"],
        help="the pool's server (default: the tests' default kind)",
    )
    ap.add_argument("--repeats", type=int)
    ap.add_argument("--seed", type=int, default=2026)
    ap.add_argument("--conversations", type=int, help="workload size")
    ap.add_argument("--concurrency", type=int, help="users sending at once")
    ap.add_argument(
        "--think-s", type=float, help="pause between a turn's answer and the next turn"
    )
    ap.add_argument("--device-blocks", type=int, help="device KV blocks per node")
    ap.add_argument("--staging-mib", type=int, help="(c)'s primary tier")
    ap.add_argument("--host-mib", type=int, help="(d), (e): host memory per node")
    ap.add_argument("--nodes", type=int, default=2, help="nodes behind each proxy (2)")
    ap.add_argument("--threads", type=int, default=1, help="OpenMP threads per node")
    ap.add_argument("--model", help="a model folder (default: built/cached)")
    ap.add_argument("--startup-s", type=float, default=600.0)
    ap.add_argument("--replot", metavar="JSON", help="table and PNG of a saved run")
    ap.add_argument("--json")
    ap.add_argument("--png")
    return ap.parse_args()


def replot(path: pathlib.Path, png: pathlib.Path) -> int:
    saved = json.loads(path.read_text())
    keys = list(dict.fromkeys(r["config"] for r in saved["runs"]))
    rows = report.summarize(saved["runs"], sorted(keys))
    print(report.table(rows))
    print("\n".join(report.goals(rows)))
    report.plot(rows, saved["runs"], png)
    print(f"PNG: {png}")
    return 0


def main() -> int:
    args = parse_args()
    if args.replot:
        path = pathlib.Path(args.replot)
        return replot(path, pathlib.Path(args.png or path.with_suffix(".png")))
    p = dict(SMOKE if args.smoke else FULL)
    for key in (
        "repeats",
        "concurrency",
        "think_s",
        "device_blocks",
        "staging_mib",
        "host_mib",
    ):
        if getattr(args, key) is not None:
            p[key] = getattr(args, key)
    if args.conversations:
        p["workload"] = dataclasses.replace(
            p["workload"], conversations=args.conversations
        )
    default = "a,b,c" if args.smoke else "a,b,c,d"
    keys = (args.configs or default).split(",") + (["e"] if args.with_0112 else [])
    unknown = [k for k in keys if k not in CONFIGS]
    if unknown:
        raise SystemExit(f"unknown configuration(s) {unknown}: {sorted(CONFIGS)}")
    out = pathlib.Path(tempfile.mkdtemp(prefix="bench-serving-"))
    json_path = pathlib.Path(
        args.json or (out if args.smoke else RESULTS) / "serving_pool.json"
    )
    png_path = pathlib.Path(args.png or json_path.with_suffix(".png"))
    model = model_path(args)
    vocab = json.loads((pathlib.Path(model) / "config.json").read_text())["vocab_size"]
    p["workload"] = dataclasses.replace(p["workload"], vocab=vocab)
    kinds = {CONFIGS[k][1] for k in keys}
    options = pool_options(args.pool_option)
    if args.smoke:  # the tests' deadlines, made for a loaded 2-core machine
        from vllm_overlay.testing.v0_11_2 import TEST_POOL_OPTIONS

        options = {**TEST_POOL_OPTIONS, **options}
    if "e" in keys and not (pathlib.Path(args.venv_0112) / "bin" / "vllm").exists():
        raise SystemExit(f"(e) needs vLLM 0.11.2: no {args.venv_0112}/bin/vllm")
    print(
        f"serving benchmark: configs {keys}, model {model}, logs in {out}", flush=True
    )

    import contextlib

    started, load = time.perf_counter(), os.getloadavg()
    runs, failed = [], {}
    with contextlib.ExitStack() as stack:
        pool = pool_backend(stack, args.secondary, kinds, out, args.server)
        pool["options"] = options
        ports = start_nodes(stack, args, p, model, kinds, pool, out)
        proxies = {
            k: stack.enter_context(
                Proxy(
                    [ports[f"{CONFIGS[k][1]}-{i}"] for i in range(args.nodes)],
                    CONFIGS[k][2],
                    out / f"proxy-{k}.log",
                )
            )
            for k in keys
        }
        print(f"nodes up after {time.perf_counter() - started:.0f} s", flush=True)
        for repeat in range(p["repeats"]):
            work = generate(p["workload"], args.seed + repeat)
            pool["flush"]()
            for key in keys[repeat % len(keys) :] + keys[: repeat % len(keys)]:
                if key in failed:
                    continue
                node_ports = [
                    ports[f"{CONFIGS[key][1]}-{i}"] for i in range(args.nodes)
                ]
                try:
                    run = run_config(key, repeat, work, node_ports, proxies[key], p)
                except Exception as e:  # the others go on; reported below
                    failed[key] = (
                        f"({key}) failed in repeat {repeat}: {type(e).__name__}: "
                        f"{e} (node logs: {out}/{CONFIGS[key][1]}-*.log)"
                    )
                    print(failed[key], flush=True)
                    continue
                runs.append(run)
                print(checks.progress(run), flush=True)
    rows = report.summarize(runs, keys)
    problems = list(failed.values()) + checks.problems(runs, BLOCK)
    notes = checks.notes(runs, BLOCK)
    print()
    print(report.table(rows))
    lines = report.goals(rows) + [f"NOTE: {x}" for x in notes]
    for line in lines + [f"PROBLEM: {x}" for x in problems]:
        print(line)
    meta = {
        "model": model,
        "params": {
            k: (dataclasses.asdict(v) if k == "workload" else v) for k, v in p.items()
        },
        "secondary": args.secondary,
        "pool_options": options,
        "server": pool.get("server_kind"),
        "threads": args.threads,
        "seconds": time.perf_counter() - started,
        "loadavg_start_end": [list(load), list(os.getloadavg())],
        "command": " ".join(sys.argv),
    }
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(
        json.dumps(
            {
                "meta": meta,
                "rows": rows,
                "problems": problems,
                "notes": notes,
                "runs": runs,
            },
            indent=1,
        )
    )
    print(f"JSON: {json_path}")
    print(
        f"PNG: {png_path}"
        if report.plot(rows, runs, png_path)
        else "PNG: skipped (no matplotlib)"
    )
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
