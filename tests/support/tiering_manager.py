"""Upstream's tiering manager with the pool tier, driven as its
scheduler drives it (vLLM 0.32 and 0.33: ``TieringOffloadingSpec
.get_manager`` through upstream's tier factory, the real CPU primary tier),
for the tests of the pool tier under that caller."""

from __future__ import annotations

import mmap
import time
import uuid

import numpy
from vllm.v1.kv_offload.base import LookupResult, make_offload_key
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)

CHUNKS, PAGE = 16, 4096
TIER = {
    "type": "SharedPoolTier",
    "module_path": "vllm_overlay.integration.v0_32.pool_tier",
}
# Short deadlines: a drain gives up after io_timeout_s + timeout_s + 2 s.
FAST = {"timeout_s": 0.5, "io_timeout_s": 0.5, "connect_timeout_s": 0.5}


def make_manager(url: str, **options):
    """Upstream's tiering manager: CPU primary tier + the pool tier."""
    from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

    row = -(-PAGE // mmap.PAGESIZE) * mmap.PAGESIZE
    config = OffloadingConfig(
        groups=(OffloadingGroupConfig(16, ("l0",), 0),),
        worker_kv_bytes_per_block=PAGE,
        enable_kv_cache_events=False,
        extra_config={
            "cpu_bytes_to_use": CHUNKS * row,
            "kv_identity": ["model-hash=contracts", "weights=w", "pages=p"],
            "secondary_tiers": [{**TIER, "url": url, **options}],
        },
        engine_id=f"overlay-test-{uuid.uuid4().hex}",
        model=OffloadingModelConfig("tiny", "float32"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(0, 1, 1, 1, 1, 1, 0, 1, None, True),
    )
    return TieringOffloadingSpec(config).get_manager()


def keys(n: int, seed: int = 0) -> list:
    return [make_offload_key(bytes([seed, i]) * 16, 0) for i in range(n)]


def store(manager, ks, ctx) -> None:
    """GPU -> host tier done: upstream cascades the chunks to the pool."""
    out = manager.prepare_store(ks, ctx)
    view = numpy.asarray(manager.primary_tier.get_kv_memoryview())
    for n, chunk in enumerate(out.store_spec.chunk_ids):
        view[chunk] = n + 1
    manager.complete_store(ks, ctx, True)


def finished(manager, tier, timeout_s: float = 15.0) -> None:
    """Step the manager until no job is left."""
    deadline = time.monotonic() + timeout_s
    while manager._jobs and time.monotonic() < deadline:
        manager._process_finished_jobs()
        time.sleep(0.01)
    assert not manager._jobs


def promote(manager, ks, ctx, timeout_s: float = 15.0) -> None:
    """Look ``ks`` up step by step until the pool tier answers and the
    promotions are submitted (the host tier does not hold them)."""
    deadline = time.monotonic() + timeout_s
    todo = list(ks)
    while todo and time.monotonic() < deadline:
        todo = [
            k
            for k in todo
            if manager.lookup(k, ctx)
            not in (LookupResult.HIT_PENDING, LookupResult.HIT)
        ]
        manager.on_schedule_end(step())
        time.sleep(0.01)
    assert not todo, "the pool tier never answered HIT"


def step():
    from vllm.v1.kv_offload.base import ScheduleEndContext

    return ScheduleEndContext(new_req_ids=(), preempted_req_ids=())


def host_holds(manager, k, ctx) -> bool:
    return manager.primary_tier.lookup(k, ctx) is LookupResult.HIT


def counters(manager) -> dict:
    """Upstream's tiering counters for the pool tier (tier #1)."""
    stats = manager.get_stats()
    reduced = stats.reduce() if stats is not None else {}
    label = "('1:SharedPoolTier',)"
    return {k[: -len(label) - 1]: v for k, v in reduced.items() if k.endswith(label)}
