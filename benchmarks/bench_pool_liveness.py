"""Shared KV pool liveness: an engine keeps its decode throughput whatever
the pool does, measured side by side in one run.

One vLLM engine process per configuration (tiny model, CPU build, the
scheduler in-process so its connector calls can be timed), all started
first and then driven in interleaved rounds (each round visits every
configuration, the order rotated from round to round):

* ``no pool``      - stock vLLM: no KV connector (the reference)
* ``pool ok``      - SharedKVPoolConnector, healthy redis-server
* ``hung``         - a loopback socket that accepts and never answers
* ``slow``         - redis-server kept busy by back-to-back ``DEBUG SLEEP 1.4``
                     (every reply takes up to 1.4 s, under ``timeout_s``)
* ``unreachable``  - a closed port
* ``full``         - redis-server at ``maxmemory`` with ``noeviction`` (OOM)
* ``cluster node hung`` - 3-node Redis Cluster, one node stopped (SIGSTOP)

A round: 16 new prompts that share no prefix (with each other, earlier
rounds or the pool) generate 384 tokens each in one batch: decode tok/s =
tokens generated in the steps after every request has its first token /
the time of those steps (``LLMEngine.step()`` timed here: prefill and
lookups excluded); output tok/s = all tokens / the round's wall time.
Then 2 prompts whose prefix round 1 sent (after ``reset_prefix_cache``:
only the pool could serve it) must complete with the no-pool engine's
tokens.  The slowest
scheduler-side connector call (``get_num_new_matched_tokens``,
``build_connector_meta``, ``update_connector_output``) is recorded too.

    python benchmarks/bench_pool_liveness.py [--repeats 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

N_NEW, MAX_TOKENS, N_PREFIX = 16, 384, 2
POOL_OPTIONS = {"namespace": "liveness", "timeout_s": 2.0, "connect_timeout_s": 1.0}


def prompt(round_: int, i: int, words: int = 160) -> str:
    """A prompt unique to (round, i): the first word differs."""
    return " ".join(
        f"w{(round_ * 7919 + i * 104729 + j * 31) % 5000}" for j in range(words)
    )


def prefix_prompt(round_: int, i: int) -> str:
    """Round 1's prompt i with another ending: a prefix the pool may hold."""
    return prompt(1, i) + f" and then r{round_}"


