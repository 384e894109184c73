"""SharedKVPoolConnector: KV blocks in a Redis/Valkey pool shared by nodes.

Semantics of vLLM PR #16159, reworked: one value per block (all layers; with
cross-layer blocks the value is the block's bytes verbatim), a checked
header, content-addressed keys, I/O on background threads, recompute on any
failure.

* Keys: ``vkv:<namespace>:r<rank>:<chain hash>``.  The chain is vLLM's
  (``hash_block_tokens`` with the request's extra keys: LoRA, multimodal,
  cache salt) but rooted at a fixed seed, so it does not depend on
  ``PYTHONHASHSEED`` and two nodes agree on it.  The namespace hashes the
  model, dtypes, block size, attention backend and KV layout, TP/PP sizes,
  the hash algorithm and the user's ``namespace``.
* Swap-in: the scheduler counts the leading blocks present in the pool
  (one pipelined EXISTS); the request waits while they load (others run)
  and its prefill skips them.  Values that fail the check are reported with
  ``get_block_ids_with_load_errors`` and vLLM recomputes those blocks.
* Swap-out: every block a request completes is copied to host memory after
  the step that wrote it and written in the background (EXISTS, then SET NX).

``kv_connector_extra_config``: ``url`` (redis://, rediss://, valkey://,
valkeys://, with user:password@), ``cluster`` (bool), ``namespace``,
``connect_timeout_s``, ``timeout_s``, ``max_inflight_bytes``, ``ttl_s``,
``retry_backoff_s``, ``max_retry_backoff_s``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import time
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import \
    KVConnectorStats

from vllm_overlay.integration.kv_tables import cross_layer_table, per_layer_table
from vllm_overlay.core.ops.block_copy import gather, scatter
from vllm_overlay.core.pool import codec
from vllm_overlay.core.pool.config import PoolConfig
from vllm_overlay.core.pool.pool import KVPool

logger = logging.getLogger("vllm.overlay")

CHAIN_ROOT = b"vllm-overlay shared KV pool chain root v1"
REFUSED_TTL_S = 300.0  # a refused value is not looked up again for this long


def layout_descriptor(vllm_config) -> str:
    """What decides the bytes of a block, computable in every process."""
    from vllm.attention.selector import get_attn_backend
    from vllm.v1.attention.backends.utils import get_kv_cache_layout

    model, cache = vllm_config.model_config, vllm_config.cache_config
    backend = get_attn_backend(model.get_head_size(), model.dtype,
                               cache.cache_dtype, cache.block_size,
                               use_mla=model.use_mla)
    try:
        order = tuple(backend.get_kv_cache_stride_order(
            include_num_layers_dimension=True))
    except (AttributeError, NotImplementedError, TypeError):
        order = None
    return f"{backend.get_name()}/{get_kv_cache_layout()}/layers-order={order}"


def namespace_tag(vllm_config, user_namespace: str) -> bytes:
    model, cache = vllm_config.model_config, vllm_config.cache_config
    parallel = vllm_config.parallel_config
    descriptor = "|".join(map(str, (
        "vllm-overlay-kv-pool/1", model.model, model.dtype, cache.cache_dtype,
        cache.block_size, layout_descriptor(vllm_config),
        parallel.tensor_parallel_size, parallel.pipeline_parallel_size,
        cache.prefix_caching_hash_algo, user_namespace)))
    return hashlib.blake2b(descriptor.encode(), digest_size=16).digest()


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
        out = {k: d.get(k, 0) for k in ("hits", "misses", "loaded_blocks",
                                        "load_failures", "stored_blocks",
                                        "dropped_stores", "errors")}
        out["MiB_in"] = round(d.get("bytes_in", 0) / 2**20, 2)
        out["MiB_out"] = round(d.get("bytes_out", 0) / 2**20, 2)
        for way in ("in", "out"):
            secs = d.get(f"io_seconds_{way}", 0.0)
            out[f"GB_per_s_{way}"] = round(
                d.get(f"bytes_{way}", 0) / secs / 1e9, 3) if secs else 0.0
        return out

    def is_empty(self) -> bool:
        return not any(v for k, v in self.data.items()
                       if not k.startswith(("gb_per_s", "io_seconds")))


class SharedKVPoolConnector(KVConnectorBase_V1):
    prefer_cross_layer_blocks = True

    def __init__(self, vllm_config, role: KVConnectorRole,
                 kv_cache_config=None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        self.config = PoolConfig.from_dict(extra)
        cache = vllm_config.cache_config
        self.block_size = cache.block_size
        self.world_size = vllm_config.parallel_config.world_size
        self.ns = namespace_tag(vllm_config, self.config.namespace)
        self.pool = KVPool(self.config)
        logger.info("vllm-overlay KV pool: %s%s, namespace %s (%s)",
                    self.config.redacted_url,
                    " (cluster)" if self.config.cluster else "",
                    self.ns.hex()[:12], self.config.namespace)
        # scheduler side
        from vllm.utils.hashing import get_hash_fn_by_name

        self._hash_fn = get_hash_fn_by_name(cache.prefix_caching_hash_algo)
        self._chains: dict[str, list[bytes]] = {}
        self._requests: dict[str, Any] = {}
        self._block_ids: dict[str, list[int]] = {}
        self._next_store: dict[str, int] = {}
        self._lookups: dict[str, tuple[int, int]] = {}  # req -> (start, hits)
        self._loads: dict[str, tuple[list[int], list[bytes]]] = {}
        self._storing: set[str] = set()
        self._loading: dict[str, tuple[list[int], list[bytes]]] = {}
        self._refused: dict[bytes, float] = {}  # chain hash -> when
        self._load_start: dict[str, int] = {}
        # worker side
        self._table = None
        self._rank = 0
        self._jobs: dict[str, tuple[list[int], list[bytes]]] = {}
        self._pending_copies: dict[str, list] = {}  # req -> staged stores
        self._stored_reqs: set[str] = set()
        self._waiting_finish: set[str] = set()
        self._load_errors: set[int] = set()

    def key(self, chain_hash: bytes, rank: int) -> bytes:
        return b"vkv:%s:r%d:%s" % (self.ns.hex().encode(), rank,
                                   chain_hash.hex().encode())

    # ==============================
    # Scheduler-side methods
    # ==============================
    def _chain(self, request) -> list[bytes]:
        from vllm.v1.core.kv_cache_utils import (
            generate_block_hash_extra_keys, hash_block_tokens)

        chain = self._chains.setdefault(request.request_id, [])
        tokens = request.all_token_ids
        mm_idx = 0
        while (len(chain) + 1) * self.block_size <= len(tokens):
            start = len(chain) * self.block_size
            end = start + self.block_size
            extra, mm_idx = generate_block_hash_extra_keys(request, start, end,
                                                           mm_idx)
            parent = chain[-1] if chain else self._hash_fn(CHAIN_ROOT)
            chain.append(bytes(hash_block_tokens(self._hash_fn, parent,
                                                 tokens[start:end], extra)))
        return chain

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        if getattr(request, "skip_reading_prefix_cache", False):
            return 0, False  # e.g. prompt logprobs: every position computed
        chain = self._chain(request)
        start = num_computed_tokens // self.block_size
        # Leave at least one token to compute.
        last = min(len(chain), (request.num_tokens - 1) // self.block_size)
        if last <= start:
            return 0, False
        hits = last - start
        # Stop before a block whose value was refused recently.
        now = time.monotonic()
        for i, h in enumerate(chain[start:last]):
            when = self._refused.get(h)
            if when is not None and now - when < REFUSED_TTL_S:
                hits = i
                break
        if hits == 0:
            return 0, False
        for rank in range(self.world_size):
            hits = min(hits, self.pool.count_hits(
                [self.key(h, rank) for h in chain[start:start + hits]]))
            if hits == 0:
                return 0, False
        self._lookups[request.request_id] = (start, hits)
        return hits * self.block_size, True

    def update_state_after_alloc(self, request, blocks,
                                 num_external_tokens: int) -> None:
        req_id = request.request_id
        self._requests[req_id] = request
        block_ids = list(blocks.get_block_ids()[0])
        start, hits = self._lookups.pop(req_id, (0, 0))
        if num_external_tokens:
            n = num_external_tokens // self.block_size
            assert n == hits, (n, hits)
            chain = self._chains[req_id]
            self._loads[req_id] = (block_ids[-n:], chain[start:start + n])
            self._load_start[req_id] = start
        # Called again when a loaded request is scheduled: keep the mark.
        self._next_store[req_id] = max(self._next_store.get(req_id, 0),
                                       start + hits)

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector \
            import yield_req_data

        stores = {}
        for req_id, new_ids, preempted in yield_req_data(scheduler_output):
            if req_id not in self._requests:
                continue
            ids = self._block_ids.setdefault(req_id, [])
            if preempted:
                ids.clear()
            if new_ids:
                ids.extend(new_ids[0])
            request = self._requests[req_id]
            done = (request.num_computed_tokens
                    + scheduler_output.num_scheduled_tokens.get(req_id, 0))
            chain = self._chain(request)
            full = min(done // self.block_size, len(chain), len(ids))
            first = self._next_store.get(req_id, 0)
            if full > first:
                stores[req_id] = (ids[first:full], chain[first:full])
                self._next_store[req_id] = full
                self._storing.add(req_id)
        meta = PoolMetadata(loads=self._loads, stores=stores)
        self._loading.update(self._loads)
        self._loads = {}
        return meta

    def update_connector_output(self, connector_output) -> None:
        for req_id in connector_output.finished_sending or ():
            self._storing.discard(req_id)
        invalid = connector_output.invalid_block_ids or set()
        now = time.monotonic()
        for req_id in connector_output.finished_recving or ():
            block_ids, chain = self._loading.pop(req_id, ((), ()))
            start = self._load_start.pop(req_id, 0)
            for i, (block_id, h) in enumerate(zip(block_ids, chain)):
                if block_id in invalid:  # never look it up again (for a while)
                    self._refused[h] = now
                    if req_id in self._next_store:  # store it once recomputed
                        self._next_store[req_id] = min(
                            self._next_store[req_id], start + i)
        if len(self._refused) > 100_000:
            self._refused = {h: t for h, t in self._refused.items()
                             if now - t < REFUSED_TTL_S}

    def request_finished(self, request, block_ids):
        req_id = request.request_id
        for table in (self._chains, self._requests, self._block_ids,
                      self._next_store, self._lookups, self._load_start):
            table.pop(req_id, None)
        return req_id in self._storing, None

    # ==============================
    # Worker-side methods
    # ==============================
    def _set_table(self, table, what: str) -> None:
        from vllm.distributed import get_world_group

        self._table = table
        self._rank = get_world_group().rank if self.world_size > 1 else 0
        logger.info("vllm-overlay KV pool: %s, one value of %d B per block "
                    "(%d run(s) gathered), rank %d", what, table.block_bytes,
                    table.runs_per_block, self._rank)

    def register_cross_layers_kv_cache(self, kv_cache, attn_backend,
                                       layout) -> None:
        self._set_table(cross_layer_table(kv_cache, layout),
                        f"cross-layer buffer ({layout.num_layers} layers)")

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._set_table(per_layer_table(self._vllm_config, kv_caches),
                        f"{len(kv_caches)} per-layer caches")

    def _method(self) -> str:
        return "triton" if self._table.device.type == "cuda" else "dma"

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        for req_id, (block_ids, chain) in meta.loads.items():
            self._jobs[req_id] = (block_ids, chain)
            self.pool.submit_load(req_id, [self.key(h, self._rank)
                                           for h in chain])

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata,
                      **kwargs: Any) -> None:
        return

    def wait_for_save(self) -> None:
        """Copy the blocks completed in this step to host memory; the
        network write happens in the background."""
        meta = self._get_connector_metadata()
        for req_id, (block_ids, chain) in meta.stores.items():
            ids = torch.tensor(block_ids, dtype=torch.int64)
            staging = torch.empty(len(block_ids), self._table.block_bytes,
                                  dtype=torch.uint8,
                                  pin_memory=self._table.device.type == "cuda")
            event = None
            if self._table.device.type == "cuda":
                stream = torch.cuda.current_stream()
                gather(self._table, ids, staging, self._method())
                event = torch.cuda.Event()
                event.record(stream)
            else:
                gather(self._table, ids, staging, "dma")
            self._pending_copies.setdefault(req_id, []).append(
                (event, staging, chain))
            self._stored_reqs.add(req_id)

    def _flush_copies(self) -> None:
        for req_id, copies in list(self._pending_copies.items()):
            keep = []
            for event, staging, chain in copies:
                if event is not None and not event.query():
                    keep.append((event, staging, chain))
                    continue
                items = []
                for row, h in zip(staging, chain):
                    key = self.key(h, self._rank)
                    items.append((key, codec.encode(self.ns, key,
                                                    row.numpy().data)))
                self.pool.submit_store(items)
            if keep:
                self._pending_copies[req_id] = keep
            else:
                del self._pending_copies[req_id]

    def _finish_loads(self) -> set[str]:
        done = set()
        for req_id, values in self.pool.poll_loads():
            block_ids, chain = self._jobs.pop(req_id)
            good_ids, good_rows, failed, refused = [], [], 0, []
            for block_id, h, value in zip(block_ids, chain, values):
                try:
                    if value is None:
                        raise codec.BadValue("missing")
                    payload = codec.decode(self.ns, self.key(h, self._rank),
                                           value, self._table.block_bytes)
                except codec.BadValue as exc:
                    failed += 1
                    self._load_errors.add(block_id)
                    if value is not None:
                        refused.append(self.key(h, self._rank))
                        logger.warning("vllm-overlay KV pool: block %s "
                                       "refused (%s); recomputing",
                                       h.hex()[:12], exc)
                    continue
                good_ids.append(block_id)
                good_rows.append(torch.frombuffer(payload, dtype=torch.uint8))
            if good_ids:
                packed = torch.stack(good_rows)
                if self._table.device.type == "cuda":
                    packed = packed.pin_memory()
                scatter(self._table, torch.tensor(good_ids, dtype=torch.int64),
                        packed, self._method())
                if self._table.device.type == "cuda":
                    torch.cuda.current_stream().synchronize()
            self.pool.record_load(len(good_ids), failed)
            if refused:  # a bad value is never loaded again, by any node
                self.pool.submit_delete(refused)
            done.add(req_id)
        return done

    def get_finished(self, finished_req_ids: set[str]):
        self._flush_copies()
        finished_recving = self._finish_loads()
        finished_sending = set()
        for req_id in finished_req_ids:
            if req_id in self._stored_reqs and \
                    req_id not in self._pending_copies:
                self._stored_reqs.discard(req_id)
                finished_sending.add(req_id)
            elif req_id in self._stored_reqs:
                self._waiting_finish.add(req_id)
        for req_id in list(self._waiting_finish):
            if req_id not in self._pending_copies:
                self._waiting_finish.discard(req_id)
                self._stored_reqs.discard(req_id)
                finished_sending.add(req_id)
        return finished_sending or None, finished_recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        stats = self.pool.take_stats().as_dict()
        data = {k: v for k, v in stats.items() if v}
        return PoolConnectorStats(data=data) if data else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict | None = None
                                 ) -> KVConnectorStats | None:
        return PoolConnectorStats(data=data or {})

    def shutdown(self) -> None:
        self.pool.close()
