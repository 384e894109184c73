"""SharedPoolTier under vLLM 0.33's own ``TieringOffloadingManager`` (a
Python-only build of its sdist, ``.venv-0.33``), against a real Valkey:
what 0.33 changed in the tier's caller (``docs/vllm-0.33-delta.md`` a, b).

The 0.32 suites' tier tests run here too (``tox -e v0_33``:
tests/v0_32/test_pool_tier_unit.py, _contracts.py, _wakeups.py: lookups,
stores, promotions byte for byte, drain and reset, a changed value, a hung
server).  Here, on top:

* after ``reset_cache`` 0.33 holds promotions until the scheduler's reset
  fence calls ``on_reset_flushed``: no pool lookup in between (keys the
  host tier lost are misses), then the pool's values promote again, byte
  for byte;
* 0.33's scheduler holds the manager's lock across a step: the tier's
  lookups, promotions and stores run under it and never wait for it;
* a value changed in the pool: its promotion alone fails, the others load
  byte for byte, the value is deleted and its key is a miss from then on;
* a stopped server: lookups become misses within the deadline, cascades
  are not stored (failed, or dropped once writes pause), and the tier
  stores and loads again once the server is back;
* ``config_info``: 0.33's manager publishes the tier with its label.
"""

from __future__ import annotations

import pathlib
import sys
import threading
import time

import numpy
import pytest
from vllm.v1.kv_offload.base import LookupResult, ReqContext
from vllm.v1.kv_offload.tiering.base import TIER_LABEL, TieringOffloadingMetrics

sys.path.insert(0, str(pathlib.Path(__file__).parents[1]))
from support.redis_server import RedisServer  # noqa: E402
from support.tiering_manager import (  # noqa: E402
    FAST,
    counters,
    finished,
    host_holds,
    keys,
    make_manager,
    promote,
    step,
    store,
)

CASCADE_FAILURES = TieringOffloadingMetrics.CASCADE_JOB_FAILURES
PROMOTION_FAILURES = TieringOffloadingMetrics.PROMOTION_JOB_FAILURES


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


def host_rows(manager, ks, ctx) -> list[bytes]:
    """The host tier's bytes for KS (each key's chunk, looked up)."""
    view = numpy.asarray(manager.primary_tier.get_kv_memoryview())
    out = manager.primary_tier.prepare_load(ks, ctx)
    rows = [view[chunk].tobytes() for chunk in out.chunk_ids]
    manager.primary_tier.complete_load(ks, ctx)
    return rows


def stored_rows(n: int) -> list[bytes]:
    """What ``store`` writes: chunk n holds the byte n + 1 everywhere."""
    from support.tiering_manager import PAGE

    return [bytes([i + 1]) * PAGE for i in range(n)]


def test_promotions_wait_for_the_reset_fence_then_load_the_pools_bytes(server):
    manager = make_manager(server.url, **FAST)
    tier = manager.secondary_tiers[0]
    asked = []
    lookup = tier.lookup
    tier.lookup = lambda key, ctx: asked.append(key) or lookup(key, ctx)
    try:
        ctx = ReqContext("r")
        manager.on_new_request(ctx)
        ks = keys(3)
        store(manager, ks, ctx)
        finished(manager, tier)
        assert tier.pool.count_hits([tier._name(k) for k in ks]) == 3
        manager.reset_cache()
        assert not any(host_holds(manager, k, ctx) for k in ks)
        numpy.asarray(manager.primary_tier.get_kv_memoryview())[:] = 0
        asked.clear()
        for _ in range(3):  # steps before the fence: held, the pool not asked
            assert [manager.lookup(k, ctx) for k in ks] == [LookupResult.MISS] * 3
            manager.on_schedule_end(step())
        assert asked == []
        manager.on_reset_flushed()  # the scheduler's fence: all reported
        promote(manager, ks, ctx)
        finished(manager, tier)
        assert asked  # the pool answered the lookups
        assert all(host_holds(manager, k, ctx) for k in ks)
        rows = host_rows(manager, ks, ctx)
        assert sorted(rows) == sorted(stored_rows(3))
    finally:
        manager.shutdown()


def test_a_refused_value_fails_its_promotion_only(server):
    """Another node's value changed in the pool (one bit): 0.33's manager
    promotes the other keys byte for byte, the changed one's load fails
    (the tier refuses the value and deletes it), the host tier never holds
    it, and the next lookups answer MISS for it."""
    import redis

    writer = make_manager(server.url, **FAST)
    reader = make_manager(server.url, **FAST)
    tier = reader.secondary_tiers[0]
    try:
        ctx = ReqContext("r")
        writer.on_new_request(ctx)
        reader.on_new_request(ctx)
        ks = keys(3, seed=9)
        store(writer, ks, ctx)
        finished(writer, writer.secondary_tiers[0])
        client = redis.Redis.from_url(server.url)
        name = tier._name(ks[1])
        value = client.get(name)
        client.set(name, value[:-1] + bytes([value[-1] ^ 1]))
        answers = {}
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            answers = {k: reader.lookup(k, ctx) for k in ks}
            reader.on_schedule_end(step())
            reader._process_finished_jobs()
            settled = [host_holds(reader, ks[0], ctx), host_holds(reader, ks[2], ctx)]
            if all(settled) and answers[ks[1]] is LookupResult.MISS:
                break
            time.sleep(0.01)
        assert answers[ks[1]] is LookupResult.MISS
        assert not host_holds(reader, ks[1], ctx)
        assert counters(reader)[PROMOTION_FAILURES] == 1  # its load failed
        while client.exists(name) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not client.exists(name)  # the tier deleted the bad value
        assert sorted(host_rows(reader, [ks[0], ks[2]], ctx)) == sorted(
            [stored_rows(3)[0], stored_rows(3)[2]]
        )
    finally:
        writer.shutdown()
        reader.shutdown()


