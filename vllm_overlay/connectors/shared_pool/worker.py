"""Worker side of the shared pool connector: copies blocks between the KV
cache and host memory and hands the network I/O to the pool's background
threads (store and load).

Host memory is two staging rings allocated once (pinned with CUDA): a
store copies its blocks into one ring and the store thread sends them from
there (header and payload as separate buffers, encoded and checksummed on
that thread); a load's values are read by the load thread straight into
the other ring (header checked in place, payload never copied in Python)
and moved to the KV cache with one call per batch.  With a KV cache in host
memory whose blocks are one run each (CPU, cross-layer or a single layer)
there is no load staging at all: each payload is read from the socket
straight into its KV block (a value refused by its check leaves the block
to be recomputed, like any load error).  On the engine thread: no staging
allocation, no encoding, no checksum, no stream synchronize (a CUDA event
says when a ring span may be reused).

A request finished (aborted) while its load is under way keeps its blocks
until the load has landed: the scheduler side delays freeing them and the
worker reports the request finished once the load thread is done with
them, so no load ever writes into blocks another request was given."""

from __future__ import annotations

import logging

import torch

from vllm_overlay.connectors.shared_pool.common import (
    PoolMetadata,
    table_layout_tag,
)
from vllm_overlay.connectors.shared_pool.loads import WorkerLoads
from vllm_overlay.connectors.shared_pool.staging import StagingRing
from vllm_overlay.core.ops.block_copy import gather, scatter
from vllm_overlay.core.pool import codec
from vllm_overlay.core.pool.keys import pool_key
from vllm_overlay.core.pool.ratelog import RateLimitedLog
from vllm_overlay.core.pool.refusals import log_refusal
from vllm_overlay.integration.kv_tables import cross_layer_table, per_layer_table

logger = logging.getLogger("vllm.overlay")

_WORDS = ((8, torch.int64), (4, torch.int32), (2, torch.int16), (1, torch.uint8))


