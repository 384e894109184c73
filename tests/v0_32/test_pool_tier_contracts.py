"""SharedPoolTier under upstream's own caller: vLLM 0.32's
``TieringOffloadingManager`` (built by ``TieringOffloadingSpec.get_manager``
through upstream's tier factory, with the real CPU primary tier), the tier
against a real Valkey server.

Checked, each where it bites:

* the drain contract: ``reset_cache`` calls the tier's ``drain_jobs``, then
  consumes the finished jobs and asserts none is left.  With the jobs'
  completions slowed (stores and promotions), and with a store still running
  past the drain's deadline, it must not raise, must see every job's
  result once (a late completion is not reported again), and must clear
  the host tier;
* failed stores are reported as failed (upstream counts them, and its
  back-pressure detector is fed successful stores only), stores the pool
  dropped without trying are not;
* the factory's own keys (``locality``) are accepted.
"""

from __future__ import annotations

import pathlib
import sys
import threading
import time

import pytest
from vllm.v1.kv_offload.base import ReqContext
from vllm.v1.kv_offload.tiering.base import TieringOffloadingMetrics

sys.path.insert(0, str(pathlib.Path(__file__).parents[1]))
from support.redis_server import RedisServer  # noqa: E402
from support.tiering_manager import (  # noqa: E402
    FAST,
    PAGE,
    TIER,
    counters,
    finished,
    host_holds,
    keys,
    make_manager,
    promote,
    step,
    store,
)

from vllm_overlay.core.pool import codec  # noqa: E402

CASCADE_FAILURES = TieringOffloadingMetrics.CASCADE_JOB_FAILURES
WRITE_BYTES = TieringOffloadingMetrics.WRITE_BYTES


def slowed(tier, name: str, delay_s: float, once: bool = False):
    """Delay the tier's ``name`` callback (it runs on the pool's threads
    when a job completes) by ``delay_s``."""
    original = getattr(tier, name)
    calls = []

    def slow(*args, **kwargs):
        if not (once and calls):
            calls.append(time.monotonic())
            time.sleep(delay_s)
        return original(*args, **kwargs)

    setattr(tier, name, slow)
    return calls


@pytest.fixture
def server():
    s = RedisServer()
    yield s
    s.resume()
    s.close()


# -- 1. the drain contract ----------------------------------------------------
def test_reset_cache_sees_every_job_whose_completion_is_slow(server):
    """Completions 0.3 s late: ``drain_jobs`` returns only once every
    result is queued, so ``reset_cache`` finds no job left."""
    manager = make_manager(server.url, **FAST)
    tier = manager.secondary_tiers[0]
    try:
        ctx = ReqContext("r")
        manager.on_new_request(ctx)
        ks = keys(3)
        slowed(tier, "_stored", 0.3)
        store(manager, ks, ctx)
        assert manager._jobs  # the cascade is in flight
        manager.reset_cache()  # before the fix: AssertionError
        assert not manager._jobs
        assert not any(host_holds(manager, k, ctx) for k in ks)  # cleared
        assert tier.pool.count_hits([tier._name(k) for k in ks]) == 3
        # 0.33 holds promotions after a reset until its scheduler's reset
        # fence (every job in flight at the reset reported) lifts the hold
        if hasattr(manager, "on_reset_flushed"):
            manager.on_reset_flushed()

        # A promotion whose completion is slow: the same.
        slowed(tier, "_verdicts", 0.3)
        promote(manager, ks, ctx)
        assert any(m.transfer_job.is_promotion for m in manager._jobs.values())
        manager.reset_cache()
        assert not manager._jobs
        assert not any(host_holds(manager, k, ctx) for k in ks)
        assert not tier.has_pending_work()
    finally:
        manager.shutdown()


def test_reset_cache_fails_a_store_still_running_past_the_drains_deadline(server):
    """A store that outlives the drain's deadline (here: its completion
    takes 5 s, the deadline is 3 s) is reported failed by ``drain_jobs``;
    its late completion is not reported again."""
    manager = make_manager(server.url, **FAST)
    tier = manager.secondary_tiers[0]
    try:
        ctx = ReqContext("r")
        manager.on_new_request(ctx)
        ks = keys(2)
        calls = slowed(tier, "_stored", 5.0, once=True)
        store(manager, ks, ctx)
        start = time.monotonic()
        manager.reset_cache()  # before the fix: AssertionError
        assert time.monotonic() - start < 4.9  # did not wait for it
        assert not manager._jobs
        assert not any(host_holds(manager, k, ctx) for k in ks)
        assert counters(manager)[CASCADE_FAILURES] == 1
        # The late completion comes and is ignored: upstream would assert
        # on a job it no longer tracks.
        while time.monotonic() - calls[0] < 5.5:
            time.sleep(0.1)
        assert list(tier.get_finished_jobs()) == []
        manager.on_schedule_end(step())
        assert not tier.has_pending_work()
        # The tier goes on: the next cascade is stored and reported.
        more = keys(2, seed=1)
        store(manager, more, ctx)
        finished(manager, tier)
        assert tier.pool.count_hits([tier._name(k) for k in more]) == 2
    finally:
        manager.shutdown()


