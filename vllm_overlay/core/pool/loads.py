"""The pool's loads: ``submit_load(job, keys, value_bytes, prepare, into,
landed)`` / ``poll_loads()``: the load thread sends the GETs (one pipeline
per server) and reads each value straight into the buffers ``into`` gives,
calls ``landed`` on each value as it lands (checks) and ``prepare`` on
them all, so the caller only consumes the result.  ``wait_for_loads`` lets
an idle engine sleep until a load is done.  A mixin of ``KVPool``
(pool.py), whose constructor sets the state named below."""

from __future__ import annotations

import collections
import functools
import queue
import threading
import time

from vllm_overlay.core.pool.config import PoolConfig
from vllm_overlay.core.pool.errors import Failure
from vllm_overlay.core.pool.health import READ
from vllm_overlay.core.pool.jobs import LoadJob
from vllm_overlay.core.pool.resp import MAX_VALUE_BYTES, Cancelled, command
from vllm_overlay.core.pool.stats import PoolStats
from vllm_overlay.core.pool.transport import Redirected, exchange

# Set by the load thread of every KVPool of this process when a load is
# done; ``KVPool.wait_for_loads`` waits on it (the engine, while it has
# nothing to run but requests waiting for their loads).
LOADS_DONE = threading.Event()


class PoolLoads:
    """Owns ``_inflight_load``, ``_pending_loads``, ``_loads`` (submitted,
    not delivered) and ``_loads_done``: only its methods write them, under
    ``_lock`` (``_loads_done`` is a deque: appended on a pool thread,
    popped by ``poll_loads``).  Reads ``config`` and ``on_result``; puts
    jobs on ``_load_q``; counts ``stats.limited_loads``, ``load_timeouts``,
    ``bytes_in``, ``io_seconds_in``, ``loaded_blocks``, ``load_failures``,
    ``bad_signatures``.  Calls ``reads_open``, ``_failed``, ``_ok``,
    ``_internal`` (failures.py), ``_need_io_threads`` (pool.py),
    ``submit_delete`` and ``_warn_dropped`` (stores.py).  Its interface to
    the other parts: ``_fail_load`` (pool.py's ``_abandon``),
    ``_loads_idle`` (``drain``), ``_cancel_late_loads`` (``_watchdog``).

    A load writes into its memory (``into``'s buffers) only under its
    job's ``guard.lock`` and while the job is not cancelled: each write
    (``resp.RespReader``) and ``prepare`` (which may write: the 0.11.2
    connector zeroes refused blocks).  Its result is made once, by one
    thread: the load thread (under that lock, queued before the lock is
    let go), or whoever cancelled it (``cancel_loads``, the watchdog), as
    failed."""

    config: PoolConfig
    stats: PoolStats
    _lock: threading.Lock
    _inflight_load: int
    _pending_loads: int
    _loads: set
    _loads_done: collections.deque
    _load_q: queue.Queue
    on_result: object

    def submit_load(
        self,
        job_id,
        keys: list[bytes],
        value_bytes: int = 0,
        prepare=None,
        into=None,
        max_keys: int | None = None,
        landed=None,
    ) -> int:
        """Fetch ``keys`` in the background.  With ``value_bytes`` (the size
        of one value), only the leading keys that fit under the in-flight
        load limit (and ``max_keys``) are fetched; the others come back as
        None, so the caller reports them as load errors and vLLM recomputes
        them.  While reads are paused none is fetched (the job is done at
        once).  ``into(i, length)`` may give the buffers (a list of writable
        memoryviews of ``length`` bytes in all) that value ``i`` is read
        into, straight from the socket: it then comes back as an
        ``InPlace``; otherwise (or when ``into`` answers None) as bytes (at
        most ``value_bytes`` of them: a longer value comes back as an
        ``Oversized``).  ``landed(i, value)`` runs on the load thread as
        soon as value ``i`` is read, before the next one is parsed.
        ``prepare`` (values -> anything) runs once all are read (or the job
        failed); ``poll_loads`` then returns its result instead of the
        values.  The job is done within ``io_timeout_s`` (plus a second)
        whatever the server does.  Returns the number of keys fetched."""
        self._need_io_threads()
        limit = self.config.load_limit_bytes
        with self._lock:
            n = len(keys) if max_keys is None else min(len(keys), max_keys)
            if value_bytes:
                room = max(0, limit - self._inflight_load)
                n = min(n, room // value_bytes)
            limited = len(keys) - n
            if not self.reads_open():
                n = 0
            size = n * value_bytes
            self._inflight_load += size
            self.stats.limited_loads += limited
            self._pending_loads += 1
            job = LoadJob(
                job_id,
                keys,
                n,
                size,
                prepare,
                into,
                landed,
                value_bytes,
                time.monotonic() + self.config.io_timeout_s,
            )
            self._loads.add(job)
        if limited and n:
            self._warn_dropped("load", n, limited, limit)
        if n:
            self._load_q.put(job)
        else:  # nothing to fetch: done now (prepare sees no values)
            self._fail_load(job)
        return n

    def poll_loads(self) -> list[tuple[object, object]]:
        done = []
        while self._loads_done:
            done.append(self._loads_done.popleft())
        return done

    def wait_for_loads(self, timeout_s: float) -> bool:
        """Wait at most ``timeout_s`` for a load of any pool of this process
        to be done (for an engine with nothing else to do); True if one was.
        Waits on nothing but that signal (never the network)."""
        if LOADS_DONE.wait(timeout_s):
            LOADS_DONE.clear()
            return True
        return False

    def cancel_loads(self, timeout_s: float) -> list:
        """Give up on every load whose result is not queued yet (a drain
        past its deadline): each stops touching its buffers (a write, a
        check or a result under way ends first: waited for, ``timeout_s``
        in all), and its result is queued now: failed, or the one its load
        thread had just made.  Returns the ids of those that could not be
        stopped in time (still pending; queued when their thread lets
        go)."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            jobs = [job for job in self._loads if not job.delivered]
        left = []
        for job in jobs:
            if job.guard.cancel(timeout_s=max(0.001, deadline - time.monotonic())):
                self._fail_load(job)
            else:
                left.append(job.job_id)
        return left

    def _loads_idle(self) -> bool:
        """Every submitted load's result is queued (``drain``; the caller
        holds ``_lock``)."""
        return self._pending_loads == 0

    def _cancel_late_loads(self, grace_s: float) -> None:
        """For the watchdog: loads more than ``grace_s`` past their deadline
        (a stuck thread, or queued behind one) are cancelled and handed to
        their caller as failed."""
        now = time.monotonic()
        with self._lock:
            late = [job for job in self._loads if now > job.deadline + grace_s]
        for job in late:
            if job.guard.cancel(timeout_s=0.05) and self._fail_load(job):
                with self._lock:
                    self.stats.load_timeouts += 1

    def _claim(self, job: LoadJob) -> bool:
        """True for the one caller that makes the job's result."""
        with self._lock:
            if job.claimed:
                return False
            job.claimed = True
            return True

    def _deliver(self, job: LoadJob, values: list) -> None:
        """The load thread, done with the job: its result, made and queued
        under the job's guard (``_fail_load`` makes it instead once the
        job is cancelled)."""
        with job.guard.lock:
            if job.guard.cancelled or not self._claim(job):
                return
            self._queue(job, self._prepare(job, values))
        self._signal()

    def _fail_load(self, job: LoadJob) -> bool:
        """The job's result as failed (no value), unless its result is
        made already (the job is cancelled, or never ran: nothing touches
        its buffers).  True if this call made it."""
        if not self._claim(job):
            return False
        self._queue(job, self._prepare(job, [None] * len(job.keys)))
        self._signal()
        return True

    def _prepare(self, job: LoadJob, values: list):
        if job.prepare is None:
            return values
        try:
            return job.prepare(values)
        except Exception as exc:  # noqa: BLE001 - a bug: the caller sees None
            self._internal("preparing a load", exc)
            return None

    def _queue(self, job: LoadJob, result) -> None:
        """Hand a load's result to its caller (``poll_loads``).  The job
        counts as pending (``drain``) until then."""
        with self._lock:
            job.delivered = True
            self._loads.discard(job)
            self._inflight_load -= job.size
            self._loads_done.append((job.job_id, result))
            self._pending_loads -= 1

    def _signal(self) -> None:
        LOADS_DONE.set()
        if self.on_result is not None:
            self.on_result()

    def _landed(self, job: LoadJob, i: int, value) -> None:
        """Value ``i`` of the job landed: checked, unless the job is
        cancelled (then it stops).  Not under the guard: a check only
        reads, and a check that hangs must not keep the watchdog from
        failing the load in time; what a check finds after a cancel is
        never used (the canceller's result has no value)."""
        if job.guard.cancelled:
            raise Cancelled()
        job.landed(i, value)

    def _load(self, client, job: LoadJob) -> None:
        keys, n, into, landed = job.keys, job.n, job.into, job.landed
        values: list = [None] * len(keys)
        try:
            if not self.reads_open() or job.guard.cancelled:
                return
            start = time.perf_counter()
            answers = exchange(
                client,
                self.config.cluster,
                [
                    (
                        key,
                        [command(b"GET", key)],
                        None if into is None else functools.partial(into, i),
                    )
                    + (
                        ()
                        if landed is None
                        else (functools.partial(self._landed, job, i),)
                    )
                    for i, key in enumerate(keys[:n])
                ],
                deadline=job.deadline,
                guard=job.guard,
                max_bulk_bytes=job.value_bytes or MAX_VALUE_BYTES,
            )
            bad_keys = []
            for i, answer in enumerate(answers):
                if isinstance(answer, Redirected):
                    continue  # a cluster moving slots: a miss, no pause
                if isinstance(answer, Exception):
                    if self._failed(answer, "load", READ) is Failure.BAD_KEY:
                        bad_keys.append(keys[i])
                elif answer is not None:
                    values[i] = answer
            if bad_keys:
                self.submit_delete(bad_keys)
            with self._lock:
                self.stats.bytes_in += sum(len(v) for v in values if v is not None)
                self.stats.io_seconds_in += time.perf_counter() - start
            self._ok(READ)
        except Exception as exc:  # noqa: BLE001 - this job fails, nothing else
            values = [None] * len(keys)
            if not job.guard.cancelled:  # (cancelled: the watchdog said so)
                self._failed(exc, "load", READ)
        finally:
            self._deliver(job, values)

    def record_load(self, loaded: int, failed: int, bad_signatures: int = 0) -> None:
        with self._lock:
            self.stats.loaded_blocks += loaded
            self.stats.load_failures += failed
            self.stats.bad_signatures += bad_signatures
