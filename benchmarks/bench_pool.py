"""Shared KV pool: how fast the pool reads (and writes) block values,
against references on the same server, measured side by side.

Starts its own redis-server on a free loopback port and fills it once with
``count`` values per size (header + payload, as the worker writes them)
under the keys ``key:000000000000`` ...  Every reader then reads exactly
those keys, in batches of ``batch`` keys (one pipelined round per batch, as
one request's blocks), over one connection (the pool's load thread has
one):

* ``redis-benchmark GET``: ``redis-benchmark -c 1 -P <batch> -r <count>
  GET key:__rand_int__`` (C client; random keys, all of which exist);
* ``raw recv_into``: plain Python - one socket, the pipelined GETs, then
  ``recv_into`` a preallocated (touched) buffer of the replies' size (no
  parsing; the most a Python reader can do);
* ``redis-py``: redis-py's pipeline (hiredis), values as bytes (what the
  pool used before it read into staging memory);
* ``pool -> staging``: ``KVPool.submit_load`` with ``into``: the load
  thread parses each reply and reads the header and the payload straight
  into preallocated rows (the worker's load ring);
* ``pool -> staging + check``: the same, and each value checked in place on
  the load thread as soon as it landed (header fields, XXH3-64), as the
  worker's loads are.

Rounds are interleaved (the readers' order rotates every round); the table
gives the median and [min, max] of each column over the rounds, and ratios
per round (paired), their median [min, max].  The write table does the
same for writes: ``redis-benchmark SET -c 1 -P <batch>`` against
``KVPool.submit_store`` (EXISTS, then SET NX with header and payload sent
as separate buffers; the header's checksum computed on the store thread).

A first table times the value checksum alone: XXH3-64 against zlib's
CRC-32 (the fallback of a node without ``xxhash``) over the same 8 MiB
values.

There is no decode-under-swap-out row any more: an engine writes KV at the
rate it computes it (~1 MB/s for the tiny model on this CPU), and what its
stores cost the engine loop is measured by ``bench_pool_liveness.py``
("pool ok": a healthy pool storing every block, against no pool).

    python benchmarks/bench_pool.py                 # 256 KiB, 2 MiB, 8 MiB
    python benchmarks/bench_pool.py --quick         # CI-sized
    python benchmarks/bench_pool.py --repeats 5 --total-mib 256
"""

from __future__ import annotations

import argparse
import functools
import os
import pathlib
import re
import socket
import statistics
import subprocess
import sys
import time

import numpy

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))

from support.redis_server import redis_server  # noqa: E402

from vllm_overlay.core.pool import codec  # noqa: E402
from vllm_overlay.core.pool.config import PoolConfig  # noqa: E402
from vllm_overlay.core.pool.pool import KVPool  # noqa: E402

NS = b"bench-namespace!"
LAYOUT = codec.layout_tag("bench")


def keys_for(count: int) -> list[bytes]:
    return [b"key:%012d" % i for i in range(count)]


def fill(url: str, size: int, count: int) -> None:
    """``count`` values of ``size`` payload bytes (+ header) under
    ``keys_for(count)``."""
    import redis

    client = redis.Redis.from_url(url)
    client.flushall()
    payload = os.urandom(size)
    pipe = client.pipeline(transaction=False)
    for i, key in enumerate(keys_for(count)):
        pipe.set(key, codec.encode(NS, key, payload, LAYOUT))
        if i % 16 == 15:
            pipe.execute()
    pipe.execute()
    client.close()


def _gets(keys: list[bytes]) -> bytes:
    return b"".join(b"*2\r\n$3\r\nGET\r\n$%d\r\n%s\r\n" % (len(k), k) for k in keys)


_RAW_BUFFERS: dict[int, numpy.ndarray] = {}


