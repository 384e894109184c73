"""KVPool.drain, cancel_loads and cancel_stores, the pool's side of vLLM
0.32's drain contract (tests/v0_32/test_pool_tier_contracts.py and
test_pool_tier_drain.py drive it through upstream's manager): drain
returns True only once every job's result has been handed over; a load
that outlives a drain is cancelled and delivered once, as failed; once
cancel_stores returns, no store reads its payloads again (a value that
reaches the server holds the bytes it had before)."""

from __future__ import annotations

import pathlib
import sys
import threading
import time

sys.path.insert(0, str(pathlib.Path(__file__).parents[1]))
from support.redis_server import redis_server  # noqa: E402
from support.throttle_proxy import ThrottledProxy  # noqa: E402

from vllm_overlay.core.pool.config import PoolConfig  # noqa: E402
from vllm_overlay.core.pool.pool import KVPool  # noqa: E402


def test_drain_returns_once_each_result_is_handed_over(server_kind):
    """Callbacks 0.3 s slow: drain waits for them (it returned at once
    before, with nothing handed over)."""
    with redis_server(kind=server_kind) as server:
        pool = KVPool(PoolConfig(url=server.url))
        try:
            stored = []

            def slow_done(outcome):
                time.sleep(0.3)
                stored.append(outcome)

            assert pool.submit_store([(b"a", b"1" * 64)], on_done=slow_done) == 1
            assert pool.drain(10) and [s.complete for s in stored] == [True]

            def slow_prepare(values):
                time.sleep(0.3)
                return values

            assert pool.submit_load("L", [b"a"], prepare=slow_prepare) == 1
            assert pool.drain(10)
            assert pool.poll_loads() == [("L", [b"1" * 64])]
        finally:
            pool.close()


def test_a_load_that_outlives_a_drain_is_cancelled_and_delivered_once(server_kind):
    with redis_server(kind=server_kind) as server:
        pool = KVPool(PoolConfig(url=server.url, timeout_s=5.0, io_timeout_s=30.0))
        try:
            assert pool.submit_store([(b"a", b"1" * 64)]) == 1 and pool.drain()
            server.pause()
            buffer = bytearray(64)
            assert (
                pool.submit_load(
                    "L", [b"a"], value_bytes=64, into=lambda i, n: [memoryview(buffer)]
                )
                == 1
            )
            assert not pool.drain(0.5)
            assert pool.cancel_loads(1.0) == []  # stopped: nothing still writing
            assert pool.drain(1.0)
            assert pool.poll_loads() == [("L", [None])]
            server.resume()  # the answer comes late: not written, not delivered
            time.sleep(1.0)
            assert buffer == bytearray(64) and pool.poll_loads() == []
        finally:
            server.resume()
            pool.close()


def test_a_load_making_its_result_at_the_cancel_is_handed_over_once(server_kind):
    """A load whose result is being made (``prepare``: 0.5 s) when the
    drain gives up: ``cancel_loads`` waits for it, so once it returns the
    result is queued (before: the drain returned with the load pending,
    and upstream's reset_cache asserted).  ``prepare`` runs once."""
    with redis_server(kind=server_kind) as server:
        pool = KVPool(PoolConfig(url=server.url))
        try:
            assert pool.submit_store([(b"a", b"1" * 64)]) == 1 and pool.drain()
            prepared, started = [], threading.Event()

            def slow_prepare(values):
                prepared.append(values)
                started.set()
                time.sleep(0.5)
                return "result"

            assert pool.submit_load("L", [b"a"], prepare=slow_prepare) == 1
            assert started.wait(10)
            assert not pool.drain(0.05)
            assert pool.cancel_loads(2.0) == []
            # queued when cancel_loads returned: the result made
            assert pool.poll_loads() == [("L", "result")]
            time.sleep(0.2)
            assert pool.poll_loads() == [] and len(prepared) == 1
        finally:
            pool.close()


def test_cancelled_stores_never_read_their_payloads_again(server_kind):
    """Two stores over a 64 KiB/s link: the first (8 MiB: more than the
    kernel's send buffer takes) is on the wire, the second queued behind
    it.  ``cancel_stores``; then the payloads are overwritten, as the
    caller reuses its memory.  The queued store is never encoded; the one
    on the wire never reaches the server whole (before: the queued one was
    encoded later and stored the new bytes under its key, and the one on
    the wire was completed from the new bytes: a value the server held
    with bytes its header was not made from)."""
    import redis

    big = 8 << 20
    with redis_server(kind=server_kind) as server:
        with ThrottledProxy(server.port, 64 << 10) as proxy:
            pool = KVPool(
                PoolConfig(
                    url=proxy.url,
                    timeout_s=5.0,
                    io_timeout_s=60.0,
                    max_inflight_bytes=4 * big,
                )
            )
            try:
                first = bytearray(b"1" * big)
                second = bytearray(b"2" * 4096)
                encoded, outcomes = [], []

                def encode(key, payload):
                    encoded.append(key)
                    return payload

                for key, payload in ((b"first", first), (b"second", second)):
                    assert (
                        pool.submit_store(
                            [(key, memoryview(payload))],
                            encode=encode,
                            on_done=outcomes.append,
                        )
                        == 1
                    )
                deadline = time.monotonic() + 10
                while proxy.forwarded < (64 << 10) and time.monotonic() < deadline:
                    time.sleep(0.05)
                assert encoded == [b"first"]  # on the wire
                assert not pool.drain(0.05)
                assert pool.cancel_stores(1.0) == 0
                first[:] = b"X" * big  # reused at once
                second[:] = b"X" * len(second)
                assert pool.drain(10.0)  # both released soon
                assert encoded == [b"first"]  # the queued one never was
                assert [o.written for o in outcomes] == [0, 0]
                assert pool.state()["write"] == "open"  # not the pool's fault
            finally:
                pool.close()
        time.sleep(0.2)
        client = redis.Redis(port=server.port)
        assert client.exists("first", "second") == 0
