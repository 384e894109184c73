"""Stores the pool drops on purpose are no failure for vLLM 0.33's
back-pressure (``.venv-0.33``; the pool tier in 0.33's own
``TieringOffloadingManager``, against a real Valkey).

0.33's contract: a cascade's ``JobResult.success`` is False when a key
failed (``tiering/base.py``); the manager then calls the detector's
``on_store_failed`` (``manager.py`` ``_update_backpressure``), and the EMA
detector with ``failure_threshold`` set goes under pressure after that
many in a row (upstream's throttling then drops the cascades to the tier).
A successful store feeds ``update(submit_time, transfer_bytes)``, which
ignores 0 bytes: "nothing moved, nothing learnt".  JobResult has no
"not attempted" state; a success with the bytes written (0: none) is the
contract's way to say it.

The pool drops stores on purpose over its in-flight limit and while its
writes are paused after a failure: before the fix each such store was a
failed cascade, so a busy pool, or one paused after a single timeout,
tripped ``failure_threshold`` and counted failures that never happened.
"""

from __future__ import annotations

import pathlib
import sys

import pytest
from vllm.v1.kv_offload.base import ReqContext
from vllm.v1.kv_offload.tiering.base import TieringOffloadingMetrics

sys.path.insert(0, str(pathlib.Path(__file__).parents[1]))
from support.redis_server import RedisServer  # noqa: E402
from support.tiering_manager import (  # noqa: E402
    FAST,
    PAGE,
    counters,
    finished,
    keys,
    make_manager,
    store,
)

from vllm_overlay.core.pool import codec  # noqa: E402

CASCADE_FAILURES = TieringOffloadingMetrics.CASCADE_JOB_FAILURES
BACKPRESSURE = {
    "backpressure_cls": "EMABackpressureDetector",
    "failure_threshold": 2,
}


@pytest.fixture
def server():
    s = RedisServer()
    yield s
    s.resume()
    s.close()


@pytest.fixture(autouse=True)
def overlay():
    import vllm_overlay

    assert vllm_overlay.register() == "applied"


def test_dropped_stores_do_not_trip_the_failure_threshold(server):
    manager = make_manager(
        server.url,
        max_inflight_bytes=PAGE + codec.HEADER_BYTES,  # one value at a time
        retry_backoff_s=30.0,
        max_retry_backoff_s=30.0,
        locality="REMOTE",
        backpressure=BACKPRESSURE,
        **FAST,
    )
    tier = manager.secondary_tiers[0]
    detector = tier.bp_detector
    try:
        ctx = ReqContext("r")
        manager.on_new_request(ctx)
        # over the in-flight limit: 1 of 3 admitted each time, 6 dropped
        for seed in range(3):
            store(manager, keys(3, seed=seed), ctx)
            finished(manager, tier)
        assert tier.pool.cumulative()["dropped_stores"] == 6  # before: 4 (throttled)
        assert CASCADE_FAILURES not in counters(manager)
        assert detector.stats["consecutive_store_failures"] == 0
        assert not detector.is_under_pressure()  # before: under pressure
        assert manager._should_store_to_tier(tier, 1)

        # one real failure (a stopped server), then stores while writes
        # are paused: only the failure counts
        server.pause()
        store(manager, keys(1, seed=7), ctx)  # times out: writes pause
        finished(manager, tier)
        assert tier.pool.state()["write"] != "open"
        for seed in (8, 9):
            store(manager, keys(1, seed=seed), ctx)  # paused: not sent
            finished(manager, tier)
        assert counters(manager)[CASCADE_FAILURES] == 1
        assert detector.stats["consecutive_store_failures"] == 1
        assert not detector.is_under_pressure()  # before: under pressure
    finally:
        server.resume()
        manager.shutdown()