class SharedPoolWorker(WorkerLoads):
    def __init__(self, vllm_config, ns: bytes, pool) -> None:
        self.vllm_config = vllm_config
        self.world_size = vllm_config.parallel_config.world_size
        self.ns = ns
        self.pool = pool
        self._table = None
        self._rank = 0
        self._jobs: dict[str, tuple] = {}  # req -> (block ids, chain, span)
        self._pending_copies: dict[str, list] = {}  # req -> staged stores
        self._stored_reqs: set[str] = set()
        self._waiting_finish: set[str] = set()
        self._load_errors: set[int] = set()
        # Blocks whose value was refused by its check (checksum, MAC, layout,
        # namespace), as opposed to transient failures: the scheduler side
        # remembers those (see take_refused).
        self._refused_ids: set[int] = set()
        self._layout = b""  # the layout fingerprint in each value's header
        self._mac_key = pool.config.mac_key
        self._refusal_log = RateLimitedLog(logger, 10.0)
        self._store_ring: StagingRing | None = None
        self._load_ring: StagingRing | None = None
        self._cache_words: torch.Tensor | None = None  # [blocks, words], CPU
        self._word = torch.uint8
        self._unreleased: list = []  # (event, load span) still read on device
        self._cache_rows = None  # numpy [blocks, block bytes]: direct loads
        self._aborted_loads: set[str] = set()  # finished while loading

    def _key(self, chain_hash: bytes) -> bytes:
        return pool_key(self.ns, chain_hash, self._rank, self.pool.config.name_key)

    def _set_table(self, table, what: str, layout_tag: bytes) -> None:
        from vllm.distributed import get_world_group

        self._table = table
        self._layout = layout_tag
        self._rank = get_world_group().rank if self.world_size > 1 else 0
        self.pool.check_value_size(table.block_bytes + codec.HEADER_BYTES)
        self._make_staging(table)
        store_mib = self._store_ring.rows.nbytes / 2**20
        load_mib = (self._load_ring.rows.nbytes + self._load_ring.heads.nbytes) / 2**20
        logger.info(
            "vllm-overlay KV pool: %s, one value of %d B per block "
            "(%d run(s) gathered), rank %d; host memory taken now: %.1f MiB "
            "store staging (%d blocks, max_inflight_bytes) + %.1f MiB load "
            "staging (%d blocks, max_inflight_load_bytes%s)%s",
            what,
            table.block_bytes,
            table.runs_per_block,
            self._rank,
            store_mib,
            self._store_ring.slots,
            load_mib,
            self._load_ring.slots,
            "; headers only: values are read straight into the KV cache"
            if self._cache_rows is not None
            else "",
            ", pinned" if self._table.device.type == "cuda" else "",
        )

    def _make_staging(self, table) -> None:
        """The staging rings (sized by the pool's in-flight limits, at most
        the KV cache's blocks) and, on CPU with one run per block, a word
        view of the cache for one-call gathers and scatters."""
        config = self.pool.config
        value_bytes = table.block_bytes + codec.HEADER_BYTES
        pin = table.device.type == "cuda"
        self._cache_words = self._cache_rows = None
        if table.device.type == "cpu" and len(table.segments) == 1:
            seg = table.segments[0]
            base_ptr = seg.storage.data_ptr()
            for size, dtype in _WORDS:
                if not (base_ptr | seg.offset | seg.stride | seg.length) % size:
                    break
            words = torch.empty(0, dtype=dtype).set_(
                seg.storage, 0, (seg.storage.nbytes() // size,), (1,)
            )
            self._cache_words = words.as_strided(
                (table.num_blocks, seg.length // size),
                (seg.stride // size, 1),
                seg.offset // size,
            )
            self._word = dtype
            self._cache_rows = self._cache_words.view(torch.uint8).numpy()
            # Block ids of one gather or scatter (synchronous on CPU).
            self._ids = torch.empty(table.num_blocks, dtype=torch.int64)
            self._ids_np = self._ids.numpy()
        self._store_ring = StagingRing(
            max(1, min(table.num_blocks, config.max_inflight_bytes // value_bytes)),
            table.block_bytes,
            pin,
        )
        # Direct loads need header rows only.
        self._load_ring = StagingRing(
            max(1, min(table.num_blocks, config.load_limit_bytes // value_bytes)),
            0 if self._cache_rows is not None else table.block_bytes,
            pin,
            header_bytes=codec.HEADER_BYTES,
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

    # -- copies (engine thread): one call per batch --------------------------
    def _block_index(self, block_ids: list[int]) -> torch.Tensor:
        """``block_ids`` as an int64 tensor: in a buffer allocated once for
        the synchronous CPU copies, else a new (small) tensor."""
        if self._cache_words is None:
            return torch.tensor(block_ids, dtype=torch.int64)
        self._ids_np[: len(block_ids)] = block_ids
        return self._ids[: len(block_ids)]

    def _gather(self, block_ids: list[int], start: int):
        """Blocks -> store ring rows ``start ..``; a CUDA event (or None:
        done) says when the rows are written."""
        ring, n = self._store_ring, len(block_ids)
        ids = self._block_index(block_ids)
        if self._cache_words is not None:
            torch.index_select(
                self._cache_words, 0, ids, out=ring.words(self._word)[start : start + n]
            )
            return None
        gather(self._table, ids, ring.rows[start : start + n], self._method())
        if self._table.device.type != "cuda":
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream())
        return event

    def _scatter(self, block_ids: list[int], rows: list[int]):
        """Load ring rows -> blocks (caches with several runs per block, or
        on the device; one run per block in host memory is read in place);
        a CUDA event (or None: done) says when the rows have been read.
        Queued on the current stream: the next forward pass sees the blocks
        without a synchronize."""
        ring = self._load_ring
        ids = self._block_index(block_ids)
        first = rows[0]
        if rows == list(range(first, first + len(rows))):
            scatter(
                self._table, ids, ring.rows[first : first + len(rows)], self._method()
            )
        else:
            packed_ids = torch.tensor(rows, dtype=torch.int64)
            scatter(self._table, ids, ring.rows, self._method(), packed_ids)
        if self._table.device.type != "cuda":
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream())
        return event

    # -- stores ---------------------------------------------------------------
    def wait_for_save(self, meta: PoolMetadata) -> None:
        """Copy the blocks completed in this step to the store ring (only as
        many as the pool admits now: none while its writes are paused, and
        as fit in the ring); the store thread encodes and writes them."""
        value_bytes = self._table.block_bytes + codec.HEADER_BYTES
        for req_id, (block_ids, chain) in meta.stores.items():
            # The scheduler holds the request's blocks until we report it
            # finished sending: report it even when nothing is copied.
            self._stored_reqs.add(req_id)
            room = min(len(block_ids), self.pool.store_room(value_bytes))
            start, n = self._store_ring.alloc(room)
            if n < len(block_ids):  # prefix order: keep the leading ones
                self.pool.note_dropped(len(block_ids) - n)
                block_ids, chain = block_ids[:n], chain[:n]
            if not block_ids:
                continue
            event = self._gather(block_ids, start)
            self._pending_copies.setdefault(req_id, []).append((event, start, chain))

    def _encode(self, key: bytes, payload):
        """Runs on the pool's store thread: the header (CRC, MAC) and the
        payload, sent as two buffers."""
        head = codec.encode_header(self.ns, key, payload, self._layout, self._mac_key)
        return head, payload

    def _flush_copies(self) -> None:
        ring = self._store_ring
        for req_id, copies in list(self._pending_copies.items()):
            keep = []
            for event, start, chain in copies:
                if event is not None and not event.query():
                    keep.append((event, start, chain))
                    continue
                rows = ring.rows_np
                self.pool.submit_store(
                    [(self._key(h), rows[start + i].data) for i, h in enumerate(chain)],
                    encode=self._encode,
                    # (the outcome: the pool's stats count what was stored)
                    on_done=lambda _outcome, start=start: ring.release(start),
                )
            if keep:
                self._pending_copies[req_id] = keep
            else:
                del self._pending_copies[req_id]

    def _log_refusal(self, key: bytes, exc: codec.BadValue) -> None:
        log_refusal(self._refusal_log, "vllm-overlay KV pool", key, exc)

    def get_finished(self, finished_req_ids: set[str]):
        """(finished sending, finished receiving).  The scheduler side held
        the blocks of a finished request with stores or a load under way:
        it is reported as finished sending once neither is left."""
        self._flush_copies()
        self._release_read_spans()
        for req_id in finished_req_ids:
            if req_id in self._jobs:  # finished while its load is under way
                self._aborted_loads.add(req_id)
        finished_recving = self._finish_loads()
        finished_sending = set()
        for req_id in finished_req_ids:
            if req_id in self._stored_reqs or req_id in self._aborted_loads:
                self._waiting_finish.add(req_id)
        for req_id in list(self._waiting_finish):
            if req_id not in self._pending_copies and req_id not in self._jobs:
                self._waiting_finish.discard(req_id)
                self._stored_reqs.discard(req_id)
                self._aborted_loads.discard(req_id)
                finished_sending.add(req_id)
        return finished_sending or None, finished_recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def take_refused(self) -> list[int]:
        """Blocks of this step's load errors whose value was refused by its
        check (not a transient failure): they travel to the scheduler side
        with this step's connector stats (vLLM 0.11.2 has no other channel
        from workers to the scheduler's connector)."""
        refused, self._refused_ids = self._refused_ids, set()
        return sorted(refused)
