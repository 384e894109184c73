"""After ``drain_jobs`` returns, the pool tier never touches the primary
tier's memory (issue 39, item 3), under vLLM's own caller: upstream's
``TieringOffloadingManager`` (0.32, and 0.33 in ``tox -e v0_33``) calls
``drain_jobs`` from ``reset_cache``, then frees every host chunk, which
the engine reuses at once.

* Stores still queued or on the wire when the drain gives up: the writer's
  link to the pool passes 10 KiB/s (``support/throttle_proxy.py``), so a
  dozen 4 KiB cascades outlast the drain.  Right after ``reset_cache`` the
  host rows are overwritten, as reuse would.  A second node then loads the
  old keys straight from the server: each is a miss or the bytes the
  writer had, never the overwritten ones (before the fix: 3 of 12 carried
  the new bytes under the old keys, with a valid checksum).
* A promotion still computing its result at the drain's deadline: before
  the fix, ``reset_cache``'s ``assert not self._jobs`` raised; now the
  promotion is reported failed, its late result is not reported again and
  nothing is written into the rows after ``drain_jobs`` returned.
"""

from __future__ import annotations

import pathlib
import sys
import time

import numpy
import pytest
from vllm.v1.kv_offload.base import LookupResult, ReqContext
from vllm.v1.kv_offload.tiering.base import TieringOffloadingMetrics

sys.path.insert(0, str(pathlib.Path(__file__).parents[1]))
from support.redis_server import RedisServer  # noqa: E402
from support.throttle_proxy import ThrottledProxy  # noqa: E402
from support.tiering_manager import (  # noqa: E402
    FAST,
    PAGE,
    counters,
    finished,
    host_holds,
    keys,
    make_manager,
    promote,
    step,
)

CASCADE_FAILURES = TieringOffloadingMetrics.CASCADE_JOB_FAILURES
PROMOTION_FAILURES = TieringOffloadingMetrics.PROMOTION_JOB_FAILURES
RATE = 10 << 10  # the writer's link: 10 KiB/s, client to server
STORES = 12  # one 4 KiB chunk each: ~0.42 s each on that link, ~5 s in all
REUSED = 0xEE  # what the host rows hold once reused


@pytest.fixture
def server():
    s = RedisServer()
    yield s
    s.resume()
    s.close()


def lift_reset_hold(manager) -> None:
    """0.33 holds promotions after a reset until its scheduler's reset
    fence (every job in flight at the reset reported) lifts the hold."""
    if hasattr(manager, "on_reset_flushed"):
        manager.on_reset_flushed()


def rows(manager):
    """The host tier's memory, one row per chunk, as bytes."""
    view = numpy.asarray(manager.primary_tier.get_kv_memoryview())
    return view.view(numpy.uint8)


def row_of(i: int) -> bytes:
    """The bytes the writer stores for key ``i``: its own, never REUSED."""
    return bytes([i + 1]) * PAGE


def cascade_one_by_one(manager, ks, ctx) -> None:
    """One cascade job per key (GPU -> host done for each in turn), each
    chunk holding ``row_of(i)``."""
    view = rows(manager)
    for i, key in enumerate(ks):
        out = manager.prepare_store([key], ctx)
        (chunk,) = out.store_spec.chunk_ids
        view[chunk] = i + 1
        manager.complete_store([key], ctx, True)


def load_all(manager, ks, ctx, timeout_s: float = 15.0) -> dict:
    """Look each key up, step after step, until every one is a HIT
    (promoted and loaded) or a MISS; key -> the answer."""
    deadline = time.monotonic() + timeout_s
    answers: dict = {}
    while time.monotonic() < deadline:
        answers = {k: manager.lookup(k, ctx) for k in ks}
        manager.on_schedule_end(step())
        settled = {LookupResult.HIT, LookupResult.MISS}
        if not manager._jobs and set(answers.values()) <= settled:
            return answers
        time.sleep(0.01)
    raise AssertionError(f"lookups not settled in {timeout_s} s: {answers}")


def host_row(manager, key, ctx) -> bytes:
    view = rows(manager)
    out = manager.primary_tier.prepare_load([key], ctx)
    (chunk,) = out.chunk_ids
    row = view[chunk].tobytes()
    manager.primary_tier.complete_load([key], ctx)
    return row