# -- 5. failed stores are failed, dropped ones are not ------------------------
BACKPRESSURE = {"backpressure": {"backpressure_cls": "EMABackpressureDetector"}}


def test_stores_the_pool_did_not_take_are_failed_only_if_tried(server):
    """A stored chunk succeeds with the bytes written.  Chunks the pool
    drops on purpose, without trying (over the in-flight limit, or while
    writes are paused), are no failure: the store succeeds with the bytes
    it wrote (none: the detector learns nothing).  A store that failed on a
    stopped server is a failed cascade (counted, not a latency).  (0.33's
    back-pressure sees the difference: tests/v0_33/
    test_pool_tier_backpressure_v033.py.)"""
    value_bytes = PAGE + codec.HEADER_BYTES  # a primary row, with its header
    manager = make_manager(
        server.url,
        max_inflight_bytes=value_bytes,  # one value at a time
        retry_backoff_s=30.0,
        max_retry_backoff_s=30.0,
        **FAST,
        **BACKPRESSURE,
    )
    tier = manager.secondary_tiers[0]
    detector = tier.bp_detector
    try:
        ctx = ReqContext("r")
        manager.on_new_request(ctx)
        store(manager, keys(1), ctx)
        finished(manager, tier)
        seen = counters(manager)
        row = manager.primary_tier.get_kv_memoryview().strides[0]
        assert seen[WRITE_BYTES] == row and CASCADE_FAILURES not in seen
        assert detector._completions == 1

        store(manager, keys(3, seed=1), ctx)  # 1 admitted, 2 dropped
        finished(manager, tier)
        assert CASCADE_FAILURES not in counters(manager)
        assert tier.pool.count_hits([tier._name(k) for k in keys(3, seed=1)]) == 1
        assert detector._completions == 2  # the chunk written, a latency

        server.pause()
        store(manager, keys(1, seed=2), ctx)  # times out: writes pause
        finished(manager, tier)
        store(manager, keys(1, seed=3), ctx)  # paused: not sent
        finished(manager, tier)
        seen = counters(manager)
        assert seen[CASCADE_FAILURES] == 1  # the one tried
        assert tier.pool.state()["write"] != "open"
        assert detector._completions == 2  # neither is a latency
    finally:
        server.resume()
        manager.shutdown()


@pytest.mark.parametrize("locality", [None, "REMOTE", "LOCAL", "remote"])
def test_the_factorys_locality_key_is_accepted(server, locality):
    """Upstream's factory hands the tier every key of its config but
    ``type``, ``module_path`` and ``backpressure``: ``locality`` too."""
    from vllm.v1.kv_offload.base import Locality

    options = {} if locality is None else {"locality": locality}
    manager = make_manager(server.url, **options)
    try:
        tier = manager.secondary_tiers[0]
        expected = Locality((locality or "REMOTE").upper())
        assert tier.locality is expected
    finally:
        manager.shutdown()


def test_a_bad_locality_is_refused_by_name(server):
    with pytest.raises(ValueError, match="locality 'nearby'.*LOCAL, REMOTE"):
        make_manager(server.url, locality="nearby")


def test_the_front_ends_check_takes_locality_as_the_tier_does():
    """The front end checks a pool tier's options as the tier reads them
    (integration/v0_32/config_check.py): ``locality`` is not refused."""
    from vllm_overlay.integration.v0_32 import config_check

    entry = {**TIER, "url": "redis://127.0.0.1:6379"}
    refusal = config_check.pool_tier_refusal
    assert refusal("e", 0, {**entry, "locality": "REMOTE"}) is None
    refusal = refusal("e", 0, {**entry, "locality": "near"})
    assert "locality 'near' is not one of LOCAL, REMOTE" in refusal


# -- 8. leaks -----------------------------------------------------------------
def pool_threads() -> list[str]:
    return sorted(
        t.name
        for t in threading.enumerate()
        if t.name.startswith("vllm-overlay-pool") and t.is_alive()
    )


def test_a_tier_that_fails_to_start_leaves_no_thread_running(server):
    """Built by upstream's factory with ``max_inflight_bytes`` below one
    value: refused, and no pool thread is left reconnecting."""
    before = pool_threads()
    with pytest.raises(ValueError, match="max_inflight_bytes"):
        make_manager(server.url, max_inflight_bytes=1000)
    deadline = time.monotonic() + 10
    while pool_threads() != before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert pool_threads() == before
