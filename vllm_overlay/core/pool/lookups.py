"""The pool's lookups: ``submit_lookup(keys)`` returns a ``LookupTicket``
at once; the lookup thread answers it (pipelined EXISTS; tickets queued
meanwhile share one round trip).  The caller polls ``ticket.done`` and
gives up after ``lookup_wait_s()`` (``abandon``), which marks the pool
slow.  A mixin of ``KVPool`` (pool.py), whose constructor sets the state
named below."""

from __future__ import annotations

import logging
import queue
import threading
import time

from vllm_overlay.core.pool.config import PoolConfig
from vllm_overlay.core.pool.errors import PoolTooSlow
from vllm_overlay.core.pool.health import READ
from vllm_overlay.core.pool.jobs import STOP, LookupTicket
from vllm_overlay.core.pool.ratelog import RateLimitedLog
from vllm_overlay.core.pool.stats import PoolStats


class PoolLookups:
    """Owns no state.  Reads ``config``, ``_threads`` (the lookup thread
    starts on first use, ``_start``/``_run``), ``_lookups_ready`` (set by
    ``_run``) and ``on_result``; puts tickets on ``_lookup_q`` and takes
    them in batches on the lookup thread; counts ``stats.lookups``,
    ``hits``, ``misses``, ``lookups_skipped``, ``lookup_timeouts`` under
    ``_lock``.  Calls ``reads_open``, ``_failed``, ``_ok`` (failures.py)
    and ``_log``."""

    config: PoolConfig
    stats: PoolStats
    _lock: threading.Lock
    _log: RateLimitedLog
    _threads: dict
    _lookup_q: queue.Queue
    _lookups_ready: bool
    on_result: object

    def submit_lookup(self, keys: list[bytes]) -> LookupTicket:
        """Start a lookup; the ticket is done at once (a miss) when reads
        are paused or too many lookups wait.  Never blocks."""
        ticket = LookupTicket(keys)
        if not keys:
            ticket._finish([])
            return ticket
        if self.reads_open():
            if "lookup" not in self._threads:
                self._start_lookups()
            try:
                self._lookup_q.put_nowait(ticket)
                return ticket
            except queue.Full:
                self._log.log(
                    logging.WARNING,
                    "lookup queue",
                    "vllm-overlay KV pool %s: %d lookups already wait; new ones "
                    "are answered as misses",
                    self.config.redacted_url,
                    self._lookup_q.maxsize,
                )
        with self._lock:
            self.stats.lookups_skipped += 1
        ticket._finish(None)
        return ticket

    def _start_lookups(self) -> None:
        with self._lock:
            if "lookup" not in self._threads:
                self._start(self._run, "lookup", self._lookup_q, self._lookup)

    def lookup_wait_s(self) -> float:
        """How long a caller waits for a lookup: ``lookup_wait_s``, or,
        until the lookup thread has made its first connection, the connect
        and socket timeouts (a process starting up may starve that thread
        of the GIL; the wait is bounded, and other requests run meanwhile)."""
        if self._lookups_ready:
            return self.config.lookup_wait_s
        return self.config.connect_timeout_s + self.config.timeout_s

    def abandon(self, ticket: LookupTicket) -> None:
        """The caller stopped waiting for ``ticket`` (``lookup_wait_s()``
        passed): the pool is too slow to help, so it pauses (unless the
        first connection is still being made: its own failure, if any, is
        what counts)."""
        if ticket.done or ticket.abandoned:
            return
        ticket.abandoned = True
        if not self._lookups_ready:
            return
        with self._lock:
            self.stats.lookup_timeouts += 1
        waited = time.monotonic() - ticket.submitted
        self._failed(
            PoolTooSlow(
                f"no answer to a lookup within {waited * 1e3:.0f} ms "
                f"(lookup_wait_s {self.config.lookup_wait_s * 1e3:.0f} ms)"
            ),
            "lookup",
            READ,
        )

    def count_hits(self, keys: list[bytes], timeout_s: float | None = None) -> int:
        """Blocking lookup for tests and tools (never vLLM's threads):
        leading ``keys`` present, 0 when the pool cannot answer."""
        ticket = self.submit_lookup(keys)
        deadline = time.monotonic() + (
            timeout_s
            if timeout_s is not None
            else self.config.connect_timeout_s + self.config.timeout_s + 1.0
        )
        while not ticket.done and time.monotonic() < deadline:
            time.sleep(0.0005)
        return ticket.hits

    def _lookup(self, client, first: LookupTicket) -> None:
        batch = [first]
        while True:  # every ticket queued meanwhile: one round trip
            try:
                batch.append(self._lookup_q.get_nowait())
            except queue.Empty:
                break
        stop = STOP in batch
        live = [t for t in batch if t is not STOP and not t.abandoned]
        try:
            if live and not self.reads_open():
                with self._lock:
                    self.stats.lookups_skipped += len(live)
            elif live:
                pipe = client.pipeline(transaction=False)
                for ticket in live:
                    for key in ticket.keys:
                        pipe.exists(key)
                answers = pipe.execute()
                self._ok(READ)
                i = 0
                for ticket in live:
                    present = [bool(a) for a in answers[i : i + len(ticket.keys)]]
                    i += len(ticket.keys)
                    hits = next(
                        (j for j, p in enumerate(present) if not p), len(present)
                    )
                    with self._lock:
                        self.stats.lookups += 1
                        self.stats.hits += hits
                        self.stats.misses += len(present) - hits
                    ticket._finish(present)
        except Exception as exc:  # noqa: BLE001 - any failure is a miss
            self._failed(exc, "lookup", READ)
        finally:
            for ticket in batch:
                if ticket is not STOP and not ticket.done:
                    ticket._finish(None)
            if live and self.on_result is not None:
                self.on_result()  # answered: a caller may wake
            if stop:
                self._lookup_q.put(STOP)
