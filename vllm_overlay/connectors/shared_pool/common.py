"""What both roles of the shared pool connector agree on: the namespace,
the keys, the metadata the scheduler hands the workers, and the stats."""

from __future__ import annotations

import dataclasses
import hashlib

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats


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
    return f"{backend.get_name()}/{get_kv_cache_layout()}/layers-order={order}"


def namespace_tag(vllm_config, user_namespace: str) -> bytes:
    model, cache = vllm_config.model_config, vllm_config.cache_config
    parallel = vllm_config.parallel_config
    descriptor = "|".join(
        map(
            str,
            (
                "vllm-overlay-kv-pool/1",
                model.model,
                model.dtype,
                cache.cache_dtype,
                cache.block_size,
                layout_descriptor(vllm_config),
                parallel.tensor_parallel_size,
                parallel.pipeline_parallel_size,
                cache.prefix_caching_hash_algo,
                user_namespace,
            ),
        )
    )
    return hashlib.blake2b(descriptor.encode(), digest_size=16).digest()


def pool_key(ns: bytes, chain_hash: bytes, rank: int) -> bytes:
    return b"vkv:%s:r%d:%s" % (ns.hex().encode(), rank, chain_hash.hex().encode())


@dataclasses.dataclass
class PoolMetadata(KVConnectorMetadata):
    # req id -> (block ids, chain hashes)
    loads: dict[str, tuple[list[int], list[bytes]]]
    stores: dict[str, tuple[list[int], list[bytes]]]


@dataclasses.dataclass
class PoolConnectorStats(KVConnectorStats):
    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for key, value in other.data.items():
            if not key.startswith("gb_per_s"):
                self.data[key] = self.data.get(key, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        d = self.data
        out = {
            k: d.get(k, 0)
            for k in (
                "hits",
                "misses",
                "loaded_blocks",
                "load_failures",
                "stored_blocks",
                "dropped_stores",
                "errors",
            )
        }
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
            if not k.startswith(("gb_per_s", "io_seconds"))
        )


def take_stats(pool) -> PoolConnectorStats | None:
    stats = pool.take_stats().as_dict()
    data = {k: v for k, v in stats.items() if v}
    return PoolConnectorStats(data=data) if data else None
