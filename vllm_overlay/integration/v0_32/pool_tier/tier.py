"""SharedPoolTier: the shared Redis/Valkey pool as a secondary tier of
vLLM 0.32's ``TieringOffloadingSpec``.

Upstream's tiering manager keeps a primary tier in host memory and moves
chunks between it and its secondary tiers: a chunk the primary tier stores
is cascaded to each tier (``submit_store``), and a chunk the primary tier
lacks but a tier holds is promoted into it (``submit_load``).  This tier
does both against the overlay's ``KVPool`` (``core/pool``), so a node
serves its own recent prefixes from host memory and other nodes' prefixes
from the pool.  Every method runs on the scheduler's thread and returns at
once: lookups are tickets (``lookups.py``), loads and stores are queued to
the pool's threads, which read each value straight into its primary chunk
(header checked in place) and send each chunk from there (header encoded,
checksummed and signed on the store thread).  Upstream pins the chunks of
a job until ``get_finished_jobs`` reports it, so nothing is copied.

The guarantees of the 0.11.2 connector hold: keys namespaced by everything
that shapes the bytes (``identity.py``), a checksum and optional MAC per
value (a refused value is deleted and its block recomputed), liveness
(slow, hung, full and unreachable servers classified, paused and resumed by
the pool; a lookup not answered in time is a miss, a load past its deadline
fails and vLLM recomputes), cluster, TLS/auth and the in-flight bounds.

Config (an entry of ``secondary_tiers``): ``type: SharedPoolTier``,
``module_path: vllm_overlay.integration.v0_32.pool_tier`` and the pool's
options (``url``, ``namespace``, ``cluster``, timeouts, limits, ``ttl_s``,
TLS and secret options: ``core/pool/config.py``); optionally ``locality``
(``REMOTE``, the default, or ``LOCAL``: upstream's factory also picks its
back-pressure watermarks by it, and for an entry without it the tier builds
its detector again for REMOTE: ``backpressure.py``) and upstream's
``backpressure``."""

from __future__ import annotations

import collections
import functools
import logging
import threading
import time
from typing import Any, ClassVar

