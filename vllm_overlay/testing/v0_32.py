"""Engines on vLLM 0.32: upstream's ``OffloadingConnector`` (on the CPU
platform through the overlay's worker, patch OF32-01) and the KV cache
layout switch (cross-layer ``BLHNC`` on CPU_ATTN: patch CL32-01), as the
tests/v0_32 runners and the demo build them, and the worker's counters; the
same connector with the overlay's pool tier behind host memory, and the
tier's counters."""

from __future__ import annotations

from vllm_overlay.features import POOL_TIER_MODULE

CPU_BYTES = 64 * 2**20  # host memory for offloaded KV (the tests' engines)

# VLLM_KV_CACHE_LAYOUT: blocks outermost (one block of every layer is one
# contiguous run: cross-layer) or layers outermost (stock, per layer).
CROSS_LAYER = "BLHNC"
PER_LAYER = "LBHNC"


def layout_env(cross_layer: bool) -> dict[str, str]:
    """The environment that picks the KV cache layout of an engine."""
    return {"VLLM_KV_CACHE_LAYOUT": CROSS_LAYER if cross_layer else PER_LAYER}


def offload_connector(cpu_bytes: int = CPU_BYTES, **extra):
    """Upstream's OffloadingConnector configured as upstream documents it:
    ``cpu_bytes_to_use`` of host memory (``extra``: its other keys)."""
    from vllm.config import KVTransferConfig

    return KVTransferConfig(
        kv_connector="OffloadingConnector",
        kv_role="kv_both",
        kv_connector_extra_config={"cpu_bytes_to_use": cpu_bytes, **extra},
    )


def pool_tier_connector(url: str, cpu_bytes: int = CPU_BYTES, **options):
    """``offload_connector`` with ``TieringOffloadingSpec``: ``cpu_bytes`` of
    host memory the primary tier, the overlay's ``SharedPoolTier`` on the
    Redis/Valkey server at ``url`` the secondary tier (``options``: the
    tier's other keys, e.g. ``namespace``)."""
    tier = {"type": "SharedPoolTier", "module_path": POOL_TIER_MODULE, "url": url}
    return offload_connector(
        cpu_bytes,
        spec_name="TieringOffloadingSpec",
        secondary_tiers=[{**tier, **options}],
    )


def pool_tier_totals(llm) -> dict | None:
    """The pool tier's counters since the engine started (``PoolStats``:
    ``loaded_blocks``, ``bytes_in``, ``stored_blocks``, ``bytes_out``, ...;
    what ``vllm:kv_offload_pool_*`` reports), of an engine built in this
    process (``in_process_engine``); None without a pool tier."""
    from vllm_overlay.integration.v0_32.pool_tier import SharedPoolTier

    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    connector = getattr(scheduler, "connector", None)
    side = getattr(connector, "connector_scheduler", None)
    tiers = getattr(getattr(side, "manager", None), "secondary_tiers", None) or []
    for tier in tiers:
        if isinstance(tier, SharedPoolTier):
            return tier.pool.cumulative()
    return None


def connector_info(worker) -> dict:
    """Runs in the worker (``collective_rpc``): the resolved KV cache layout
    and, with the offloading connector, its worker's copy calls and blocks
    per direction (``store``/``load``)."""
    from vllm.distributed.kv_transfer import (
        get_kv_transfer_group,
        has_kv_transfer_group,
    )

    config = worker.model_runner.cache_config
    info = {"layout": config.get_resolved_kv_cache_layout().name}
    if not has_kv_transfer_group():
        return info
    offload = get_kv_transfer_group().connector_worker.worker
    info.update(
        kind="offload",
        worker=type(offload).__name__,
        copies=dict(offload.copies),
        blocks=dict(offload.blocks),
        runs_per_block=offload.table.runs_per_block,
        block_bytes=offload.table.block_bytes,
    )
    return info
