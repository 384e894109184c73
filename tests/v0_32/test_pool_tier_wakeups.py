"""SharedPoolTier on the scheduler's thread never waits, and its pool wakes
an idle engine (real 0.32 types, a real server; ``Node`` as in
test_pool_tier_unit.py).

* ``on_schedule_end`` returns without waiting while a load and a lookup
  are pending (upstream's rule: tier methods are non-blocking): it never
  calls the pool's wait (counted on the tier's own pool).
* A lookup's answer sets ``TRANSFER_DONE``, the event the engine's idle
  wait sleeps on (``integration/v0_32/idle_wait``).
* A load's result is queued before ``TRANSFER_DONE`` is set: whoever the
  event wakes finds it.  (The engine-level wake-up on a lookup answer:
  test_idle_wait_lookup_cpu.py.)"""

from __future__ import annotations

import collections
import pathlib
import sys
import threading

import pytest
from test_pool_tier_unit import Node, keys
from vllm.v1.kv_offload.base import LookupResult, ReqContext

sys.path.insert(0, str(pathlib.Path(__file__).parents[1]))
from support.redis_server import RedisServer  # noqa: E402

from vllm_overlay.integration.v0_32.idle_wait import TRANSFER_DONE  # noqa: E402
from vllm_overlay.testing.redis import KINDS  # noqa: E402

STEPS = 200
WAKE_S = 10.0  # a bound for an answer from a local server
SETTLE_S = 1.0  # an earlier answer's wake-up is over by then


@pytest.fixture(params=KINDS)
def server(request):
    s = RedisServer(kind=request.param)
    yield s
    s.resume()
    s.close()


def test_on_schedule_end_never_waits_while_a_load_and_a_lookup_are_pending(server):
    a, b = Node(server.url), Node(server.url, io_timeout_s=30.0, lookup_wait_s=30.0)
    try:
        k = keys(3)
        a.rows[1:3] = 9
        assert a.store(k[:2], [1, 2]).success
        assert b.lookup(k[0]) is LookupResult.HIT  # b's threads are connected
        assert b.load(k[:1], [4]).success
        waits = []
        wait_for_loads = b.tier.pool.wait_for_loads

        def counted(timeout_s):
            waits.append(timeout_s)
            return wait_for_loads(timeout_s)

        b.tier.pool.wait_for_loads = counted
        server.pause()  # nothing answers: the load and the lookup stay pending
        b.tier.submit_load(b.job(k[1:2], [5], promotion=True))
        ctx = ReqContext("later")
        assert b.tier.lookup(k[2], ctx) is LookupResult.RETRY
        for _ in range(STEPS):  # steps of a busy engine
            b.tier.on_schedule_end(None)
            assert b.tier.lookup(k[2], ctx) is LookupResult.RETRY
        assert b.tier.has_pending_work()
        assert b.tier.get_finished_jobs() == []
        assert waits == []
    finally:
        server.resume()
        a.close()
        b.close()


def test_a_lookup_answer_sets_the_idle_waits_event(server):
    a, b = Node(server.url), Node(server.url)
    try:
        k = keys(2)
        assert a.store(k[:1], [0]).success
        assert b.lookup(k[1], req="warm") is LookupResult.MISS  # connected
        TRANSFER_DONE.wait(SETTLE_S)  # (that answer's own wake-up)
        for key, verdict in ((k[0], LookupResult.HIT), (k[1], LookupResult.MISS)):
            TRANSFER_DONE.clear()
            ctx = ReqContext(f"r-{verdict.name}")
            assert b.tier.lookup(key, ctx) is LookupResult.RETRY
            b.tier.on_schedule_end(None)  # the step ends: the lookup is sent
            assert TRANSFER_DONE.wait(WAKE_S)  # set by the answer
            assert b.tier.lookup(key, ctx) is verdict  # answered already
    finally:
        a.close()
        b.close()


class _Recording(collections.deque):
    """The pool's queue of load results: whether ``TRANSFER_DONE`` was
    already set when each result was queued."""

    def __init__(self) -> None:
        super().__init__()
        self.event_was_set: list[bool] = []

    def append(self, item) -> None:
        self.event_was_set.append(TRANSFER_DONE.is_set())
        super().append(item)


def test_a_load_result_is_queued_before_the_idle_waits_event_is_set(server):
    a, b = Node(server.url), Node(server.url)
    try:
        k = keys(2)
        a.rows[1:3] = 3
        assert a.store(k, [1, 2]).success
        assert b.load(k[:1], [4]).success  # b's load thread is connected
        TRANSFER_DONE.wait(SETTLE_S)  # (that load's own wake-up)
        TRANSFER_DONE.clear()
        queued = b.tier.pool._loads_done = _Recording()
        found = []

        def listener():  # the engine's idle wait
            if TRANSFER_DONE.wait(WAKE_S):
                found.append(len(queued))

        thread = threading.Thread(target=listener)
        thread.start()
        job = b.job(k, [5, 6], promotion=True)
        b.tier.submit_load(job)
        thread.join(WAKE_S + 5)
        assert queued.event_was_set == [False]
        assert found == [1]  # woken, the result was there
        result = b.finish(job.job_id)
        assert result.success and (b.rows[5:7] == 3).all()
    finally:
        a.close()
        b.close()
