"""The pool's stores: ``submit_store(items, encode, on_done)`` queues
``(key, payload)`` pairs; the store thread encodes each payload (header,
checksum, MAC) and writes it (EXISTS, then SET NX, the header and the
payload sent as two buffers: never joined).  Admitted in prefix order up
to ``max_inflight_bytes``.  ``cancel_stores`` stops every store from
reading its payloads (a drain that gives up: the caller reuses them).
``submit_delete`` removes values that failed their check.  A mixin of
``KVPool`` (pool.py), whose constructor sets the state named below."""

from __future__ import annotations

import logging
import queue
import threading
import time

from vllm_overlay.core.pool.config import PoolConfig
from vllm_overlay.core.pool.health import WRITE
from vllm_overlay.core.pool.jobs import StoreJob, StoreOutcome
from vllm_overlay.core.pool.ratelog import RateLimitedLog
from vllm_overlay.core.pool.resp import Cancelled, command
from vllm_overlay.core.pool.stats import PoolStats
from vllm_overlay.core.pool.transport import exchange, first_failure

MAX_QUEUED_DELETES = 65536  # keys; more: dropped (a later load refuses again)


class PoolStores:
    """Owns ``_inflight`` (bytes admitted, not yet released),
    ``_store_jobs`` (admitted, not yet released) and ``_queued_deletes``:
    only its methods write them, under ``_lock``.
    Reads ``config``; puts jobs on ``_store_q``; counts
    ``stats.dropped_stores``, ``stored_blocks``, ``skipped_existing``,
    ``bytes_out``, ``io_seconds_out``.  Calls ``writes_open``,
    ``_failed``, ``_ok``, ``_internal`` (failures.py),
    ``_need_io_threads`` (pool.py) and ``_log``.  Its interface to the
    other parts: ``submit_delete`` and ``_warn_dropped`` (loads.py),
    ``_stores_idle`` and ``_abandon_store`` (pool.py)."""

    config: PoolConfig
    stats: PoolStats
    _lock: threading.Lock
    _log: RateLimitedLog
    _inflight: int
    _store_jobs: set
    _queued_deletes: int
    _store_q: queue.Queue

    def store_room(self, value_bytes: int) -> int:
        """How many values of ``value_bytes`` a store would admit now (0
        while writes are paused): lets the caller skip copying blocks that
        would be dropped."""
        if not self.writes_open():
            return 0
        room = self.config.max_inflight_bytes - self._inflight
        return max(0, room // max(1, value_bytes))

    def note_dropped(self, blocks: int) -> None:
        """Blocks the caller did not submit (``store_room`` said no)."""
        if blocks:
            with self._lock:
                self.stats.dropped_stores += blocks
            if self.writes_open():
                self._warn_dropped("store", 0, blocks, self.config.max_inflight_bytes)

    def submit_store(
        self, items: list[tuple[bytes, object]], encode=None, on_done=None
    ) -> int:
        """Queue ``(key, payload)`` pairs, in prefix order: the leading items
        that fit under ``max_inflight_bytes`` are admitted; from the first
        one that does not, the rest are dropped (a block is useless without
        its predecessors).  ``encode(key, payload)`` runs on the store
        thread and returns the value: one buffer, or a tuple of buffers
        sent back to back (a header and the payload, never joined); ``None``:
        payloads are the values.  ``on_done(outcome)`` is called once when
        the payloads are no longer needed (on the store thread, or here if
        none is admitted), with a ``StoreOutcome``: how many values are in
        the pool now.  ``drain`` counts the job as done only once it has
        returned.  The payloads are read (encoded, sent) only until
        ``cancel_stores``.  Returns the number admitted (0: all
        dropped)."""
        self._need_io_threads()
        open_ = self.writes_open()
        with self._lock:
            admitted, size = 0, 0
            if open_:
                room = self.config.max_inflight_bytes - self._inflight
                for _, value in items:
                    if size + len(value) > room:
                        break
                    size += len(value)
                    admitted += 1
            dropped = len(items) - admitted
            self.stats.dropped_stores += dropped
            self._inflight += size
            job = None
            if admitted:
                job = StoreJob(items[:admitted], size, encode, on_done, len(items))
                self._store_jobs.add(job)
        if dropped and open_:
            self._warn_dropped(
                "store", admitted, dropped, self.config.max_inflight_bytes
            )
        if job is not None:
            self._store_q.put(job)
        elif on_done is not None:
            on_done(StoreOutcome(len(items)))
        return admitted

    def cancel_stores(self, timeout_s: float) -> int:
        """Stop every store not yet done from reading its payloads (a drain
        past its deadline: the caller is about to reuse that memory).  A
        read under way (encoding one value, or one send of its bytes: a
        copy into the kernel) ends first: waited for, ``timeout_s`` in
        all.  Once this returns, no payload of a cancelled store is read:
        one not encoded yet is never sent, and one cut short on the wire
        never reaches the server whole (its connection is reset), so a
        value that lands holds the bytes it was encoded from.  A cancelled
        store's ``on_done`` still runs once, with what it wrote.  Returns
        how many could not be stopped in time (a thread wedged inside one
        read; they still may read)."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            jobs = list(self._store_jobs)
        return sum(
            1
            for job in jobs
            if not job.guard.cancel(max(0.001, deadline - time.monotonic()))
        )

    def _warn_dropped(self, what: str, kept: int, dropped: int, limit: int) -> None:
        self._log.log(
            logging.WARNING,
            "dropped",
            "vllm-overlay KV pool %s: %s of %d block(s): %d admitted, %d dropped "
            "(over the in-flight limit of %d B%s); stats count every block",
            self.config.redacted_url,
            what,
            kept + dropped,
            kept,
            dropped,
            limit,
            "; dropped blocks are recomputed" if what == "load" else "",
        )

    def submit_delete(self, keys: list[bytes]) -> None:
        """Remove values that failed their check (background; bounded: past
        ``MAX_QUEUED_DELETES`` queued keys, a later load refuses again)."""
        self._need_io_threads()
        with self._lock:
            if self._queued_deletes + len(keys) > MAX_QUEUED_DELETES:
                return
            self._queued_deletes += len(keys)
        self._store_q.put(("delete", keys))

    def _stores_idle(self) -> bool:
        """No store queued or in flight (``drain``; the caller holds
        ``_lock``)."""
        return self._inflight == 0 and self._store_q.empty()

    def _abandon_store(self, job) -> None:
        """A store or delete job its thread will not run (closed)."""
        if isinstance(job, StoreJob):
            self._release_store(job)
        else:
            with self._lock:
                self._queued_deletes -= len(job[1])

    def _release_store(self, job: StoreJob) -> None:
        """Once per store job: ``on_done`` runs, then its bytes leave the
        limit (in that order: ``drain`` sees the job done only once its
        caller has its outcome)."""
        with self._lock:
            if job.released:
                return
            job.released = True
            self._store_jobs.discard(job)
        try:
            if job.on_done is not None:
                job.on_done(job.outcome())
        except Exception as exc:  # noqa: BLE001 - a bug: logged, go on
            self._internal("store callback", exc)
        finally:
            with self._lock:
                self._inflight -= job.size

    def _delete(self, client, keys: list[bytes]) -> None:
        with self._lock:
            self._queued_deletes -= len(keys)
        if not self.writes_open():
            return  # a later load refuses the value again
        try:
            pipe = client.pipeline(transaction=False)
            for key in keys:
                pipe.delete(key)
            pipe.execute()
        except Exception as exc:  # noqa: BLE001
            self._failed(exc, "delete", WRITE)

    def _store(self, client, job) -> None:
        if isinstance(job, tuple):
            self._delete(client, job[1])
            return
        items, encode, guard = job.items, job.encode, job.guard
        stored = 0
        answered: list[int] = []  # sizes of the values the server took
        try:
            if not self.writes_open() or guard.cancelled:
                with self._lock:
                    self.stats.dropped_stores += len(items)
                return
            start = time.perf_counter()
            deadline = time.monotonic() + self.config.io_timeout_s
            present = exchange(
                client,
                self.config.cluster,
                [(key, [command(b"EXISTS", key)], None) for key, _ in items],
                deadline=deadline,
            )
            if (failure := first_failure(present)) is not None:
                raise failure
            todo = [(k, v) for (k, v), p in zip(items, present) if not p]
            job.present = len(items) - len(todo)
            values = []
            for key, payload in todo:
                with guard.lock:  # (cancel_stores: no read after it)
                    if guard.cancelled:
                        raise Cancelled()
                    value = encode(key, payload) if encode else payload
                parts = list(value) if isinstance(value, (tuple, list)) else [value]
                values.append((key, parts, sum(memoryview(p).nbytes for p in parts)))
            answers = exchange(
                client,
                self.config.cluster,
                [
                    (
                        key,
                        self._set_command(key, parts, n),
                        None,
                        lambda _, n=n: answered.append(n),  # before any failure
                    )
                    for key, parts, n in values
                ],
                deadline=deadline,
                send_guard=guard,
            )
            elapsed = time.perf_counter() - start
            stored = sum(1 for a in answers if not isinstance(a, Exception))
            job.written = stored
            job.failed = len(values) - stored  # refused by the server
            with self._lock:
                self.stats.stored_blocks += stored
                self.stats.dropped_stores += len(values) - stored
                self.stats.skipped_existing += len(items) - len(todo)
                self.stats.bytes_out += sum(
                    n
                    for (_, _, n), a in zip(values, answers)
                    if not isinstance(a, Exception)
                )
                self.stats.io_seconds_out += elapsed
            stored = len(items)  # every item is accounted for now
            answered.clear()
            if (failure := first_failure(answers)) is not None:
                self._failed(failure, "store", WRITE)
            else:
                self._ok(WRITE)
        except Exception as exc:  # noqa: BLE001
            job.written += len(answered)
            job.failed = len(items) - job.present - job.written  # (tried)
            with self._lock:  # (answered: stored before the exchange failed)
                self.stats.stored_blocks += len(answered)
                self.stats.bytes_out += sum(answered)
                self.stats.dropped_stores += len(items) - stored - len(answered)
            if not guard.cancelled:  # (cancelled: its caller gave up on it)
                self._failed(exc, "store", WRITE)
        finally:
            self._release_store(job)

    def _set_command(self, key: bytes, parts: list, length: int) -> list:
        """SET key value NX [EX ttl], the value sent as ``parts`` (no copy)."""
        ttl = self.config.ttl_s
        head = b"*%d\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (
            6 if ttl else 4,
            len(key),
            key,
            length,
        )
        tail = b"\r\n$2\r\nNX\r\n"
        if ttl:
            tail += b"$2\r\nEX\r\n$%d\r\n%d\r\n" % (len(b"%d" % ttl), ttl)
        return [head, *parts, tail]
