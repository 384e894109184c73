"""What both roles of the shared pool connector agree on: the namespace,
the keys, the metadata the scheduler hands the workers, and the stats."""

from __future__ import annotations

import dataclasses

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from vllm_overlay.connectors.offloading import (  # noqa: E501
    CounterPromMetrics,
)
from vllm_overlay.core.pool import keys


def cross_layer_expected() -> bool:
    """Whether this node's workers may register cross-layer blocks (the
    connector prefers them).  Both roles of a node answer the same."""
    # runtime only: begin (patches/generate.py drops these lines: in vLLM's
    # tree the cross-layer layout cannot be switched off by environment)
    from vllm_overlay import envs

    if not envs.cross_layer_patches_on():  # noqa: SIM103 (upstream: True only)
        return False
    # runtime only: end
    return True


def layout_descriptor(vllm_config) -> str:
    """What decides the bytes of a block, computable in every process."""
    from vllm.attention.selector import get_attn_backend
    from vllm.v1.attention.backends.utils import get_kv_cache_layout

    model, cache = vllm_config.model_config, vllm_config.cache_config
    backend = get_attn_backend(
        model.get_head_size(),
        model.dtype,
        cache.cache_dtype,
        cache.block_size,
        use_mla=model.use_mla,
    )
    try:
        order = tuple(
            backend.get_kv_cache_stride_order(include_num_layers_dimension=True)
        )
    except (AttributeError, NotImplementedError, TypeError):
        order = None
    cross = "on" if cross_layer_expected() and order is not None else "off"
    return (
        f"{backend.get_name()}/{get_kv_cache_layout()}/layers-order={order}"
        f"/cross-layer={cross}"
    )


def namespace_factors(vllm_config, user_namespace: str) -> list[str]:
    """Everything that decides the bytes of a block, as stable strings.

    vLLM's ``ModelConfig.compute_hash()`` covers the model, revision,
    code revision, quantization, dtype and the HF config after
    ``hf_overrides`` (rope scaling) - and also max_model_len and a few
    other fields that do not change KV bytes, so nodes share only when
    they run the same model config.  ``CacheConfig.compute_hash()`` covers
    the KV cache dtype as configured.  Neither covers the block size, the
    attention backend and layout, TP/PP or the prefix hash algorithm:
    those are added here, with the LoRA config and the user's namespace.
    (tests/unit/test_pool_namespace.py checks which fields each covers.)
    """
    model, cache = vllm_config.model_config, vllm_config.cache_config
    parallel = vllm_config.parallel_config
    lora = getattr(vllm_config, "lora_config", None)
    return [
        "vllm-shared-kv-pool/4",  # /4: value format 3 (XXH3)
        f"model-hash={model.compute_hash()}",
        f"model={model.model}@{model.revision}",
        f"quantization={model.quantization}",
        f"dtype={model.dtype}",
        f"cache-hash={cache.compute_hash()}",
        f"cache-dtype={cache.cache_dtype}",
        f"block-size={cache.block_size}",
        f"layout={layout_descriptor(vllm_config)}",
        f"tp={parallel.tensor_parallel_size}",
        f"pp={parallel.pipeline_parallel_size}",
        f"hash-algo={cache.prefix_caching_hash_algo}",
        f"lora={lora.compute_hash() if lora is not None else None}",
        f"namespace={user_namespace}",
    ]


def namespace_tag(vllm_config, user_namespace: str) -> bytes:
    return keys.namespace_tag(namespace_factors(vllm_config, user_namespace))


def table_layout_tag(kind: str, table, extra: str = "") -> bytes:
    """The value header's layout fingerprint, from what the worker actually
    registered: cross-layer or per-layer, and the block's byte layout."""
    from vllm_overlay.core.pool import codec

    return codec.layout_tag(
        f"{kind}|block-bytes={table.block_bytes}|runs={table.runs_per_block}|{extra}"
    )


@dataclasses.dataclass
class PoolMetadata(KVConnectorMetadata):
    # req id -> (block ids, chain hashes)
    loads: dict[str, tuple[list[int], list[bytes]]]
    stores: dict[str, tuple[list[int], list[bytes]]]


# In the stats a worker hands the scheduler each step (not a metric): the
# block ids whose value this step's loads refused by its check.
REFUSED_KEY = "refused_block_ids"


# The stats' counts (per interval), in the log line and as Prometheus
# counters ``vllm:overlay_pool_<count>`` (bytes_in and bytes_out too).
COUNTS = (
    "hits",
    "misses",
    "lookups_skipped",
    "lookup_timeouts",
    "loaded_blocks",
    "load_failures",
    "stored_blocks",
    "dropped_stores",
    "limited_loads",
    "bad_signatures",
    "bad_keys",
    "errors",
    "internal_errors",
    "load_timeouts",
    "stuck",
)


class PoolPromMetrics(CounterPromMetrics):
    COUNTERS = {
        f"vllm:overlay_pool_{count}": (
            f"SharedKVPoolConnector: {count.replace('_', ' ')}",
            lambda data, count=count: data.get(count, 0),
        )
        for count in (*COUNTS, "bytes_in", "bytes_out")
    }


@dataclasses.dataclass
class PoolConnectorStats(KVConnectorStats):
    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for key, value in other.data.items():
            if key == REFUSED_KEY:
                self.data[key] = [*self.data.get(key, ()), *value]
            elif not key.startswith("gb_per_s"):
                self.data[key] = self.data.get(key, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        d = self.data
        out = {k: d.get(k, 0) for k in COUNTS}
        out["MiB_in"] = round(d.get("bytes_in", 0) / 2**20, 2)
        out["MiB_out"] = round(d.get("bytes_out", 0) / 2**20, 2)
        for way in ("in", "out"):
            secs = d.get(f"io_seconds_{way}", 0.0)
            out[f"GB_per_s_{way}"] = (
                round(d.get(f"bytes_{way}", 0) / secs / 1e9, 3) if secs else 0.0
            )
        return out

    def is_empty(self) -> bool:
        return not any(
            v
            for k, v in self.data.items()
            if not k.startswith(("gb_per_s", "io_seconds", REFUSED_KEY))
        )


def take_stats(pool, refused: list[int] | None = None) -> PoolConnectorStats | None:
    stats = pool.take_stats().as_dict()
    data = {k: v for k, v in stats.items() if v}
    if refused:
        data[REFUSED_KEY] = refused
    return PoolConnectorStats(data=data) if data else None


def take_refused(connector_output) -> set[int]:
    """The refused block ids a step's stats carry, removed from them (they
    are not a metric)."""
    stats = getattr(connector_output, "kv_connector_stats", None)
    data = getattr(stats, "data", None)
    if not isinstance(data, dict):
        return set()
    if REFUSED_KEY not in data:
        # Under vLLM's MultiConnector: one entry per connector class.
        nested = data.get("SharedKVPoolConnector")
        data = getattr(nested, "data", None)
        if not isinstance(data, dict):
            return set()
    return set(data.pop(REFUSED_KEY, ()))
