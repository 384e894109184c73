"""Shared KV pool: throughput against redis-benchmark, and decode step time
with and without concurrent swap-out, measured side by side in one run.

Starts its own redis-server on a free loopback port.

1. Pool throughput: KVPool writes then reads N block values (header +
   payload) through its background threads; redis-benchmark (SET/GET, same
   value size, pipelined) on the same server gives the reference.
2. Decode step time: real vLLM (tiny model, CPU) generates with the
   SharedKVPoolConnector, alone and while a background KVPool keeps
   writing 2 MiB values to the same server (swap-out pressure); the ratio
   shows what the I/O threads cost the engine loop.

    python benchmarks/bench_pool.py            # full
    python benchmarks/bench_pool.py --quick    # CI-sized
"""

from __future__ import annotations

import argparse
import os
import pathlib
import re
import subprocess
import sys
import threading
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))

from support.redis_server import redis_server  # noqa: E402

from vllm_overlay.core.pool import codec  # noqa: E402
from vllm_overlay.core.pool.config import PoolConfig  # noqa: E402
from vllm_overlay.core.pool.pool import KVPool  # noqa: E402

NS = b"bench-namespace!"


def pool_throughput(
    url: str, size: int, count: int, tag: str = "run"
) -> tuple[float, float]:
    pool = KVPool(PoolConfig(url=url, max_inflight_bytes=1 << 40, timeout_s=30.0))
    payload = os.urandom(size)
    keys = [b"bench:%s:%d:%d" % (tag.encode(), size, i) for i in range(count)]
    values = [codec.encode(NS, k, payload) for k in keys]
    batch = 16
    start = time.perf_counter()
    for i in range(0, count, batch):
        pool.submit_store(list(zip(keys[i : i + batch], values[i : i + batch])))
    pool.drain(timeout_s=600)
    out_s = time.perf_counter() - start
    start = time.perf_counter()
    for i in range(0, count, batch):
        pool.submit_load(i, keys[i : i + batch])
    pool.drain(timeout_s=600)
    in_s = time.perf_counter() - start
    loaded = sum(1 for _, vals in pool.poll_loads() for v in vals if v)
    assert loaded == count, (loaded, count)
    pool.close()
    nbytes = size * count
    return nbytes / out_s / 1e9, nbytes / in_s / 1e9


def redis_benchmark(port: int, size: int, count: int) -> tuple[float, float]:
    out = subprocess.run(
        [
            "redis-benchmark",
            "-p",
            str(port),
            "-t",
            "set,get",
            "-d",
            str(size),
            "-n",
            str(count),
            "-P",
            "16",
            "-c",
            "2",
            "-r",
            str(count),
            "-q",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    ).stdout
    rps = {
        m.group(1): float(m.group(2))
        for m in re.finditer(r"(SET|GET): ([\d.]+) requests per second", out)
    }
    return rps["SET"] * size / 1e9, rps["GET"] * size / 1e9


def decode_step_times(url: str, tokens: int) -> dict[str, float]:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    from vllm_overlay.demo import cpu_defaults, tiny_model_path

    cpu_defaults()
    llm = LLM(
        model=tiny_model_path(),
        dtype="float32",
        max_model_len=1024,
        num_gpu_blocks_override=32,
        enforce_eager=True,
        seed=0,
        kv_transfer_config=KVTransferConfig(
            kv_connector="SharedKVPoolConnector",
            kv_role="kv_both",
            kv_connector_extra_config={"url": url, "namespace": "bench"},
        ),
    )
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    prompts = [f"decode benchmark prompt {i}" for i in range(4)]

    def per_token() -> float:
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        return (time.perf_counter() - start) / tokens

    per_token()  # warm-up
    results = {"alone": min(per_token() for _ in range(3))}
    stop = threading.Event()
    pressure = KVPool(PoolConfig(url=url, max_inflight_bytes=64 << 20))
    value = os.urandom(2 << 20)
    written = [0]

    def swap_out() -> None:
        i = 0
        while not stop.is_set():
            key = b"pressure:%d" % (i % 64)
            if pressure.submit_store([(key, codec.encode(NS, key, value))]):
                written[0] += len(value)
            else:
                time.sleep(0.001)
            i += 1
            if i % 64 == 0:
                pressure.drain()
                # delete so the next round writes again (SET NX skips)
                import redis

                redis.Redis.from_url(url).flushdb()

    thread = threading.Thread(target=swap_out, daemon=True)
    thread.start()
    start = time.perf_counter()
    results["with swap-out"] = min(per_token() for _ in range(3))
    elapsed = time.perf_counter() - start
    stop.set()
    thread.join()
    pressure.close()
    results["swap-out MB/s"] = written[0] / elapsed / 1e6
    return results


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--count", type=int, help="values per size")
    parser.add_argument(
        "--no-decode", action="store_true", help="skip the decode step-time part"
    )
    args = parser.parse_args(argv)
    sizes = [256 << 10] if args.quick else [256 << 10, 2 << 20]
    count = args.count or (64 if args.quick else 512)
    with redis_server() as server:
        print(
            f"# KV pool vs redis-benchmark on one local redis-server "
            f"(loopback), {count} values per size, measured in one run"
        )
        print(
            "| value | pool out | pool in | redis-benchmark SET | "
            "redis-benchmark GET | pool/bench out | pool/bench in |"
        )
        print("|---|---|---|---|---|---|---|")
        for size in sizes:
            # Warm the server's memory first (first-touch page faults would
            # otherwise be charged to whichever client writes first).
            pool_throughput(server.url, size, count, tag="warm-up")
            server.cli("flushall")
            out_gbs, in_gbs = pool_throughput(server.url, size, count)
            server.cli("flushall")
            set_gbs, get_gbs = redis_benchmark(server.port, size, count)
            server.cli("flushall")
            print(
                f"| {size >> 10} KiB | {out_gbs:.2f} GB/s | {in_gbs:.2f} "
                f"GB/s | {set_gbs:.2f} GB/s | {get_gbs:.2f} GB/s | "
                f"{out_gbs / set_gbs:.2f}x | {in_gbs / get_gbs:.2f}x |",
                flush=True,
            )
        if args.no_decode:
            return
        times = decode_step_times(server.url, 16 if args.quick else 64)
    print(
        "\n# Decode step time, tiny model on CPU (4 requests), with the pool connector"
    )
    print("| condition | time per decode step | ratio |")
    print("|---|---|---|")
    for name in ("alone", "with swap-out"):
        print(
            f"| {name} | {times[name] * 1e3:.2f} ms | "
            f"{times[name] / times['alone']:.2f}x |"
        )
    print(
        f"\nbackground swap-out during the second row: "
        f"{times['swap-out MB/s']:.0f} MB/s of 2 MiB values"
    )


if __name__ == "__main__":
    main()