def raw_buffer(nbytes: int) -> memoryview:
    """A buffer of ``nbytes`` allocated and touched once, reused by every
    raw read of that size (as the pool's staging rows and KV blocks are
    touched before they are read into: a fresh buffer would make the raw
    reader pay a page fault per 4 KiB and flatter the pool)."""
    if nbytes not in _RAW_BUFFERS:
        _RAW_BUFFERS[nbytes] = numpy.ones(nbytes, dtype=numpy.uint8)
    return memoryview(_RAW_BUFFERS[nbytes]).cast("B")


def read_raw(port: int, keys: list[bytes], value_bytes: int, batch: int) -> float:
    """Seconds to read every value with plain ``recv_into`` (no parsing)
    into a preallocated, touched buffer."""
    reply = len(b"$%d\r\n" % value_bytes) + value_bytes + 2
    view = raw_buffer(batch * reply)
    sock = socket.create_connection(("127.0.0.1", port))
    sock.settimeout(30.0)  # as the pool's sockets (timeout_s)
    start = time.perf_counter()
    for i in range(0, len(keys), batch):
        chunk = keys[i : i + batch]
        sock.sendall(_gets(chunk))
        want, got = len(chunk) * reply, 0
        while got < want:
            n = sock.recv_into(view[got:want], want - got)
            if not n:
                raise EOFError("server closed the connection")
            got += n
    elapsed = time.perf_counter() - start
    assert view[0:1] == b"$" and view[want - 2 : want] == b"\r\n"
    sock.close()
    return elapsed


def read_redis_py(url: str, keys: list[bytes], value_bytes: int, batch: int) -> float:
    import redis

    client = redis.Redis.from_url(url, socket_timeout=30.0)
    client.ping()
    start = time.perf_counter()
    for i in range(0, len(keys), batch):
        pipe = client.pipeline(transaction=False)
        for key in keys[i : i + batch]:
            pipe.get(key)
        values = pipe.execute()
        assert all(len(v) == value_bytes for v in values)
    elapsed = time.perf_counter() - start
    client.close()
    return elapsed


class PoolReader:
    """A KVPool and staging rows (header and payload per value) reused for
    every round, as the worker's load ring."""

    def __init__(self, url: str, size: int, batch: int) -> None:
        self.pool = KVPool(
            PoolConfig(url=url, timeout_s=30.0, max_inflight_bytes=1 << 40)
        )
        self.size = size
        self.heads = numpy.zeros((batch, codec.HEADER_BYTES), dtype=numpy.uint8)
        self.rows = numpy.ones((batch, size), dtype=numpy.uint8)  # touched
        self.read(keys_for(1), check=False)  # the load thread is connected

    def _into(self, i: int, length: int):
        if length != codec.HEADER_BYTES + self.size:
            return None
        return [self.heads[i].data, self.rows[i].data]

    def _check(self, keys: list[bytes], i: int, value) -> None:
        """As the worker: each value checked in place as soon as it landed."""
        assert value is not None and not isinstance(value, bytes), keys[i]
        codec.check(NS, keys[i], self.heads[i], self.rows[i], self.size, LAYOUT)

    def read(self, keys: list[bytes], check: bool) -> float:
        """Seconds to read ``keys``: one load job per batch of the rows'
        length (the next batch is submitted when one is done, as the
        staging rows are reused)."""
        batch = len(self.rows)
        value_bytes = codec.HEADER_BYTES + self.size
        start = time.perf_counter()
        for i in range(0, len(keys), batch):
            chunk = keys[i : i + batch]
            self.pool.submit_load(
                i,
                chunk,
                value_bytes,
                into=self._into,
                landed=functools.partial(self._check, chunk) if check else None,
            )
            while not (done := self.pool.poll_loads()):
                self.pool.wait_for_loads(0.01)
            ((_, result),) = done
            assert all(v is not None and len(v) == value_bytes for v in result)
        return time.perf_counter() - start

    def close(self) -> None:
        self.pool.close()


