"""Worker side of the shared pool connector: copies blocks between the KV
cache and host memory and hands the network I/O to the pool's background
threads (store and load)."""

from __future__ import annotations

import dataclasses
import functools
import logging
import time

import numpy
import torch

from vllm_overlay.connectors.shared_pool.common import (
    PoolMetadata,
    pool_key,
    table_layout_tag,
)
from vllm_overlay.core.ops.block_copy import gather, scatter
from vllm_overlay.core.pool import codec
from vllm_overlay.integration.kv_tables import cross_layer_table, per_layer_table

logger = logging.getLogger("vllm.overlay")


@dataclasses.dataclass
class _ReadyLoad:
    """A load, checked and packed on the pool's load thread."""

    good_ids: list[int] = dataclasses.field(default_factory=list)
    packed: torch.Tensor | None = None  # one row per good block
    failed_ids: list[int] = dataclasses.field(default_factory=list)
    delete_keys: list[bytes] = dataclasses.field(default_factory=list)
    refusals: list = dataclasses.field(default_factory=list)  # (key, BadValue)
    bad_signatures: int = 0


class SharedPoolWorker:
    def __init__(self, vllm_config, ns: bytes, pool) -> None:
        self.vllm_config = vllm_config
        self.world_size = vllm_config.parallel_config.world_size
        self.ns = ns
        self.pool = pool
        self._table = None
        self._rank = 0
        self._jobs: dict[str, tuple[list[int], list[bytes]]] = {}
        self._pending_copies: dict[str, list] = {}  # req -> staged stores
        self._stored_reqs: set[str] = set()
        self._waiting_finish: set[str] = set()
        self._load_errors: set[int] = set()
        self._layout = b""  # the layout fingerprint in each value's header
        self._mac_key = pool.config.mac_key
        self._last_refusal_log = 0.0
        self._refusals_unlogged = 0

    def _key(self, chain_hash: bytes) -> bytes:
        return pool_key(self.ns, chain_hash, self._rank)

    def _set_table(self, table, what: str, layout_tag: bytes) -> None:
        from vllm.distributed import get_world_group

        self._table = table
        self._layout = layout_tag
        self._rank = get_world_group().rank if self.world_size > 1 else 0
        logger.info(
            "vllm-overlay KV pool: %s, one value of %d B per block "
            "(%d run(s) gathered), rank %d",
            what,
            table.block_bytes,
            table.runs_per_block,
            self._rank,
        )

    def register_cross_layers_kv_cache(self, kv_cache, layout) -> None:
        table = cross_layer_table(kv_cache, layout)
        self._set_table(
            table,
            f"cross-layer buffer ({layout.num_layers} layers)",
            table_layout_tag(
                "cross-layer",
                table,
                f"dims={layout.dims}|dtype={layout.dtype}|layers="
                f"{layout.num_layers}|kernel-block={layout.kernel_block_size}",
            ),
        )

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.v1.attention.backends.utils import get_kv_cache_layout

        table = per_layer_table(self.vllm_config, kv_caches)
        first = next(iter(kv_caches.values()))
        order = tuple(sorted(range(first.dim()), key=lambda d: -first.stride(d)))
        self._set_table(
            table,
            f"{len(kv_caches)} per-layer caches",
            table_layout_tag(
                "per-layer",
                table,
                f"kv-layout={get_kv_cache_layout()}|dtype={first.dtype}|"
                f"dim-order={order}|runs={[s.length for s in table.segments]}",
            ),
        )

    def _method(self) -> str:
        return "triton" if self._table.device.type == "cuda" else "dma"

    def start_load_kv(self, meta: PoolMetadata) -> None:
        for req_id, (block_ids, chain) in meta.loads.items():
            self._jobs[req_id] = (block_ids, chain)
            keys = [self._key(h) for h in chain]
            self.pool.submit_load(
                req_id,
                keys,
                value_bytes=self._table.block_bytes + codec.HEADER_BYTES,
                prepare=functools.partial(self._prepare_load, block_ids, keys),
            )

    def wait_for_save(self, meta: PoolMetadata) -> None:
        """Copy the blocks completed in this step to host memory (only as
        many as the pool admits now: none while its writes are paused); the
        store thread encodes and writes them."""
        value_bytes = self._table.block_bytes + codec.HEADER_BYTES
        for req_id, (block_ids, chain) in meta.stores.items():
            # The scheduler holds the request's blocks until we report it
            # finished sending: report it even when nothing is copied.
            self._stored_reqs.add(req_id)
            room = self.pool.store_room(value_bytes)
            if room < len(block_ids):  # prefix order: keep the leading ones
                self.pool.note_dropped(len(block_ids) - room)
                block_ids, chain = block_ids[:room], chain[:room]
            if not block_ids:
                continue
            ids = torch.tensor(block_ids, dtype=torch.int64)
            staging = torch.empty(
                len(block_ids),
                self._table.block_bytes,
                dtype=torch.uint8,
                pin_memory=self._table.device.type == "cuda",
            )
            event = None
            if self._table.device.type == "cuda":
                stream = torch.cuda.current_stream()
                gather(self._table, ids, staging, self._method())
                event = torch.cuda.Event()
                event.record(stream)
            else:
                gather(self._table, ids, staging, "dma")
            self._pending_copies.setdefault(req_id, []).append((event, staging, chain))

    def _encode(self, key: bytes, payload) -> bytes:
        """Runs on the pool's store thread."""
        return codec.encode(self.ns, key, payload, self._layout, self._mac_key)

    def _flush_copies(self) -> None:
        for req_id, copies in list(self._pending_copies.items()):
            keep = []
            for event, staging, chain in copies:
                if event is not None and not event.query():
                    keep.append((event, staging, chain))
                    continue
                rows = staging.numpy()
                self.pool.submit_store(
                    [(self._key(h), rows[i].data) for i, h in enumerate(chain)],
                    encode=self._encode,
                )
            if keep:
                self._pending_copies[req_id] = keep
            else:
                del self._pending_copies[req_id]

    def _prepare_load(self, block_ids, keys, values) -> _ReadyLoad:
        """Runs on the pool's load thread: check each value and pack the
        good payloads into one host buffer, ready to scatter."""
        ready = _ReadyLoad()
        payloads = []
        for block_id, key, value in zip(block_ids, keys, values):
            try:
                if value is None:
                    raise codec.BadValue("missing")
                payload = codec.decode(
                    self.ns,
                    key,
                    value,
                    self._table.block_bytes,
                    self._layout,
                    self._mac_key,
                )
            except codec.BadValue as exc:
                ready.failed_ids.append(block_id)
                if value is not None:
                    if exc.delete:
                        ready.delete_keys.append(key)
                    ready.bad_signatures += exc.signature
                    ready.refusals.append((key, exc))
                continue
            ready.good_ids.append(block_id)
            payloads.append(payload)
        if payloads:
            ready.packed = torch.empty(
                len(payloads),
                self._table.block_bytes,
                dtype=torch.uint8,
                pin_memory=self._table.device.type == "cuda",
            )
            rows = ready.packed.numpy()
            for i, payload in enumerate(payloads):
                rows[i] = numpy.frombuffer(payload, dtype=numpy.uint8)
        return ready

    def _finish_loads(self) -> set[str]:
        done = set()
        for req_id, ready in self.pool.poll_loads():
            block_ids, _ = self._jobs.pop(req_id)
            if ready is None:  # preparing failed (logged): recompute all
                ready = _ReadyLoad(failed_ids=list(block_ids))
            self._load_errors.update(ready.failed_ids)
            if ready.good_ids:
                scatter(
                    self._table,
                    torch.tensor(ready.good_ids, dtype=torch.int64),
                    ready.packed,
                    self._method(),
                )
                if self._table.device.type == "cuda":
                    torch.cuda.current_stream().synchronize()
            self.pool.record_load(
                len(ready.good_ids), len(ready.failed_ids), ready.bad_signatures
            )
            for key, exc in ready.refusals:
                self._log_refusal(key, exc)
            if ready.delete_keys:  # a bad value is never loaded again
                self.pool.submit_delete(ready.delete_keys)
            done.add(req_id)
        return done

    def _log_refusal(self, key: bytes, exc: codec.BadValue) -> None:
        """Rate-limited: at most one line every 10 s, with the count."""
        now = time.monotonic()
        if now - self._last_refusal_log < 10.0:
            self._refusals_unlogged += 1
            return
        self._last_refusal_log = now
        more, self._refusals_unlogged = self._refusals_unlogged, 0
        logger.warning(
            "vllm-overlay KV pool: block %s refused (%s)%s; %s; recomputing",
            key.rsplit(b":", 1)[-1][:12].decode(),
            exc,
            f" (and {more} more refused since the last message)" if more else "",
            "deleted" if exc.delete else "left in the pool",
        )

    def get_finished(self, finished_req_ids: set[str]):
        self._flush_copies()
        finished_recving = self._finish_loads()
        finished_sending = set()
        for req_id in finished_req_ids:
            if req_id in self._stored_reqs and req_id not in self._pending_copies:
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
