"""vLLM 0.11.2's MultiConnector over the overlay's connectors: its
Prometheus metrics.  MultiConnector's observer asserts that every connector
whose stats reach the API server built Prometheus metrics; without them the
API server's first stats record raised and every request failed (HTTP 500)
under ``vllm serve``.  Both connectors now export counters."""

from __future__ import annotations

import functools
import types

import prometheus_client
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    Counter,
    Gauge,
    Histogram,
)
from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import (
    MultiConnector,
)

from vllm_overlay.testing.v0_11_2 import multi_connector

LABELS = {"model_name": "tiny", "engine": "0"}


def _prom(registry):
    config = types.SimpleNamespace(
        kv_transfer_config=multi_connector(
            {"num_cpu_blocks": 4}, {"url": "redis://127.0.0.1:1"}
        )
    )
    metric_types = {
        kind: functools.partial(kind, registry=registry)
        for kind in (Gauge, Counter, Histogram)
    }
    return MultiConnector.build_prom_metrics(
        config, metric_types, list(LABELS), {0: list(LABELS.values())}
    )


def test_multi_connector_records_both_connectors_stats(overlay):
    registry = prometheus_client.CollectorRegistry()
    prom = _prom(registry)
    # What the API server receives: per connector class, its stats as a
    # dict (msgpack'd dataclass) with the interval's data.
    step = {
        "OverlayOffloadingConnector": {
            "data": {
                "load": {"jobs": 2, "blocks": 5, "bytes": 1310720, "seconds": 0.1},
                "store": {"jobs": 1, "blocks": 3, "bytes": 786432, "seconds": 0.1},
            }
        },
        "SharedKVPoolConnector": {
            "data": {"hits": 5, "loaded_blocks": 5, "bytes_in": 1311080}
        },
    }
    prom.observe(step)
    prom.observe({"SharedKVPoolConnector": {"data": {"load_failures": 2}}})

    def value(name):
        return registry.get_sample_value(name + "_total", LABELS)

    assert value("vllm:overlay_host_loaded_blocks") == 5
    assert value("vllm:overlay_host_loaded_bytes") == 1310720
    assert value("vllm:overlay_host_stored_blocks") == 3
    assert value("vllm:overlay_host_stored_bytes") == 786432
    assert value("vllm:overlay_pool_hits") == 5
    assert value("vllm:overlay_pool_loaded_blocks") == 5
    assert value("vllm:overlay_pool_bytes_in") == 1311080
    assert value("vllm:overlay_pool_load_failures") == 2
    assert value("vllm:overlay_pool_stored_blocks") == 0
