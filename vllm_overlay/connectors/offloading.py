"""Offloading KV blocks to host memory, one copy per block (vLLM adapter).

``OverlayOffloadingConnector`` is vLLM 0.11.2's ``OffloadingConnector``
(same scheduler side: LRU/ARC host pool, async loads and stores) that
prefers cross-layer blocks and moves blocks with ``BlockMover``: with the
cross-layer layout a block is one contiguous run, so one copy per block
(consecutive blocks merge into one) instead of 2 x num_layers.  Without it
(another connector in front, a non-uniform model, a backend without support)
the same handler moves the per-layer runs, with one Triton launch per
transfer on CUDA.

Unlike stock 0.11.2 it also runs on the CPU platform, pairs sub-blocks when
a device prefix hit is not aligned to the offloaded block size, handles a
kernel block size smaller than the cache block size, and loads nothing for
requests that skip the prefix cache (prompt logprobs).

``kv_connector_extra_config``:
  ``num_cpu_blocks`` (int) or ``cpu_bytes`` (int): host pool size, exactly
  one.  ``cpu_bytes`` is host memory for the KV of the whole model (all its
  layers; per tensor-parallel rank).  With pipeline parallelism it is split
  across the stages by their layers, like ``--enable-pp-prop-kv-cache``
  splits the device budget: the scheduler hands every stage the same host
  block ids, so every stage holds the same number of blocks, each of its
  own layers only.  The scheduler logs the blocks and each stage's bytes;
  ``block_size`` (tokens per offloaded block, a multiple of the cache block
  size; default the cache block size); ``eviction_policy`` (lru | arc);
  ``transfer_method`` (auto | dma | triton).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorRole,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
    OffloadingConnector,
    OffloadingConnectorScheduler,
    OffloadingConnectorWorker,
)
from vllm.v1.kv_offload.cpu import CPUOffloadingSpec
from vllm.v1.kv_offload.mediums import CPULoadStoreSpec, GPULoadStoreSpec
from vllm.v1.kv_offload.spec import OffloadingSpec
from vllm.v1.kv_offload.worker.worker import OffloadingHandler

from vllm_overlay.core.offload.host_copy import TransferStats
from vllm_overlay.core.offload.mapping import pair_sub_blocks
from vllm_overlay.core.offload.mover import METHODS, BlockMover
from vllm_overlay.core.ops.block_copy import BlockTable
from vllm_overlay.integration.kv_tables import cross_layer_table, per_layer_table
from vllm_overlay.integration.model_kv import host_pool_size

logger = logging.getLogger("vllm.overlay")

KEYS = {
    "num_cpu_blocks",
    "cpu_bytes",
    "block_size",
    "eviction_policy",
    "transfer_method",
    "spec_name",
    "spec_module_path",
}


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(
            f"kv_connector_extra_config['{name}'] must be a "
            f"positive integer, got {value!r}"
        )
    return value


class OverlayCPUOffloadingSpec(CPUOffloadingSpec):
    """CPUOffloadingSpec with validated options, a host size in bytes, and
    handlers that work on CUDA and CPU, per-layer or cross-layer."""

    def __init__(self, vllm_config) -> None:
        extra = dict(vllm_config.kv_transfer_config.kv_connector_extra_config or {})
        unknown = set(extra) - KEYS
        if unknown:
            raise ValueError(
                f"unknown kv_connector_extra_config keys "
                f"{sorted(unknown)}; known: {sorted(KEYS)}"
            )
        gpu_block = vllm_config.cache_config.block_size
        block_size = _positive_int("block_size", extra.get("block_size", gpu_block))
        if block_size % gpu_block:
            raise ValueError(
                f"offloaded block_size {block_size} must be a "
                f"multiple of the KV cache block size {gpu_block}"
            )
        if ("num_cpu_blocks" in extra) == ("cpu_bytes" in extra):
            raise ValueError(
                "set exactly one of num_cpu_blocks and cpu_bytes "
                "in kv_connector_extra_config"
            )
        if "cpu_bytes" in extra:
            # The whole model's layers, never this process's stage: every
            # stage and the scheduler must agree on the number of blocks.
            self.host_pool = host_pool_size(
                vllm_config,
                block_size,
                cpu_bytes=_positive_int("cpu_bytes", extra.pop("cpu_bytes")),
            )
            extra["num_cpu_blocks"] = self.host_pool.blocks
        else:
            self.host_pool = host_pool_size(
                vllm_config,
                block_size,
                num_blocks=_positive_int("num_cpu_blocks", extra["num_cpu_blocks"]),
            )
        self.transfer_method = extra.pop("transfer_method", "auto")
        if self.transfer_method not in METHODS:
            raise ValueError(
                f"transfer_method {self.transfer_method!r}: "
                f"expected one of {', '.join(METHODS)}"
            )
        if extra.get("eviction_policy", "lru") not in ("lru", "arc"):
            raise ValueError(
                f"eviction_policy {extra['eviction_policy']!r}: expected lru or arc"
            )
        # CPUOffloadingSpec.__init__ would demand num_cpu_blocks in the
        # config; set its fields from the validated values instead.
        OffloadingSpec.__init__(self, vllm_config)
        self.num_cpu_blocks: int = extra["num_cpu_blocks"]
        self.eviction_policy: str = extra.get("eviction_policy", "lru")
        self._manager = None
        self._handler = None
        self.factor = self.offloaded_block_size // self.gpu_block_size

    # worker side ---------------------------------------------------------
    def make_handler(self, table: BlockTable, what: str) -> BlockMoverHandler:
        handler = BlockMoverHandler(
            table, self.num_cpu_blocks * self.factor, self.factor, self.transfer_method
        )
        stage, stages = _pp_stage()
        logger.info(
            "vllm-overlay offloading: %s, %d B per block in %d run(s), host "
            "pool %d blocks of %d tokens (%.1f MiB)%s, copies by %s",
            what,
            table.block_bytes,
            table.runs_per_block,
            self.num_cpu_blocks,
            self.offloaded_block_size,
            handler.mover.host_bytes / 2**20,
            f" on PP stage {stage} of {stages}" if stages > 1 else "",
            handler.mover.method,
        )
        share = self.host_pool.stage_bytes[stage] if self.host_pool.cpu_bytes else 0
        if share and handler.mover.host_bytes > share:
            logger.warning(
                "vllm-overlay offloading: the host pool of PP stage %d takes "
                "%d B, more than its share of cpu_bytes (%d B): its KV blocks "
                "are larger than the model config says",
                stage,
                handler.mover.host_bytes,
                share,
            )
        return handler

    def get_handlers(self, kv_caches: dict[str, torch.Tensor]):
        """Per-layer caches (stock layout)."""
        handler = self.make_handler(
            per_layer_table(self.vllm_config, kv_caches),
            f"{len(kv_caches)} per-layer caches",
        )
        yield GPULoadStoreSpec, CPULoadStoreSpec, handler
        yield CPULoadStoreSpec, GPULoadStoreSpec, handler

    def get_cross_layer_handlers(self, kv_cache: torch.Tensor, layout):
        handler = self.make_handler(
            cross_layer_table(kv_cache, layout),
            f"cross-layer buffer ({layout.num_layers} layers)",
        )
        yield GPULoadStoreSpec, CPULoadStoreSpec, handler
        yield CPULoadStoreSpec, GPULoadStoreSpec, handler


def _pp_stage() -> tuple[int, int]:
    """(this worker's pipeline stage, stages); (0, 1) outside a worker."""
    from vllm.distributed.parallel_state import get_pp_group

    try:
        group = get_pp_group()
    except AssertionError:  # no distributed state (unit tests)
        return 0, 1
    return group.rank_in_group, group.world_size


class BlockMoverHandler(OffloadingHandler):
    """vLLM's OffloadingHandler over a BlockMover (device <-> host pool)."""

    def __init__(
        self, table: BlockTable, num_host_blocks: int, factor: int, method: str
    ) -> None:
        self.mover = BlockMover(table, num_host_blocks, method)
        self.factor = factor
        self.totals = {"store": TransferStats(), "load": TransferStats()}

    def transfer_async(self, job_id: int, spec) -> bool:
        src, dst = spec
        to_host = isinstance(src, GPULoadStoreSpec)
        if to_host:
            device, host = pair_sub_blocks(src.block_ids, 1, dst.block_ids, self.factor)
        else:
            host, device = pair_sub_blocks(src.block_ids, self.factor, dst.block_ids, 1)
        self.mover.submit(
            job_id,
            torch.from_numpy(np.ascontiguousarray(device)),
            torch.from_numpy(np.ascontiguousarray(host)),
            to_host,
        )
        return True

    def get_finished(self):
        return [(job_id, True) for job_id in self.mover.poll()]

    def cumulative(self) -> dict[str, dict]:
        """Totals since start, without taking the interval's stats away
        from vLLM's stats reporting."""
        out = {}
        for direction, total in self.totals.items():
            both = TransferStats()
            both.add(total)
            both.add(self.mover.stats[direction])
            out[direction] = both.as_dict()
        return out

    def take_stats(self) -> dict[str, dict]:
        stats = self.mover.take_stats()
        for direction, value in stats.items():
            self.totals[direction].add(value)
        return {d: s.as_dict() for d, s in stats.items() if s.jobs}


@dataclasses.dataclass
class OffloadStats(KVConnectorStats):
    """Blocks, bytes and copy calls moved per direction, and GB/s."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for direction, values in other.data.items():
            mine = self.data.setdefault(direction, {})
            for key, value in values.items():
                if key != "gb_per_s":
                    mine[key] = mine.get(key, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {}
        for direction, v in self.data.items():
            out[f"{direction}_blocks"] = v.get("blocks", 0)
            out[f"{direction}_MiB"] = round(v.get("bytes", 0) / 2**20, 2)
            out[f"{direction}_copy_calls"] = v.get("copy_calls", 0)
            seconds = v.get("seconds", 0.0)
            out[f"{direction}_GB_per_s"] = (
                round(v.get("bytes", 0) / seconds / 1e9, 2) if seconds else 0.0
            )
        return out

    def is_empty(self) -> bool:
        return not any(v.get("jobs") for v in self.data.values())


class CounterPromMetrics(KVConnectorPromMetrics):
    """Prometheus counters of a connector's stats: ``COUNTERS`` maps each
    counter's name to its help text and its increment, taken from one
    interval's stats data.  vLLM 0.11.2's MultiConnector requires Prometheus
    metrics of every connector that reports stats: without them the API
    server's first stats record fails."""

    COUNTERS: dict[str, tuple[str, Callable[[dict], float]]] = {}

    def __init__(
        self, vllm_config, metric_types, labelnames, per_engine_labelvalues
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.counters = {
            name: self.make_per_engine(
                self._counter_cls(name=name, documentation=doc, labelnames=labelnames)
            )
            for name, (doc, _) in self.COUNTERS.items()
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0):
        for name, (_, increment) in self.COUNTERS.items():
            value = increment(transfer_stats_data)
            if value > 0:
                self.counters[name][engine_idx].inc(value)


def _moved(direction: str, what: str) -> Callable[[dict], float]:
    return lambda data: data.get(direction, {}).get(what, 0)


class OffloadPromMetrics(CounterPromMetrics):
    COUNTERS = {
        f"vllm:overlay_host_{verb}_{what}": (
            f"KV {what} {verb} {'to' if direction == 'store' else 'from'} "
            "host memory by OverlayOffloadingConnector",
            _moved(direction, what),
        )
        for direction, verb in (("load", "loaded"), ("store", "stored"))
        for what in ("blocks", "bytes")
    }


class _Scheduler(OffloadingConnectorScheduler):
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        # A request that must not read cached KV (prompt logprobs: vLLM
        # skips its device prefix cache) must not load it either, or the
        # loaded positions get no prompt logprobs.  Stock 0.11.2 loads.
        if getattr(request, "skip_reading_prefix_cache", False):
            return 0, False
        return super().get_num_new_matched_tokens(request, num_computed_tokens)


class _Worker(OffloadingConnectorWorker):
    def register_cross_layers_kv_cache(self, kv_cache, layout) -> None:
        for src_cls, dst_cls, handler in self.spec.get_cross_layer_handlers(
            kv_cache, layout
        ):
            self.worker.register_handler(src_cls, dst_cls, handler)

    @property
    def handler(self) -> BlockMoverHandler | None:
        return next(iter(self.worker.handlers), None)


class OverlayOffloadingConnector(OffloadingConnector):
    prefer_cross_layer_blocks = True

    def __init__(
        self, vllm_config, role: KVConnectorRole, kv_cache_config=None
    ) -> None:
        # Stock __init__ builds its spec from the factory; ours is fixed.
        KVConnectorBase_V1.__init__(self, vllm_config, role, kv_cache_config)
        spec = OverlayCPUOffloadingSpec(vllm_config)
        self.connector_scheduler = None
        self.connector_worker = None
        if role == KVConnectorRole.SCHEDULER:
            logger.info(
                "vllm-overlay offloading: host pool %s", spec.host_pool.describe()
            )
            self.connector_scheduler = _Scheduler(spec)
        elif role == KVConnectorRole.WORKER:
            self.connector_worker = _Worker(spec)

    def register_cross_layers_kv_cache(self, kv_cache, attn_backend, layout) -> None:
        assert self.connector_worker is not None
        self.connector_worker.register_cross_layers_kv_cache(kv_cache, layout)

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        if self.connector_worker is None or self.connector_worker.handler is None:
            return None
        data = self.connector_worker.handler.take_stats()
        return OffloadStats(data=data) if data else None

    @classmethod
    def build_kv_connector_stats(
        cls, data: dict | None = None
    ) -> KVConnectorStats | None:
        return OffloadStats(data=data or {})

    @classmethod
    def build_prom_metrics(
        cls, vllm_config, metric_types, labelnames, per_engine_labelvalues
    ) -> KVConnectorPromMetrics:
        return OffloadPromMetrics(
            vllm_config, metric_types, labelnames, per_engine_labelvalues
        )
