"""SharedKVPoolConnector: KV blocks in a Redis/Valkey pool shared by nodes.

Semantics of vLLM PR #16159, reworked: one value per block (all layers; with
cross-layer blocks the value is the block's bytes verbatim), a checked
header, content-addressed keys, I/O on background threads, recompute on any
failure.

* Keys: ``vkv:<namespace>:r<rank>:<chain hash>``.  The chain is vLLM's
  (``hash_block_tokens`` with the request's extra keys: LoRA, multimodal,
  cache salt) but rooted at a fixed seed, so it does not depend on
  ``PYTHONHASHSEED`` and two nodes agree on it.  The namespace hashes
  vLLM's model config hash (model, revision, quantization, dtype, the HF
  config after ``hf_overrides``), the KV cache dtype as configured, block
  size, attention backend and KV layout (cross-layer or not), TP/PP sizes,
  the hash algorithm, the LoRA config and the user's ``namespace``; each
  value's header also carries the writer's layout fingerprint, and with a
  shared secret a MAC.
* Swap-in: the scheduler counts the leading blocks present in the pool
  (one pipelined EXISTS on the pool's lookup thread; meanwhile the request
  is asked again next step, others run); the request waits while they load
  (others run) and its prefill skips them.  Values that fail the check are reported with
  ``get_block_ids_with_load_errors`` and vLLM recomputes those blocks.
* Swap-out: every block a request completes is copied to host memory after
  the step that wrote it and written in the background (EXISTS, then SET NX).

``kv_connector_extra_config``: ``url`` (redis://, rediss://, valkey://,
valkeys://, with user:password@), ``cluster`` (bool), ``namespace``,
``connect_timeout_s``, ``timeout_s``, ``lookup_wait_s``, ``max_inflight_bytes``,
``max_inflight_load_bytes``, ``ttl_s``, ``retry_backoff_s``,
``max_retry_backoff_s``, ``tls_ca_file``, ``secret_file``, ``secret_env``.

Like vLLM's own connectors, ``SharedKVPoolConnector`` is a thin
``KVConnectorBase_V1`` that delegates to ``connector_scheduler``
(``scheduler.py``: chains, lookups, what to load and store) or
``connector_worker`` (``worker.py``: block copies, background pool I/O),
whichever its role needs; ``common.py`` holds what both agree on (keys,
namespace, metadata, stats).  The scheduler's pool has a lookup thread
only; it probes the pool once in the background and warns at startup when
the pool cannot be reached.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from vllm_overlay.connectors.shared_pool.common import (
    PoolConnectorStats,
    PoolPromMetrics,
    namespace_tag,
    take_stats,
)
from vllm_overlay.connectors.shared_pool.scheduler import SharedPoolScheduler
from vllm_overlay.connectors.shared_pool.worker import SharedPoolWorker
from vllm_overlay.core.pool.config import PoolConfig
from vllm_overlay.core.pool.errors import require_dependencies
from vllm_overlay.core.pool.pool import KVPool

logger = logging.getLogger("vllm.overlay")


class SharedKVPoolConnector(KVConnectorBase_V1):
    prefer_cross_layer_blocks = True

    def __init__(
        self, vllm_config, role: KVConnectorRole, kv_cache_config=None
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        require_dependencies()  # one clear error now, not a dead thread later
        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        self.config = PoolConfig.from_dict(extra)
        self.ns = namespace_tag(vllm_config, self.config.namespace)
        scheduler = role == KVConnectorRole.SCHEDULER
        # Only the worker side moves values; the scheduler's pool has a
        # lookup thread only (the scheduler never waits on the network).
        self.pool = KVPool(self.config, io_threads=not scheduler, lookups=scheduler)
        logger.info(
            "vllm-overlay KV pool: %s%s, namespace %s (%s), values %s",
            self.config.redacted_url,
            " (cluster)" if self.config.cluster else "",
            self.ns.hex()[:12],
            self.config.namespace,
            "signed (shared secret)" if self.config.mac_key else "unsigned",
        )
        self.connector_scheduler: SharedPoolScheduler | None = None
        self.connector_worker: SharedPoolWorker | None = None
        if scheduler:
            self.connector_scheduler = SharedPoolScheduler(
                vllm_config, self.ns, self.pool
            )
            # One per engine: a pool that cannot be reached is reported now,
            # not on the first long prompt (background, never blocks).
            self.pool.probe()
        else:
            self.connector_worker = SharedPoolWorker(vllm_config, self.ns, self.pool)

    # ==============================
    # Scheduler-side methods
    # ==============================
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        assert self.connector_scheduler is not None
        return self.connector_scheduler.get_num_new_matched_tokens(
            request, num_computed_tokens
        )

    def update_state_after_alloc(
        self, request, blocks, num_external_tokens: int
    ) -> None:
        assert self.connector_scheduler is not None
        self.connector_scheduler.update_state_after_alloc(
            request, blocks, num_external_tokens
        )

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        assert self.connector_scheduler is not None
        return self.connector_scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output) -> None:
        assert self.connector_scheduler is not None
        self.connector_scheduler.update_connector_output(connector_output)

    def request_finished(self, request, block_ids):
        assert self.connector_scheduler is not None
        return self.connector_scheduler.request_finished(request, block_ids)

    def wait_for_remote_kv(self, timeout_s: float) -> bool:
        """Called by the engine (instead of stepping) while every request
        waits for its load: returns as soon as a load of this process's
        pool is done, after ``timeout_s`` at most (workers in other
        processes: the full timeout).  Never waits on the network."""
        return self.pool.wait_for_loads(timeout_s)

    # ==============================
    # Worker-side methods
    # ==============================
    def register_cross_layers_kv_cache(self, kv_cache, attn_backend, layout) -> None:
        assert self.connector_worker is not None
        self.connector_worker.register_cross_layers_kv_cache(kv_cache, layout)

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self.connector_worker is not None
        self._warn_if_behind_another_connector()
        self.connector_worker.register_kv_caches(kv_caches)

    def _warn_if_behind_another_connector(self) -> None:
        """Per-layer caches because the connector in front (vLLM's
        MultiConnector) does not ask for cross-layer blocks: the namespace
        cannot tell (the scheduler side never sees the layout), so say it."""
        from vllm.distributed.kv_transfer import (
            get_kv_transfer_group,
            has_kv_transfer_group,
        )

        if not has_kv_transfer_group():  # (built outside an engine)
            return
        front = get_kv_transfer_group()
        if front is self or getattr(front, "prefer_cross_layer_blocks", False):
            return
        logger.warning(
            "vllm-overlay KV pool: per-layer KV caches, because the KV "
            "connector in front (%s) does not ask for cross-layer blocks. "
            "Values of nodes running SharedKVPoolConnector alone (cross-layer "
            "blocks) have another layout: this node refuses them and they "
            "refuse its values (recomputed, never wrong). Give the two kinds "
            "of nodes different namespaces.",
            type(front).__name__,
        )

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        assert self.connector_worker is not None
        self.connector_worker.start_load_kv(self._get_connector_metadata())

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(
        self, layer_name: str, kv_layer, attn_metadata, **kwargs: Any
    ) -> None:
        return

    def wait_for_save(self) -> None:
        assert self.connector_worker is not None
        self.connector_worker.wait_for_save(self._get_connector_metadata())

    def get_finished(self, finished_req_ids: set[str]):
        assert self.connector_worker is not None
        return self.connector_worker.get_finished(finished_req_ids)

    def get_block_ids_with_load_errors(self) -> set[int]:
        assert self.connector_worker is not None
        return self.connector_worker.get_block_ids_with_load_errors()

    # ==============================
    # Both
    # ==============================
    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        worker = self.connector_worker
        return take_stats(self.pool, worker.take_refused() if worker else None)

    @classmethod
    def build_kv_connector_stats(
        cls, data: dict | None = None
    ) -> KVConnectorStats | None:
        return PoolConnectorStats(data=data or {})

    @classmethod
    def build_prom_metrics(
        cls, vllm_config, metric_types, labelnames, per_engine_labelvalues
    ) -> KVConnectorPromMetrics:
        return PoolPromMetrics(
            vllm_config, metric_types, labelnames, per_engine_labelvalues
        )

    def shutdown(self) -> None:
        self.pool.close()