# -- engine process ----------------------------------------------------------
def engine(spec: dict) -> None:
    from vllm_overlay.testing import cpu_defaults, in_process_engine, tiny_engine_args
    from vllm_overlay.testing.v0_11_2 import pool_connector

    cpu_defaults()
    in_process_engine(rpc=False)
    from vllm import LLM, SamplingParams

    kv = None
    if spec.get("url"):
        extra = dict(POOL_OPTIONS)
        if spec.get("cluster"):
            extra["cluster"] = True
        kv = pool_connector(spec["url"], **extra)
    llm = LLM(**tiny_engine_args(num_gpu_blocks_override=None, kv_transfer_config=kv))
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    slowest = {"ms": 0.0}
    if kv is not None:
        connector = llm.llm_engine.engine_core.engine_core.scheduler.connector
        for name in (
            "get_num_new_matched_tokens",
            "build_connector_meta",
            "update_connector_output",
        ):
            real = getattr(connector, name)

            def timed(*args, _real=real, **kwargs):
                start = time.perf_counter()
                try:
                    return _real(*args, **kwargs)
                finally:
                    ms = (time.perf_counter() - start) * 1e3
                    slowest["ms"] = max(slowest["ms"], ms)

            setattr(connector, name, timed)
    from vllm.sampling_params import RequestOutputKind

    # LLM.generate switches its params to FINAL_ONLY; the timed batch needs
    # an output every step.
    params = SamplingParams(
        temperature=0.0,
        max_tokens=MAX_TOKENS,
        ignore_eos=True,
        output_kind=RequestOutputKind.CUMULATIVE,
    )
    prefix_params = SamplingParams(temperature=0.0, max_tokens=8)
    llm.generate([prompt(-1, 0)], prefix_params, use_tqdm=False)  # warm-up
    print("READY", flush=True)
    engine_ = llm.llm_engine
    for line in sys.stdin:
        round_ = int(line)
        slowest["ms"] = 0.0
        start = time.perf_counter()
        for i in range(N_NEW):
            engine_.add_request(f"r{round_}-{i}", prompt(round_, i), params)
        tokens: dict[str, int] = {}
        decode_start = None  # every request has its first token
        decoded = 0
        while engine_.has_unfinished_requests():
            outs = engine_.step()
            now = time.perf_counter()
            new = 0
            for out in outs:
                n = len(out.outputs[0].token_ids)
                new += n - tokens.get(out.request_id, 0)
                tokens[out.request_id] = n
            if decode_start is not None:
                decoded += new
            elif len(tokens) == N_NEW:
                decode_start = now  # prefill over: decode steps from here
                cpu_start = time.process_time()
        end = time.perf_counter()
        cpu = time.process_time() - cpu_start  # all threads of this engine
        wall = end - start
        window = end - decode_start
        # Only the pool may serve the prefixes now (the finished requests'
        # blocks are free once their stores are handed over).
        llm.generate(["hi"], prefix_params, use_tqdm=False)  # reports them
        if not scheduler.reset_prefix_cache():
            raise RuntimeError("the device prefix cache cannot be reset")
        prefix = llm.generate(
            [prefix_prompt(round_, i) for i in range(N_PREFIX)],
            prefix_params,
            use_tqdm=False,
        )
        print(
            "RESULT "
            + json.dumps(
                {
                    "decode_tok_s": decoded / window,
                    "cpu_ms_per_token": cpu * 1e3 / decoded,
                    "output_tok_s": sum(tokens.values()) / wall,
                    "slowest_call_ms": slowest["ms"],
                    "prefix_tokens": [list(o.outputs[0].token_ids) for o in prefix],
                    "prefix_cached": [o.num_cached_tokens or 0 for o in prefix],
                }
            ),
            flush=True,
        )


