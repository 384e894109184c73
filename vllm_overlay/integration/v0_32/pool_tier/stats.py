"""The pool tier's counters in vLLM's own metrics: ``vllm:kv_offload_pool_*``
(Prometheus, through the OffloadingConnector's stats, labelled by the
engine like vLLM's other offloading metrics) and the state of its reads and
writes as gauges (1: open, 0: paused)."""

from __future__ import annotations

from vllm_overlay.core.pool.pool import PoolStats

PREFIX = "vllm:kv_offload_pool_"

# PoolStats field -> what the counter counts
COUNTERS = {
    "lookups": "lookups answered by the pool",
    "hits": "blocks found by lookups",
    "misses": "blocks not found by lookups",
    "lookups_skipped": "lookups answered 'miss' at once (reads paused, queue full)",
    "lookup_timeouts": "lookups not answered within lookup_wait_s",
    "loaded_blocks": "blocks loaded into the host tier",
    "load_failures": "blocks whose load failed (missing or refused values)",
    "load_timeouts": "loads cancelled past io_timeout_s",
    "limited_loads": "blocks not loaded: over the in-flight load limit",
    "stored_blocks": "blocks written",
    "skipped_existing": "blocks not written: already in the pool",
    "dropped_stores": "blocks not written: over the limit, paused or failed",
    "bad_signatures": "values refused: unsigned or a wrong MAC",
    "bytes_in": "bytes read from the pool",
    "bytes_out": "bytes written to the pool",
    "errors": "failed pool operations (every kind)",
    "unreachable": "failures: unreachable",
    "slow": "failures: slow (past a deadline)",
    "full": "failures: full (maxmemory)",
    "read_only": "failures: read-only (a replica)",
    "denied": "failures: denied (ACL, credentials)",
    "bad_requests": "failures: other error replies",
    "bad_keys": "failures: a key of the wrong type (deleted)",
    "stuck": "failures: a pool thread stuck past its deadline",
    "internal_errors": "failures: internal (a bug; logged with a traceback)",
    "pauses": "times reads or writes were paused",
}
GAUGES = {"open": "pool reads/writes open (1) or paused (0), by direction"}


def metric_definitions() -> dict:
    from vllm.v1.kv_offload.base import (
        OffloadingCounterMetadata,
        OffloadingGaugeMetadata,
    )

    out = {
        PREFIX + name: OffloadingCounterMetadata(documentation=f"KV pool tier: {doc}")
        for name, doc in COUNTERS.items()
    }
    out[PREFIX + "open"] = OffloadingGaugeMetadata(
        documentation=f"KV pool tier: {GAUGES['open']}", labelnames=("direction",)
    )
    return out


def connector_stats(stats: PoolStats, state: dict[str, str]):
    """One interval's ``PoolStats`` and the pool's state as vLLM's
    ``OffloadingConnectorStats`` (None when there is nothing to say)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
        OffloadingConnectorStats,
    )

    out = OffloadingConnectorStats()
    for name in COUNTERS:
        value = getattr(stats, name)
        if value:
            out.increase_counter(PREFIX + name, value)
    for direction, how in state.items():
        out.set_gauge(PREFIX + "open", int(how == "open"), (direction,))
    return out
