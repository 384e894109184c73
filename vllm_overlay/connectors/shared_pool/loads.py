"""The load side of the shared pool connector's worker: each request's
values are fetched by the pool's load thread into the load ring (or, with
one run per block in host memory, straight into their KV blocks), checked
there as they land, and on the engine thread only scattered into the KV
cache (one call per batch) and reported.  How a load's values are summed
up, counted, logged and deleted when refused is the pool's
(``core/pool/refusals.py``, shared with the 0.32 pool tier); this file maps
them to block ids and ring rows.  A mixin of ``SharedPoolWorker``
(worker.py), whose constructor and ``register_*`` set the state named
below; its ``_key``, ``_scatter`` and ``_log_refusal`` are used here."""

from __future__ import annotations

import dataclasses
import functools

from vllm_overlay.connectors.shared_pool.common import PoolMetadata
from vllm_overlay.connectors.shared_pool.staging import StagingRing
from vllm_overlay.core.pool import codec
from vllm_overlay.core.pool.refusals import LoadSummary


@dataclasses.dataclass
class ReadyLoad:
    """A load, checked on the pool's load thread (``summary``, by position
    in ``block_ids``); its good blocks are in the load ring's rows
    ``good_rows``."""

    block_ids: list[int]
    summary: LoadSummary
    start: int = 0  # the ring span

    @property
    def good_ids(self) -> list[int]:
        return [self.block_ids[i] for i in self.summary.good]

    @property
    def good_rows(self) -> list[int]:
        return [self.start + i for i in self.summary.good]

    @property
    def failed_ids(self) -> list[int]:
        return [self.block_ids[i] for i in self.summary.failed]

    @property
    def refused_ids(self) -> list[int]:  # integrity
        return [self.block_ids[i] for i in self.summary.refused]


class WorkerLoads:
    ns: bytes
    pool: object
    _table: object
    _layout: bytes
    _mac_key: bytes | None
    _jobs: dict
    _load_errors: set
    _refused_ids: set
    _load_ring: StagingRing | None
    _cache_rows: object
    _unreleased: list
    _aborted_loads: set

    def start_load_kv(self, meta: PoolMetadata) -> None:
        value_bytes = self._table.block_bytes + codec.HEADER_BYTES
        for req_id, (block_ids, chain) in meta.loads.items():
            keys = [self._key(h) for h in chain]
            start, n = self._load_ring.alloc(len(keys))
            checks = codec.LandedChecks(
                len(keys),
                functools.partial(self._check_value, block_ids, keys, start),
            )
            fetched = self.pool.submit_load(
                req_id,
                keys,
                value_bytes=value_bytes,
                prepare=functools.partial(
                    self._prepare_load, block_ids, keys, start, checks
                ),
                into=functools.partial(self._load_into, block_ids, start),
                max_keys=n,
                landed=checks.landed,
            )
            if n and not fetched:
                self._load_ring.release(start)
            # The load ring's span (None: none) is released once its rows
            # are in the KV cache.
            self._jobs[req_id] = (block_ids, chain, start if fetched else None)

    def _payload_row(self, block_id: int, row: int):
        """Where a loaded payload lies: its KV block (direct loads) or its
        load ring row."""
        if self._cache_rows is not None:
            return self._cache_rows[block_id]
        return self._load_ring.rows_np[row]

    def _load_into(self, block_ids, start: int, i: int, length: int):
        """Runs on the load thread: where value ``i`` goes (its header row,
        and its KV block or its payload row), if it has the length of this
        node's values."""
        if length != self._table.block_bytes + codec.HEADER_BYTES:
            return None  # read as bytes, refused by its check
        return [
            self._load_ring.heads[start + i].data,
            self._payload_row(block_ids[i], start + i).data,
        ]

    def _check_value(
        self, block_ids, keys, start: int, i: int, value
    ) -> codec.BadValue | None:
        """Runs on the load thread: the refusal of value ``i`` (None: good)."""
        block_id, row = block_ids[i], start + i
        return codec.refusal(
            self.ns,
            keys[i],
            value,
            lambda: (self._load_ring.heads[row], self._payload_row(block_id, row)),
            self._table.block_bytes,
            self._layout,
            self._mac_key,
        )

    def _prepare_load(self, block_ids, keys, start, checks, values) -> ReadyLoad:
        """Runs on the pool's load thread (or the watchdog's, for a load
        past its deadline) once the load thread is done writing: each
        value's check (done as it landed, or now: ``codec.LandedChecks``).
        With direct loads, a block whose value failed is zeroed here (see
        _wipe)."""
        try:
            summary = LoadSummary.of(keys, checks.verdicts(values))
            ready = ReadyLoad(list(block_ids), summary, start)
        except BaseException:
            self._wipe(block_ids)  # every block is reported failed
            raise
        self._wipe(ready.failed_ids)
        return ready

    def _wipe(self, block_ids) -> None:
        """Direct loads only: zero the KV blocks of failed values.  Their
        bytes were read straight into the block (all of a refused value, or
        part of one cut off), and may hold anything, NaN included.  vLLM
        recomputes a failed block, but only its filled slots: a block freed
        first (the request aborted or preempted), or the unfilled tail of a
        partial block given to another request, would keep them, and the
        attention kernel multiplies a masked slot's V by 0 (0 x NaN = NaN).
        vLLM's own KV cache starts zeroed; zeros keep it finite."""
        if self._cache_rows is not None:
            for block_id in block_ids:
                self._cache_rows[block_id].fill(0)

    def _finish_loads(self) -> set[str]:
        """Loads the load thread is done with: scattered into the KV cache
        (unless read there directly), reported as received; a request
        finished meanwhile is not reported here (see get_finished)."""
        done = set()
        for req_id, ready in self.pool.poll_loads():
            block_ids, _, start = self._jobs.pop(req_id)
            if req_id in self._aborted_loads:  # its blocks: no longer wanted
                if start is not None:
                    self._load_ring.release(start)
                continue
            if ready is None:  # preparing failed (logged): recompute all
                ready = ReadyLoad(block_ids, LoadSummary.all_failed(len(block_ids)))
            self._load_errors.update(ready.failed_ids)
            self._refused_ids.update(ready.refused_ids)
            event = None
            good_ids = ready.good_ids
            if good_ids and self._cache_rows is None:
                event = self._scatter(good_ids, ready.good_rows)
            if start is not None:
                if event is None:
                    self._load_ring.release(start)
                else:
                    self._unreleased.append((event, start))
            # Counted, logged, refused values deleted (never loaded again).
            ready.summary.report(self.pool, self._log_refusal)
            done.add(req_id)
        return done

    def _release_read_spans(self) -> None:
        if self._unreleased:
            keep = []
            for event, start in self._unreleased:
                if event.query():
                    self._load_ring.release(start)
                else:
                    keep.append((event, start))
            self._unreleased = keep
