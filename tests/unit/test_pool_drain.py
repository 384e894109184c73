"""KVPool.drain and cancel_loads, the pool's side of vLLM 0.32's drain
contract (tests/v0_32/test_pool_tier_contracts.py drives it through
upstream's manager): drain returns True only once every job's result has
been handed over, and a load that outlives a drain is cancelled and
delivered once, as failed."""

from __future__ import annotations

import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).parents[1]))
from support.redis_server import redis_server  # noqa: E402

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