import numpy
from vllm.v1.kv_offload.base import (
    Locality,
    LookupResult,
    Medium,
    RequestOffloadingContext,
)
from vllm.v1.kv_offload.tiering.base import (
    JobResult,
    SecondaryTierManager,
    TransferJob,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from vllm_overlay.core.pool import codec
from vllm_overlay.core.pool.config import PoolConfig, tier_options
from vllm_overlay.core.pool.errors import require_dependencies
from vllm_overlay.core.pool.keys import namespace_tag, pool_key
from vllm_overlay.core.pool.pool import GRACE_S, KVPool
from vllm_overlay.core.pool.ratelog import RateLimitedLog
from vllm_overlay.core.pool.refusals import LoadSummary, log_refusal
from vllm_overlay.integration.v0_32 import kv_identity
from vllm_overlay.integration.v0_32.idle_wait import TRANSFER_DONE
from vllm_overlay.integration.v0_32.pool_tier import backpressure, identity, stats
from vllm_overlay.integration.v0_32.pool_tier.lookups import LookupVerdicts

logger = logging.getLogger("vllm.overlay")

_VERDICT = {True: LookupResult.HIT, False: LookupResult.MISS, None: LookupResult.RETRY}


class SharedPoolTier(SecondaryTierManager):
    # Remote memory: reported as its own cache-hit source ("external"),
    # never as this node's host memory.
    medium: ClassVar[Medium | None] = None
    cache_hit_source: ClassVar[CacheHitSource] = CacheHitSource.EXTERNAL_UNSPECIFIED

    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict:
        return stats.metric_definitions()

    def __init__(
        self,
        offloading_spec,
        primary_kv_view: memoryview,
        tier_type: str,
        backpressure_detector=None,
        **options,
    ) -> None:
        # Upstream's factory passes ``locality`` on and picks the
        # back-pressure defaults by it; the pool is remote unless told, and
        # its detector is built for the locality it reports.
        pool_options, locality = tier_options(options)
        super().__init__(
            offloading_spec=offloading_spec,
            primary_kv_view=primary_kv_view,
            tier_type=tier_type,
            backpressure_detector=backpressure.for_locality(
                backpressure_detector, offloading_spec, tier_type, options, locality
            ),
        )
        require_dependencies()  # one clear error now, not a dead thread later
        self.locality = Locality(locality)
        self.config = PoolConfig.from_dict(pool_options)
        spec_config = offloading_spec.config
        chunk = self.block_size_bytes
        # The engine's measured part (weights, page layout): re-keyed when
        # a prefix-cache reset finds other weights (``rekey``).
        self._engine = kv_identity.engine(spec_config.engine_id)
        self._identity_of = functools.partial(
            identity.tier_factors, spec_config, chunk, self.config.namespace
        )
        self.ns = namespace_tag(self._identity_of(self._engine.factors()))
        self._layout = codec.layout_tag(identity.layout_description(spec_config, chunk))
        self._rows = numpy.asarray(primary_kv_view).view(numpy.uint8)
        self._value_bytes = chunk + codec.HEADER_BYTES
        # Checked before the pool's threads start (a refused tier leaves
        # none behind; upstream shuts down only the tiers it has built).
        self.config.check_value_size(self._value_bytes)
        # Results not yet reported (stores; loads failed by drain_jobs).
        self._done: collections.deque = collections.deque()
        # Stores submitted, not yet done: job id -> submitted at.  A store
        # reports once: when it is done, or failed by drain_jobs (its late
        # completion is then ignored); the lock orders the two.
        self._stores: dict[int, float] = {}
        self._stores_lock = threading.Lock()
        self._loads: dict[int, tuple[list, float]] = {}  # keys, submitted at
        self._refusal_log = RateLimitedLog(logger, 10.0)  # (log_refusal)
        self.pool = KVPool(self.config, io_threads=True, lookups=True)
        try:
            # A lookup answered or a load's result queued wakes an engine
            # that waits for it (integration/v0_32/idle_wait); nothing here
            # waits.
            self.pool.on_result = TRANSFER_DONE.set
            self._lookups = LookupVerdicts(self.pool, self._name)
            self.pool.probe()  # an unreachable pool is reported now (background)
            self._engine.subscribe(self)
        except BaseException:
            self.pool.close()
            raise
        logger.info(
            "vllm-overlay KV pool tier: %s%s, namespace %s (%s), values %s, one "
            "value per host chunk of %d B (%d chunks in the primary tier)",
            self.config.redacted_url,
            " (cluster)" if self.config.cluster else "",
            self.ns.hex()[:12],
            self.config.namespace,
            "signed (shared secret)" if self.config.mac_key else "unsigned",
            chunk,
            self._rows.shape[0],
        )

    def rekey(self, engine_factors: list[str]) -> None:
        """The engine's weights (or page layout) changed: from now on this
        tier reads and writes another namespace, and forgets what it knew
        of the old one.  Called on the engine's thread after a prefix-cache
        reset (upstream's ``reset_cache`` drained every job) or an RPC to
        the workers (between steps)."""
        old = self.ns
        self.ns = namespace_tag(self._identity_of(engine_factors))
        self._lookups.clear()
        logger.warning(
            "vllm-overlay KV pool tier: the engine's weights changed (measured after "
            "a prefix-cache reset or an RPC to the workers): namespace %s -> %s; "
            "values stored under the old weights are never loaded by this engine again",
            old.hex()[:12],
            self.ns.hex()[:12],
        )

    def _name(self, key: bytes) -> bytes:
        # One value holds the chunk of every worker: no rank in the name.
        return pool_key(self.ns, key, 0, self.config.name_key)

    # -- lookups --------------------------------------------------------------
    def lookup(self, key, req_context) -> LookupResult:
        return _VERDICT[self._lookups.lookup(key, req_context.req_id)]

    def on_new_request(self, req_context) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def on_request_finished(self, req_context) -> None:
        self._lookups.forget(req_context.req_id)

    def on_schedule_end(self, context) -> None:
        # Never waits (upstream's rule for tier methods): an engine with
        # nothing else to do waits in its idle wait, woken by the pool.
        self._lookups.flush()

    def has_pending_work(self) -> bool:
        return (
            self._lookups.pending()
            or bool(self._loads)
            or bool(self._stores)
            or bool(self._done)
        )

    # -- stores: primary chunk -> pool ---------------------------------------
    def submit_store(self, job_metadata: TransferJob) -> None:
        rows = self._rows
        items = [
            (self._name(key), rows[chunk].data)
            for key, chunk in zip(job_metadata.keys, job_metadata.chunk_ids)
        ]
        with self._stores_lock:
            self._stores[job_metadata.job_id] = time.monotonic()
        self.pool.submit_store(
            items,
            # the namespace its keys were named in (a rekey may come first)
            encode=functools.partial(self._encode, self.ns),
            on_done=functools.partial(self._stored, job_metadata.job_id),
        )

    def _encode(self, ns: bytes, name: bytes, payload):
        """The store thread: header (checksum, MAC) and payload, two buffers."""
        head = codec.encode_header(ns, name, payload, self._layout, self.config.mac_key)
        return head, payload

    def _stored(self, job_id: int, outcome) -> None:
        """The store thread (or submit_store): the chunks are free again.

        What upstream is told follows 0.33's contract (``JobResult``,
        ``TieringOffloadingManager._update_backpressure``, the detector's
        ``update``): a store fails when a chunk the pool tried to write was
        not stored (the server refused it, the write failed or timed out):
        a failed cascade, which 0.33 also hands to its back-pressure
        detector (``on_store_failed``: with ``failure_threshold`` set,
        consecutive failures put the tier under pressure).  Chunks the
        pool dropped on purpose, without trying (over the in-flight limit,
        or while writes are paused after a failure), are no failure: the
        store succeeds with ``transfer_bytes`` the chunks written, and a
        detector learns nothing from a store that wrote nothing (``update``
        ignores 0 bytes; both releases).  The pool counts the dropped
        chunks (its ``dropped_stores``); upstream's write counters count a
        successful cascade's chunks as written."""
        with self._stores_lock:
            start = self._stores.pop(job_id, None)
            if start is None:
                return  # reported failed by drain_jobs already
            self._done.append(
                JobResult(
                    job_id,
                    success=outcome.failed == 0,
                    transfer_time=time.monotonic() - start if outcome.written else None,
                    transfer_bytes=outcome.written * self.block_size_bytes,
                )
            )

    # -- loads: pool -> primary chunk ----------------------------------------
    def submit_load(self, job_metadata: TransferJob) -> None:
        keys = list(job_metadata.keys)
        chunks = [int(c) for c in job_metadata.chunk_ids]
        names = [self._name(key) for key in keys]
        heads = numpy.empty((len(keys), codec.HEADER_BYTES), dtype=numpy.uint8)
        checks = codec.LandedChecks(
            len(keys), functools.partial(self._refusal, names, chunks, heads)
        )
        self._loads[job_metadata.job_id] = (keys, time.monotonic())
        self.pool.submit_load(
            job_metadata.job_id,
            names,
            value_bytes=self._value_bytes,
            prepare=functools.partial(self._verdicts, checks, names),
            into=functools.partial(self._into, chunks, heads),
            landed=checks.landed,
        )

    def _into(self, chunks, heads, i: int, length: int):
        """The load thread: value ``i`` goes to its header row and chunk."""
        if length != self._value_bytes:
            return None  # read as bytes, refused by its check
        return [heads[i].data, self._rows[chunks[i]].data]

    def _refusal(self, names, chunks, heads, i: int, value):
        """The load thread: the refusal of value ``i`` (None: good), checked
        where it lies (``codec.LandedChecks`` calls it)."""
        head, chunk = heads[i], chunks[i]
        return codec.refusal(
            self.ns,
            names[i],
            value,
            lambda: (head, self._rows[chunk]),
            self._value_bytes - codec.HEADER_BYTES,
            self._layout,
            self.config.mac_key,
        )

    def _verdicts(self, checks, names, values) -> LoadSummary:
        """The load thread, once it is done writing: each value's verdict,
        summed up (``core/pool/refusals.py``)."""
        # Queued, then on_result wakes the engine.
        return LoadSummary.of(names, checks.verdicts(values))

    def _loaded(self, job_id: int, summary: LoadSummary | None) -> JobResult | None:
        if job_id not in self._loads:
            return None  # reported failed by drain_jobs already
        keys, start = self._loads.pop(job_id)
        if summary is None:  # preparing failed (logged): recompute all
            summary = LoadSummary.all_failed(len(keys))
        who = "vllm-overlay KV pool tier"
        summary.report(
            self.pool, functools.partial(log_refusal, self._refusal_log, who)
        )
        good = [keys[i] for i in summary.good]
        failed = [keys[i] for i in summary.failed]
        self._lookups.mark_missing(failed)
        return JobResult(
            job_id,
            success=not failed,
            successful_keys=good if failed else None,
            transfer_time=time.monotonic() - start,
            transfer_bytes=len(good) * (self._value_bytes - codec.HEADER_BYTES),
        )

    # -- results --------------------------------------------------------------
    def get_finished_jobs(self) -> list[JobResult]:
        out = []
        while self._done:
            out.append(self._done.popleft())
        for job_id, verdicts in self.pool.poll_loads():
            result = self._loaded(job_id, verdicts)
            if result is not None:
                out.append(result)
        return out

    def drain_jobs(self) -> None:
        """Upstream's contract (``reset_cache`` asserts it, then frees and
        reuses every primary chunk): once this returns, every submitted
        job's result is queued for ``get_finished_jobs`` and no job touches
        the primary tier's memory.

        Within the pool's deadlines every job ends by itself (a load past
        ``io_timeout_s`` is failed by the watchdog and stops writing).  A
        job still running after them is given up, and stopped before this
        returns (the read or write under way ends first; ``KVPool
        .cancel_loads`` and ``.cancel_stores``):

        * a load writes no more into its chunks and is reported failed
          (one whose result was being made is reported with it);
        * a store is reported failed and reads its chunks no more: a value
          not encoded yet is never sent; one cut short on the wire never
          reaches the server whole (its connection is reset); one sent
          whole holds the bytes it was encoded from, which cannot have
          changed yet.  So no value in the pool ever holds bytes written
          after the reset.  Its late completion is ignored.

        Only a pool thread wedged inside one read or write for ``GRACE_S``
        (a bug) escapes this; it is logged as an error."""
        limit = self.config.io_timeout_s + self.config.timeout_s + 2 * GRACE_S
        if self.pool.drain(limit):
            return
        # Stores first: one may be encoding (reading a chunk) right now.
        wedged = self.pool.cancel_stores(GRACE_S)
        stuck = self.pool.cancel_loads(GRACE_S)
        for job_id in stuck:  # cannot happen unless a thread is wedged
            keys, start = self._loads.pop(job_id)
            self._lookups.mark_missing(keys)
            self._done.append(
                JobResult(job_id, success=False, transfer_time=time.monotonic() - start)
            )
        with self._stores_lock:
            stores, self._stores = self._stores, {}
            now = time.monotonic()
            for job_id, start in stores.items():
                self._done.append(
                    JobResult(job_id, success=False, transfer_time=now - start)
                )
        logger.error(
            "vllm-overlay KV pool tier: jobs still running %.1f s into a drain "
            "(pool %s, state %s): %d store(s) stopped and reported failed (their "
            "late completions ignored), loads stopped%s",
            limit,
            self.config.redacted_url,
            self.pool.state(),
            len(stores),
            f" ({len(stuck)} still running, reported failed)" if stuck else "",
        )
        if wedged or stuck:
            logger.error(
                "vllm-overlay KV pool tier: %d store(s) and %d load(s) could not "
                "be stopped within %.1f s (a pool thread inside one read or write "
                "all that time): they may still "
                "touch host memory that upstream now reuses",
                wedged,
                len(stuck),
                GRACE_S,
            )

    def shutdown(self) -> None:
        self.pool.close()
        # Our view of the primary tier's memory goes before upstream
        # releases that memory (an exported view would keep its mmap open).
        self._rows = None

    def get_stats(self):
        return stats.connector_stats(self.pool.take_stats(), self.pool.state())
