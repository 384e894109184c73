"""``io_timeout_s`` bounds a whole store, sends included, on a slow link:
a real server behind a proxy that passes the client's bytes at a limited
rate (tests/support/throttle_proxy.py).

A store of more values than can pass within ``io_timeout_s`` ends at that
deadline (not one socket timeout per value later), the pool pauses as slow
(not stuck), and the stats count as stored exactly the values the server
holds: those it answered before the deadline, whole; what was not sent by
then never lands later."""

from __future__ import annotations

import pathlib
import sys
import threading
import time

import redis

sys.path.insert(0, str(pathlib.Path(__file__).parents[1]))
from support.redis_server import redis_server  # noqa: E402
from support.throttle_proxy import ThrottledProxy  # noqa: E402

from vllm_overlay.core.pool.config import PoolConfig  # noqa: E402
from vllm_overlay.core.pool.pool import KVPool  # noqa: E402

VALUE_BYTES = 256 << 10
RATE = 256 << 10  # bytes/s: one value a second
VALUES = 8  # 8 s of link time
IO_TIMEOUT_S = 1.5  # half-way through the second value: far from any edge
SLACK_S = 1.0
SETTLE_S = 1.5  # then nothing more may land


def test_a_store_on_a_slow_link_ends_at_io_timeout_and_counts_what_landed(
    server_kind,
):
    payloads = [bytes([65 + i]) * VALUE_BYTES for i in range(VALUES)]
    keys = [b"slow:%d" % i for i in range(VALUES)]
    with (
        redis_server(kind=server_kind) as server,
        ThrottledProxy(server.port, RATE) as proxy,
    ):
        direct = redis.Redis(port=server.port)
        pool = KVPool(PoolConfig(url=proxy.url, io_timeout_s=IO_TIMEOUT_S))
        try:
            done = threading.Event()
            start = time.monotonic()
            admitted = pool.submit_store(
                list(zip(keys, payloads)), on_done=lambda *_: done.set()
            )
            assert admitted == VALUES
            done.wait(IO_TIMEOUT_S + 30)  # bounded; asserted below
            took = time.monotonic() - start
            held_then = direct.dbsize()
            time.sleep(SETTLE_S)
            held = sorted(direct.keys(b"slow:*"))
            values = [direct.get(key) for key in held]
            stats = pool.cumulative()
        finally:
            pool.close()
    assert done.is_set()
    assert took < IO_TIMEOUT_S + SLACK_S, took
    # The values the server holds: a leading run, each whole, and no more
    # than when the store ended.
    assert 1 <= len(held) < VALUES, held
    assert held == sorted(keys[: len(held)])
    assert held_then == len(held)
    assert values == [payloads[keys.index(key)] for key in held]
    assert stats["stored_blocks"] == len(held), stats
    assert stats["stored_blocks"] + stats["dropped_stores"] == VALUES, stats
    assert stats["bytes_out"] == len(held) * VALUE_BYTES
    assert stats["slow"] >= 1 and stats["stuck"] == 0, stats
