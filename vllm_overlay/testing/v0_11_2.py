"""Engines on vLLM 0.11.2: the overlay's own connectors, configured as the
tests, benchmarks and the demo use them, and their counters."""

from __future__ import annotations

# The e2e pool nodes: fail over fast, but a lookup starved of CPU on a
# loaded 2-core runner must not turn a hit into a recompute
# (tests/unit/test_pool_liveness.py covers slow pools).
TEST_POOL_OPTIONS = {
    "retry_backoff_s": 0.2,
    "max_retry_backoff_s": 0.5,
    "timeout_s": 1.0,
    "connect_timeout_s": 0.5,
    "lookup_wait_s": 1.0,
}


def probe_connector(prefer: bool = True):
    """CrossLayerProbeConnector (moves no data; asks for cross-layer blocks
    unless ``prefer`` is false).  Named by module path, so it also loads with
    the overlay disabled (the upstream-style patched tree in patches/)."""
    from vllm.config import KVTransferConfig

    return KVTransferConfig(
        kv_connector="CrossLayerProbeConnector",
        kv_role="kv_both",
        kv_connector_module_path="vllm_overlay.connectors.probe",
        kv_connector_extra_config={}
        if prefer
        else {"prefer_cross_layer_blocks": False},
    )


def offload_connector(name: str = "OverlayOffloadingConnector", **extra):
    """OverlayOffloadingConnector with ``extra`` as its options (cpu_bytes or
    num_cpu_blocks, block_size, transfer_method...); ``name``: the class as
    vLLM's factory knows it (the patched tree in patches/ names it
    CrossLayer...)."""
    from vllm.config import KVTransferConfig

    return KVTransferConfig(
        kv_connector=name, kv_role="kv_both", kv_connector_extra_config=extra
    )


def pool_connector(url: str, namespace: str | None = None, **extra):
    """SharedKVPoolConnector on ``url`` in ``namespace`` (None: the
    connector's default); ``extra``: more options (``**TEST_POOL_OPTIONS``,
    a secret, ``cluster``...)."""
    from vllm.config import KVTransferConfig

    options = {"url": url, **extra}
    if namespace is not None:
        options["namespace"] = namespace
    return KVTransferConfig(
        kv_connector="SharedKVPoolConnector",
        kv_role="kv_both",
        kv_connector_extra_config=options,
    )


def multi_connector(offload: dict, pool: dict):
    """vLLM's MultiConnector over OverlayOffloadingConnector (host memory,
    asked first) and SharedKVPoolConnector (asked second); ``offload`` and
    ``pool``: each one's ``kv_connector_extra_config``."""
    from vllm.config import KVTransferConfig

    return KVTransferConfig(
        kv_connector="MultiConnector",
        kv_role="kv_both",
        kv_connector_extra_config={
            "connectors": [
                {
                    "kv_connector": "OverlayOffloadingConnector",
                    "kv_role": "kv_both",
                    "kv_connector_extra_config": offload,
                },
                {
                    "kv_connector": "SharedKVPoolConnector",
                    "kv_role": "kv_both",
                    "kv_connector_extra_config": pool,
                },
            ]
        },
    )


def connector_info(worker) -> dict:
    """Runs in the worker (``collective_rpc``): the layout and the overlay
    connector's own totals (pool: drained first, so its stores are in)."""
    from vllm.distributed.kv_transfer import (
        get_kv_transfer_group,
        has_kv_transfer_group,
    )

    info = {
        "cross_layer": getattr(worker.model_runner, "cross_layers_kv_cache", None)
        is not None
    }
    if not has_kv_transfer_group():
        return info
    connector = get_kv_transfer_group()
    if hasattr(connector, "pool"):  # SharedKVPoolConnector
        connector.pool.drain()
        table = connector.connector_worker._table
        info.update(kind="pool", totals=connector.pool.cumulative())
    else:  # OverlayOffloadingConnector
        handler = connector.connector_worker.handler
        table = handler.mover.table
        info.update(
            kind="offload", totals=handler.cumulative(), method=handler.mover.method
        )
    info.update(runs_per_block=table.runs_per_block, block_bytes=table.block_bytes)
    return info