def redis_benchmark(port: int, command: list[str], n: int, batch: int, extra=()):
    out = subprocess.run(
        [
            "redis-benchmark",
            "-p",
            str(port),
            "-c",
            "1",
            "-P",
            str(batch),
            "-n",
            str(n),
            "-q",
            *extra,
            *command,
        ],
        capture_output=True,
        text=True,
        timeout=600,
    ).stdout
    match = re.search(r"([\d.]+) requests per second", out)
    if match is None:
        raise RuntimeError(f"redis-benchmark printed no rate:\n{out}")
    return float(match.group(1))


def write_pool(url: str, size: int, count: int, batch: int) -> float:
    """Seconds for KVPool to store ``count`` values (EXISTS, SET NX, the
    header encoded on the store thread, header and payload separate)."""
    import redis

    redis.Redis.from_url(url).flushall()
    pool = KVPool(PoolConfig(url=url, timeout_s=30.0, max_inflight_bytes=1 << 40))
    try:
        pool.count_hits([b"warm-up"])
        rows = numpy.frombuffer(os.urandom(size * batch), dtype=numpy.uint8)
        rows = rows.reshape(batch, size)
        keys = [b"w:%012d" % i for i in range(count)]

        def encode(key, payload):
            return codec.encode_header(NS, key, payload, LAYOUT), payload

        start = time.perf_counter()
        for i in range(0, count, batch):
            chunk = keys[i : i + batch]
            pool.submit_store(
                [(k, rows[j].data) for j, k in enumerate(chunk)], encode=encode
            )
        assert pool.drain(timeout_s=600)
        elapsed = time.perf_counter() - start
        assert pool.cumulative()["stored_blocks"] == count
        return elapsed
    finally:
        pool.close()


def summary(values: list[float], fmt: str = "{:.2f}") -> str:
    return (
        fmt.format(statistics.median(values))
        + " ["
        + fmt.format(min(values))
        + ", "
        + fmt.format(max(values))
        + "]"
    )


READERS = [
    "redis-benchmark GET",
    "raw recv_into",
    "redis-py",
    "pool -> staging",
    "pool -> staging + check",
]