def test_under_the_managers_lock_the_tier_never_waits_for_it(server):
    """0.33's scheduler takes ``manager.lock`` for a whole step and calls
    the manager (and so the tier) under it; the lock is not reentrant, so
    a tier that took it would hang the step.  A step here: lookups,
    stores and the step's end, under the lock, in a thread with a
    deadline."""
    manager = make_manager(server.url, **FAST)
    tier = manager.secondary_tiers[0]
    assert manager.lock is not None
    done = threading.Event()
    errors = []

    def steps():
        try:
            ctx = ReqContext("r")
            with manager.lock:
                manager.on_new_request(ctx)
                store(manager, keys(2, seed=5), ctx)
                manager.on_schedule_end(step())
            deadline = time.monotonic() + 10
            while manager._jobs and time.monotonic() < deadline:
                with manager.lock:
                    manager.lookup(keys(1, seed=6)[0], ctx)
                    manager.on_schedule_end(step())
                time.sleep(0.01)
            assert not manager._jobs
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
        finally:
            done.set()

    thread = threading.Thread(target=steps, daemon=True)
    thread.start()
    try:
        assert done.wait(30), "a step under the manager's lock hung"
        assert not errors, errors
        assert tier.pool.count_hits([tier._name(k) for k in keys(2, seed=5)]) == 2
    finally:
        manager.shutdown()


def test_a_stopped_server_gives_misses_and_failed_stores_then_resumes(server):
    manager = make_manager(
        server.url, retry_backoff_s=0.2, max_retry_backoff_s=0.2, **FAST
    )
    tier = manager.secondary_tiers[0]
    try:
        ctx = ReqContext("r")
        manager.on_new_request(ctx)
        server.stop()
        # not stored: it fails, or is dropped (no failure) once another
        # thread found the server gone and paused writes
        store(manager, keys(2, seed=1), ctx)
        finished(manager, tier)
        assert tier.pool.cumulative()["dropped_stores"] == 2
        assert counters(manager).get(CASCADE_FAILURES, 0) <= 1
        manager.reset_cache()
        manager.on_reset_flushed()
        start = time.monotonic()
        answers = []
        while time.monotonic() - start < 10:
            answers = [manager.lookup(k, ctx) for k in keys(2, seed=1)]
            manager.on_schedule_end(step())
            if LookupResult.RETRY not in answers:
                break
            time.sleep(0.01)
        assert answers == [LookupResult.MISS] * 2
        server.restart()
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            store(manager, keys(2, seed=2), ctx)
            finished(manager, tier)
            names = [tier._name(k) for k in keys(2, seed=2)]
            if tier.pool.count_hits(names) == 2:
                break
            manager.reset_cache()
            manager.on_reset_flushed()
            time.sleep(0.2)
        assert tier.pool.count_hits([tier._name(k) for k in keys(2, seed=2)]) == 2
    finally:
        manager.shutdown()


def test_0_33s_manager_publishes_the_tier_with_its_label(server):
    manager = make_manager(server.url, **FAST)
    try:
        info = manager.config_info()
        tiers = [dict(mapping) for mapping in info if TIER_LABEL in mapping]
        assert any(m[TIER_LABEL].endswith("SharedPoolTier") for m in tiers), info
    finally:
        manager.shutdown()


def test_0_33s_offloading_config_names_the_model_config(monkeypatch):
    """PT32-01 on 0.33: the config upstream's OffloadingConnector builds
    (its build_offloading_config, from the engine's KV cache config) lists
    vLLM's own hashes of the model and cache configs, which the pool tier
    namespaces its keys by and refuses to start without."""
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1 import offloading_connector
    from vllm.engine.arg_utils import EngineArgs

    from vllm_overlay.integration.v0_32.kv_identity import (
        _without_location,
        config_factors,
    )
    from vllm_overlay.integration.v0_32.pool_tier import identity
    from vllm_overlay.testing import tiny_model_path

    sys.path.insert(0, str(pathlib.Path(__file__).parents[1]))
    from support.engine_core_v033 import initialize

    config = EngineArgs(
        model=tiny_model_path(),
        dtype="float32",
        max_model_len=512,
        kv_cache_memory_bytes=8 * 2**20,
    ).create_engine_config()
    (kv_cache_config,) = initialize(config)
    config.kv_transfer_config = KVTransferConfig(
        kv_connector="OffloadingConnector",
        kv_role="kv_both",
        engine_id="e",
        kv_connector_extra_config={"cpu_bytes_to_use": 2**24},
    )
    built = offloading_connector.build_offloading_config(config, kv_cache_config)
    # no engine core here: the configuration's part only (KI32-01 adds the
    # engine's weights and page layout in the engine core's process)
    assert built.extra_config["kv_identity"] == config_factors(config)
    assert (
        f"model-hash={_without_location(config.model_config).compute_hash()}"
        in (built.extra_config["kv_identity"])
    )
    assert "format=vllm-0.33/chunks-1" in built.extra_config["kv_identity"]
    # what the tier namespaces its keys by, from 0.33's config
    factors = identity.tier_factors(built, 4096, "", ["weights=w", "pages=p"])
    assert set(config_factors(config)) <= set(factors)
    with pytest.raises(ValueError, match="weights fingerprint and page layout"):
        identity.tier_factors(built, 4096, "")