# -- driver --------------------------------------------------------------------
class Engine:
    def __init__(self, name: str, spec: dict) -> None:
        self.name = name
        env = {
            **os.environ,
            "TORCHDYNAMO_DISABLE": "1",
            "TOKENIZERS_PARALLELISM": "0",
            # One compute thread per engine: the other core is left to the
            # pool's threads, redis-server and the machine (2 cores here),
            # which makes the comparison far less noisy.
            "OMP_NUM_THREADS": os.environ.get("BENCH_OMP_THREADS", "1"),
        }
        log = f"/tmp/bench_pool_liveness_{name.replace(' ', '_')}.log"
        self.log = open(log, "w")  # noqa: SIM115 - open while the engine runs
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--engine", json.dumps(spec)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            env=env,
        )

    def wait_ready(self) -> None:
        for line in self.proc.stdout:
            if line.startswith("READY"):
                return
        raise RuntimeError(f"engine {self.name!r} exited; see {self.log.name}")

    def round(self, round_: int) -> dict:
        self.proc.stdin.write(f"{round_}\n")
        self.proc.stdin.flush()
        for line in self.proc.stdout:
            if line.startswith("RESULT "):
                return json.loads(line[7:])
        raise RuntimeError(f"engine {self.name!r} exited; see {self.log.name}")

    def stop(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", help="write the raw results here")
    ap.add_argument("--engine", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.engine:
        engine(json.loads(args.engine))
        return

    import contextlib

    import redis
    from support.redis_server import (
        HungServer,
        RedisServer,
        SlowServer,
        free_port,
        redis_cluster,
    )

    # Redis 7.0, the server RESULTS.md's figures were measured on.
    kind = "redis"
    with contextlib.ExitStack() as stack:
        healthy = RedisServer(kind=kind)
        stack.callback(healthy.close)
        slow_server = RedisServer("--enable-debug-command", "yes", kind=kind)
        stack.callback(slow_server.close)
        full = RedisServer(
            "--maxmemory", "2mb", "--maxmemory-policy", "noeviction", kind=kind
        )
        stack.callback(full.close)
        # Fill the full one until it refuses writes.
        with contextlib.suppress(redis.exceptions.OutOfMemoryError):
            for i in range(100):
                full.cli("set", f"filler{i}", "x" * 100_000)
        hung = HungServer()
        stack.callback(hung.close)
        cluster = stack.enter_context(redis_cluster(kind=kind))
        closed = f"redis://127.0.0.1:{free_port()}"
        specs = {
            "no pool": {},
            "no pool (a 2nd engine: the noise floor)": {},
            "pool ok": {"url": healthy.url},
            "hung": {"url": hung.url},
            "slow": {"url": slow_server.url},
            "unreachable": {"url": closed},
            "full": {"url": full.url},
            "cluster node hung": {"url": cluster[0].url, "cluster": True},
        }
        engines = {}
        for name, spec in specs.items():  # one at a time: 2 cores
            engines[name] = Engine(name, spec)
            engines[name].wait_ready()
            print(f"engine ready: {name}", flush=True)
        for e in engines.values():
            stack.callback(e.stop)
        # The failures that need a running engine's connection first.
        slow = SlowServer(slow_server, 1.4)
        stack.callback(slow.stop)
        cluster[2].pause()
        stack.callback(cluster[2].resume)

        # Each configuration is paired with a "no pool" run right next to
        # it (no pool first in even rounds, second in odd ones: ABBA), and
        # its ratio is taken against that run only.
        others = [n for n in engines if n != "no pool"]
        results: dict[str, list[tuple[dict, dict]]] = {n: [] for n in others}
        for r in range(args.repeats):
            order = others[r % len(others) :] + others[: r % len(others)]
            for name in order:
                pair = ["no pool", name] if r % 2 == 0 else [name, "no pool"]
                out = {}
                for who in pair:
                    time.sleep(0.5)  # let the last engine's OpenMP threads idle
                    out[who] = engines[who].round(r + 1)
                results[name].append((out[name], out["no pool"]))
            print(f"round {r + 1}/{args.repeats} done", flush=True)

    report(results, args.repeats)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(results, indent=1))


def report(results: dict[str, list[tuple[dict, dict]]], repeats: int) -> None:
    print()
    print(
        f"Decode throughput vs. no pool connector ({repeats} rounds; "
        f"{N_NEW} new prompts x {MAX_TOKENS} tokens per run; each run paired "
        "with a no-pool run next to it, ABBA; ratio = config / its pair)"
    )
    print(
        "| configuration | decode tok/s (median) | decode ratio to no pool: "
        "median [min, max] | engine CPU time per decoded token: ratio "
        "median [min, max] | output tok/s incl. prefill: ratio median | "
        "slowest scheduler-side connector call (ms, max) | prefix requests: "
        "same tokens as no pool | prefix tokens served by the pool (all rounds) |"
    )
    print("|" + "---|" * 8)
    base = [b["decode_tok_s"] for pairs in results.values() for _, b in pairs]
    print(f"| no pool | {statistics.median(base):.0f} | 1 | 1 | 1 | - | - | 0 |")
    for name, pairs in results.items():
        ratios = [a["decode_tok_s"] / b["decode_tok_s"] for a, b in pairs]
        out_ratios = [a["output_tok_s"] / b["output_tok_s"] for a, b in pairs]
        cpu = [a["cpu_ms_per_token"] / b["cpu_ms_per_token"] for a, b in pairs]
        same = sum(a["prefix_tokens"] == b["prefix_tokens"] for a, b in pairs)
        cached = sum(sum(a["prefix_cached"]) for a, _ in pairs)
        slowest = (
            f"{max(a['slowest_call_ms'] for a, _ in pairs):.1f}"
            if "no pool" not in name
            else "-"
        )
        median = statistics.median(a["decode_tok_s"] for a, _ in pairs)
        print(
            f"| {name} | {median:.0f} | {statistics.median(ratios):.3f} "
            f"[{min(ratios):.3f}, {max(ratios):.3f}] | "
            f"{statistics.median(cpu):.3f} [{min(cpu):.3f}, {max(cpu):.3f}] | "
            f"{statistics.median(out_ratios):.3f} | {slowest} | "
            f"{same}/{len(pairs)} | {cached} |"
        )


if __name__ == "__main__":
    main()