def read_table(server, sizes, total_mib: int, count_arg, batch: int, repeats: int):
    print(
        f"\n# Reads: one redis-server on loopback, one connection per reader, "
        f"{batch} keys per pipelined batch, every key read exists; "
        f"{repeats} interleaved rounds (GB/s of values read: median [min, max])"
    )
    print(
        "| value (payload + 72 B header) | values read | "
        + " | ".join(f"{r} GB/s" for r in READERS)
        + " | pool -> staging / raw recv_into | pool -> staging + check / raw "
        "recv_into | pool -> staging / redis-benchmark GET | pool -> staging / "
        "redis-py |"
    )
    print("|---" * (len(READERS) + 6) + "|")
    for size in sizes:
        value_bytes = codec.HEADER_BYTES + size
        count = count_arg or max(batch, (total_mib << 20) // value_bytes)
        fill(server.url, size, count)
        keys = keys_for(count)
        reader = PoolReader(server.url, size, batch)
        rates: dict[str, list[float]] = {r: [] for r in READERS}
        try:
            for rep in range(repeats):
                order = READERS[rep % len(READERS) :] + READERS[: rep % len(READERS)]
                for name in order:
                    if name == "redis-benchmark GET":
                        rps = redis_benchmark(
                            server.port,
                            ["GET", "key:__rand_int__"],
                            count,
                            batch,
                            ("-r", str(count)),
                        )
                        rates[name].append(rps * value_bytes / 1e9)
                        continue
                    if name == "raw recv_into":
                        secs = read_raw(server.port, keys, value_bytes, batch)
                    elif name == "redis-py":
                        secs = read_redis_py(server.url, keys, value_bytes, batch)
                    else:
                        secs = reader.read(keys, check=name.endswith("check"))
                    rates[name].append(count * value_bytes / secs / 1e9)
        finally:
            reader.close()

        def ratio(a: str, b: str, rates=rates) -> str:
            return summary([x / y for x, y in zip(rates[a], rates[b])]) + "x"

        print(
            f"| {size >> 10} KiB | {count} | "
            + " | ".join(summary(rates[r]) for r in READERS)
            + f" | {ratio('pool -> staging', 'raw recv_into')}"
            f" | {ratio('pool -> staging + check', 'raw recv_into')}"
            f" | {ratio('pool -> staging', 'redis-benchmark GET')}"
            f" | {ratio('pool -> staging', 'redis-py')} |",
            flush=True,
        )


def write_table(server, sizes, total_mib: int, count_arg, batch: int, repeats: int):
    print(
        f"\n# Writes: {batch} values per pipelined batch, one connection, "
        f"{repeats} interleaved rounds (GB/s of values written: median [min, max])"
    )
    print(
        "| value | values written | redis-benchmark SET GB/s | pool store "
        "(EXISTS + SET NX, header + payload buffers) GB/s | pool / "
        "redis-benchmark SET |"
    )
    print("|---|---|---|---|---|")
    for size in sizes:
        value_bytes = codec.HEADER_BYTES + size
        count = count_arg or max(batch, (total_mib << 20) // value_bytes)
        bench, pool = [], []
        for rep in range(repeats):
            for name in ("bench", "pool") if rep % 2 == 0 else ("pool", "bench"):
                if name == "bench":
                    server.cli("flushall")
                    rps = redis_benchmark(
                        server.port,
                        ["-t", "set", "-d", str(value_bytes), "-r", str(count)],
                        count,
                        batch,
                    )
                    bench.append(rps * value_bytes / 1e9)
                else:
                    secs = write_pool(server.url, size, count, batch)
                    pool.append(count * value_bytes / secs / 1e9)
        server.cli("flushall")
        print(
            f"| {size >> 10} KiB | {count} | {summary(bench)} | {summary(pool)} | "
            f"{summary([p / b for p, b in zip(pool, bench)])}x |",
            flush=True,
        )


def checksum_table(total_mib: int, repeats: int) -> None:
    """The value checksum's cost: XXH3-64 (what nodes with ``xxhash``
    write) against zlib's CRC-32 (the fallback), over the same random
    buffer in 8 MiB slices (one value each), interleaved rounds."""
    import zlib

    import xxhash

    data = numpy.random.default_rng(0).integers(
        0, 256, size=total_mib << 20, dtype=numpy.uint8
    )
    slices = [memoryview(row) for row in data.reshape(-1, 8 << 20)]
    ratios = []
    for _ in range(repeats):
        secs = {}
        for name, fn in (("crc32", zlib.crc32), ("xxh3", xxhash.xxh3_64_intdigest)):
            start = time.perf_counter()
            for view in slices:
                fn(view)
            secs[name] = time.perf_counter() - start
        ratios.append(secs["crc32"] / secs["xxh3"])
    print(
        f"\n# Checksums: {len(slices)} values of 8 MiB, {repeats} interleaved "
        "rounds; ratio paired per round: median [min, max]"
    )
    print("| checksum | XXH3-64 throughput / zlib CRC-32 throughput |")
    print("|---|---|")
    print(f"| per 8 MiB value | {summary(ratios)}x |", flush=True)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="CI-sized")
    parser.add_argument("--count", type=int, help="values per size (fixed)")
    parser.add_argument("--total-mib", type=int, default=128, help="MiB per size")
    parser.add_argument("--batch", type=int, default=16, help="keys per batch")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-writes", action="store_true")
    args = parser.parse_args(argv)
    if args.quick:
        sizes, total, repeats = [256 << 10], 16, max(1, min(args.repeats, 2))
    else:
        sizes, total, repeats = (
            [256 << 10, 2 << 20, 8 << 20],
            args.total_mib,
            (args.repeats),
        )
    checksum_table(min(total, 512), repeats)
    # Redis 7.0: the server redis-benchmark comes with, and RESULTS.md's.
    with redis_server(kind="redis") as server:
        read_table(server, sizes, total, args.count, args.batch, repeats)
        if not args.no_writes:
            write_table(server, sizes, total, args.count, args.batch, repeats)


if __name__ == "__main__":
    main()