def test_stores_given_up_by_a_drain_never_publish_reused_rows(server):
    with ThrottledProxy(server.port, RATE) as proxy:
        writer = make_manager(
            proxy.url,
            timeout_s=0.5,
            io_timeout_s=1.0,  # each store well inside it (~0.42 s)
            connect_timeout_s=1.0,
            lookup_wait_s=0.5,
        )
        try:
            tier = writer.secondary_tiers[0]
            ctx = ReqContext("w")
            writer.on_new_request(ctx)
            ks = keys(STORES, seed=3)
            cascade_one_by_one(writer, ks, ctx)
            assert len(writer._jobs) == STORES  # one cascade per key
            start = time.monotonic()
            writer.reset_cache()  # drain: 3.5 s, then gives up
            drained_s = time.monotonic() - start
            # the engine reuses the freed chunks at once
            rows(writer)[:] = REUSED
            assert not writer._jobs
            given_up = counters(writer).get(CASCADE_FAILURES, 0)
            assert given_up >= 1, f"the drain did not give up ({drained_s:.1f} s)"
            # The writer's store thread is done with what it had queued.
            assert tier.pool.drain(10.0)
            time.sleep(0.2)  # what it sent reaches the server
        finally:
            writer.shutdown()

    reader = make_manager(server.url, **FAST)
    try:
        ctx = ReqContext("r")
        reader.on_new_request(ctx)
        answers = load_all(reader, ks, ctx)
        loaded = {
            i: host_row(reader, k, ctx)
            for i, k in enumerate(ks)
            if answers[k] is LookupResult.HIT
        }
        reused = sorted(i for i, row in loaded.items() if row[0] == REUSED)
        wrong = sorted(i for i, row in loaded.items() if row != row_of(i))
        assert reused == [], f"keys {reused} hold the reused rows' bytes"
        assert wrong == [], f"keys {wrong} hold other bytes"
        # the stores the drain did not give up were published
        assert len(loaded) >= STORES - given_up, (answers, given_up)
    finally:
        reader.shutdown()


def test_a_promotion_still_computing_its_result_at_the_deadline(server):
    """Its result takes 5 s to compute (the drain gives up after 3 s):
    ``reset_cache`` holds its assert, the promotion is failed, its late
    result is never reported, nothing lands in the rows afterwards."""
    writer = make_manager(server.url, **FAST)
    reader = make_manager(server.url, **FAST)
    try:
        ctx = ReqContext("r")
        writer.on_new_request(ctx)
        reader.on_new_request(ctx)
        ks = keys(3, seed=4)
        cascade_one_by_one(writer, ks, ctx)
        finished(writer, writer.secondary_tiers[0])
        tier = reader.secondary_tiers[0]
        verdicts, calls = tier._verdicts, []

        def slow(*args):
            calls.append(time.monotonic())
            time.sleep(5.0)
            return verdicts(*args)

        tier._verdicts = slow
        promote(reader, ks, ctx)
        deadline = time.monotonic() + 10
        while not calls and time.monotonic() < deadline:
            time.sleep(0.01)
        assert calls, "the promotion never reached its result"
        reader.reset_cache()  # before the fix: AssertionError
        assert not reader._jobs
        assert counters(reader)[PROMOTION_FAILURES] == 1
        rows(reader)[:] = REUSED  # the engine reuses the freed chunks
        while time.monotonic() - calls[0] < 5.5:  # the late result comes
            time.sleep(0.1)
        assert list(tier.get_finished_jobs()) == []
        assert (rows(reader) == REUSED).all()  # nothing written after the drain
        assert not any(host_holds(reader, k, ctx) for k in ks)
        assert not tier.has_pending_work()
        lift_reset_hold(reader)
        # the tier goes on: the keys promote again, byte for byte (for a
        # new request: the failed load made them misses for this one)
        tier._verdicts = verdicts
        ctx = ReqContext("r2")
        reader.on_new_request(ctx)
        answers = load_all(reader, ks, ctx)
        assert all(a is LookupResult.HIT for a in answers.values()), answers
        assert [host_row(reader, k, ctx) for k in ks] == [row_of(i) for i in range(3)]
    finally:
        writer.shutdown()
        reader.shutdown()
