"""KVPool: block values in Redis/Valkey; every network call on a background
thread, so its callers (vLLM's scheduler and engine threads) never wait on
the network.

* ``submit_lookup(keys)`` returns a ``LookupTicket`` at once; the lookup
  thread answers it (pipelined EXISTS; tickets queued meanwhile share one
  round trip).  The caller polls ``ticket.done`` and gives up after
  ``lookup_wait_s`` (``abandon``), which marks the pool slow.
* ``submit_store(items, encode, on_done)``: queue ``(key, payload)`` pairs;
  the store thread encodes each payload (header, checksum, MAC) and writes
  it (EXISTS, then SET NX, the header and the payload sent as two buffers:
  never joined).  Admitted in prefix order up to ``max_inflight_bytes``.
* ``submit_load(job, keys, value_bytes, prepare, into, landed)`` /
  ``poll_loads()``: the load thread sends the GETs (one pipeline per
  server) and reads each value straight into the buffers ``into`` gives,
  calls ``landed`` on each value as it lands (checks) and ``prepare`` on
  them all, so the caller only consumes the result.  ``wait_for_loads``
  lets an idle engine sleep until a load is done.

Every job ends, and ends once: a load is done within ``io_timeout_s`` of
its submission or fails (its reads stop at the deadline; the watchdog
cancels one still running after it and hands its caller the failure), and
an exception from a job fails that job only (its requests recompute; the
thread goes on).  A thread busy with one job past its deadline is stuck:
the pool pauses (lookups answer "miss" at once, loads fail at once) until
it is free and a PING answers.  ``health.py`` holds the gates and that
thread; ``transport.py`` the clients and raw pipelines; ``resp.py`` the
reply reader.  ``count_hits`` is a blocking convenience for tests and
tools, never for vLLM's threads.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import logging
import queue
import threading
import time

from vllm_overlay.core.pool.config import PoolConfig
from vllm_overlay.core.pool.errors import Failure, PoolStuck, PoolTooSlow, classify
from vllm_overlay.core.pool.health import READ, WRITE, Gates, Monitor, start_thread
from vllm_overlay.core.pool.ratelog import RateLimitedLog
from vllm_overlay.core.pool.resp import MAX_VALUE_BYTES, Guard, InPlace, command
from vllm_overlay.core.pool.transport import (
    Redirected,
    Unreachable,
    exchange,
    first_failure,
    make_client,
)

logger = logging.getLogger("vllm.overlay")

_STOP = object()
# Set by the load thread of every KVPool of this process when a load is
# done; ``KVPool.wait_for_loads`` waits on it (the engine, while it has
# nothing to run but requests waiting for their loads).
_LOADS_DONE = threading.Event()
MAX_QUEUED_LOOKUPS = 4096  # more waiting: answered "miss" at once
MAX_QUEUED_DELETES = 65536  # keys; more: dropped (a later load refuses again)
# Failure kinds counted in a PoolStats field of their own.
_KIND_FIELDS = {
    Failure.UNREACHABLE: "unreachable",
    Failure.SLOW: "slow",
    Failure.FULL: "full",
    Failure.READ_ONLY: "read_only",
    Failure.DENIED: "denied",
    Failure.BAD_REQUEST: "bad_requests",
}
GRACE_S = 1.0  # past a job's deadline before the watchdog steps in

__all__ = ["InPlace", "KVPool", "LookupTicket", "PoolStats", "make_client"]


@dataclasses.dataclass
class PoolStats:
    lookups: int = 0
    hits: int = 0  # blocks found by lookups
    misses: int = 0  # blocks not found (first gap ends a lookup)
    lookups_skipped: int = 0  # answered "miss" at once: reads paused, queue full
    lookup_timeouts: int = 0  # not answered within lookup_wait_s
    loaded_blocks: int = 0
    load_failures: int = 0  # missing or refused values on load
    load_timeouts: int = 0  # loads cancelled past io_timeout_s
    stored_blocks: int = 0
    skipped_existing: int = 0
    dropped_stores: int = 0  # over the in-flight limit, or writes paused
    limited_loads: int = 0  # blocks not loaded: over the in-flight load limit
    bad_signatures: int = 0  # values refused: unsigned, or a wrong MAC
    bad_keys: int = 0  # WRONGTYPE keys: a miss, deleted
    bytes_in: int = 0
    bytes_out: int = 0
    errors: int = 0
    internal_errors: int = 0  # bugs: that job failed, nothing paused
    stuck: int = 0  # times a pool thread was found stuck
    # failures by kind (errors.Failure; bad_keys, internal_errors and stuck
    # above are the other kinds), and pauses: reads or writes closed
    unreachable: int = 0
    slow: int = 0
    full: int = 0
    read_only: int = 0
    denied: int = 0
    bad_requests: int = 0
    pauses: int = 0
    io_seconds_in: float = 0.0
    io_seconds_out: float = 0.0

    def add(self, other: PoolStats) -> None:
        for field in dataclasses.fields(PoolStats):
            name = field.name
            setattr(self, name, getattr(self, name) + getattr(other, name))

    def as_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out["gb_per_s_in"] = (
            self.bytes_in / self.io_seconds_in / 1e9 if self.io_seconds_in else 0.0
        )
        out["gb_per_s_out"] = (
            self.bytes_out / self.io_seconds_out / 1e9 if self.io_seconds_out else 0.0
        )
        return out


class LookupTicket:
    """One lookup's answer: ``present`` (a bool per key) once ``done``;
    ``None`` when the pool could not answer (a miss)."""

    __slots__ = ("keys", "present", "done", "abandoned", "submitted")

    def __init__(self, keys: list[bytes]) -> None:
        self.keys = keys
        self.present: list[bool] | None = None
        self.done = False
        self.abandoned = False
        self.submitted = time.monotonic()

    def _finish(self, present: list[bool] | None) -> None:
        self.present = present
        self.done = True

    @property
    def hits(self) -> int:
        """Leading keys present (0 if the pool could not answer)."""
        if not self.present:
            return 0
        return next((i for i, p in enumerate(self.present) if not p), len(self.keys))


@dataclasses.dataclass(eq=False)
class _Load:
    job_id: object
    keys: list[bytes]
    n: int  # leading keys fetched
    size: int  # bytes reserved under the in-flight load limit
    prepare: object
    into: object
    landed: object
    value_bytes: int
    deadline: float
    guard: Guard = dataclasses.field(default_factory=Guard)
    delivered: bool = False


@dataclasses.dataclass(eq=False)
class _Store:
    items: list
    size: int
    encode: object
    on_done: object
    released: bool = False


class KVPool:
    """``io_threads=False``: no store or load threads (the scheduler's
    side).  ``lookups=True``: start the lookup thread now and let it connect
    in the background, so the first lookup does not pay for the connection
    (otherwise it starts with the first lookup)."""

    def __init__(
        self, config: PoolConfig, io_threads: bool = True, lookups: bool = False
    ) -> None:
        self.config = config
        self.stats = PoolStats()  # since the last take_stats()
        self.totals = PoolStats()  # since start, up to the last take_stats()
        self._lock = threading.Lock()
        self._gates = Gates(config.retry_backoff_s, config.max_retry_backoff_s)
        self._log = RateLimitedLog(logger, 30.0)
        self.misconfigured: str | None = None  # set by probe(): pool disabled
        self.server_is_cluster: bool | None = None
        self._inflight = 0
        self._inflight_load = 0
        self._pending_loads = 0
        self._queued_deletes = 0
        self._loads: set[_Load] = set()  # submitted, not delivered
        self._busy: dict[str, tuple[object, float]] = {}  # thread -> job, deadline
        self._loads_done: collections.deque = collections.deque()
        self._store_q: queue.Queue = queue.Queue()
        self._load_q: queue.Queue = queue.Queue()
        self._lookup_q: queue.Queue = queue.Queue(maxsize=MAX_QUEUED_LOOKUPS)
        self._closed = threading.Event()
        self._threads: dict[str, threading.Thread] = {}
        self._lookups_ready = False  # the lookup thread has connected (or failed)
        self._ping_client = None
        self._monitor = Monitor(
            self._gates,
            ping=self._ping,
            stuck=self._stuck,
            watchdog=self._watchdog,
            answer_s=config.lookup_wait_s,
            log_error=functools.partial(self._internal, "health check"),
            on_reopen=self._reopened,
        )
        self._io = io_threads
        self._start(self._monitor.run, "health")
        if io_threads:
            self._start(self._run, "store", self._store_q, self._store)
            self._start(self._run, "load", self._load_q, self._load)
        if lookups:
            self._start_lookups()

    def _start(self, target, what: str, *args) -> None:
        self._threads[what] = start_thread(
            target, f"vllm-overlay-pool-{what}", *args, *((what,) if args else ())
        )

    def threads_alive(self) -> dict[str, bool]:
        """Pool thread -> alive (every one should be, until ``close``)."""
        return {name: t.is_alive() for name, t in self._threads.items()}

    def _need_io_threads(self) -> None:
        if not self._io:
            raise RuntimeError(
                "this KVPool was created for lookups only "
                "(io_threads=False): it cannot store or load"
            )

    def check_value_size(self, value_bytes: int) -> None:
        """Startup check (the worker knows its value size once the KV cache
        is registered): every limit must hold at least one value, or nothing
        would ever be stored or loaded."""
        for name, limit in (
            ("max_inflight_bytes", self.config.max_inflight_bytes),
            ("max_inflight_load_bytes", self.config.load_limit_bytes),
        ):
            if limit < value_bytes:
                raise ValueError(
                    f"KV pool: {name} ({limit} B) is smaller than one value "
                    f"({value_bytes} B: one block of every layer of this "
                    f"worker, with its header); nothing could ever be "
                    f"{'stored' if name == 'max_inflight_bytes' else 'loaded'}. "
                    f"Set it to at least {value_bytes} (it is host memory "
                    "allocated at startup)"
                )

    # -- health -----------------------------------------------------------
    def reads_open(self) -> bool:
        """Lookups and loads go to the network now."""
        return self.misconfigured is None and self._gates.is_open(READ)

    def writes_open(self) -> bool:
        """Stores go to the network now."""
        return self.misconfigured is None and self._gates.is_open(WRITE)

    def is_down(self) -> bool:
        return not self.reads_open()

    def state(self) -> dict[str, str]:
        """``{"read": "open" | <failure kind>, "write": ...}``."""
        out = {}
        for direction in (READ, WRITE):
            if self.misconfigured is not None:
                out[direction] = "misconfigured"
            elif self._gates.is_open(direction):
                out[direction] = "open"
            else:
                out[direction] = self._gates.reason(direction).value
        return out

    def _failed(self, exc: BaseException, what: str, direction: str) -> Failure:
        """Count, classify and react to a failure; returns its kind."""
        kind = classify(exc)
        with self._lock:
            self.stats.errors += 1
            self.stats.bad_keys += kind is Failure.BAD_KEY
            self.stats.internal_errors += kind is Failure.INTERNAL
            self.stats.stuck += kind is Failure.STUCK
            field = _KIND_FIELDS.get(kind)
            if field is not None:
                setattr(self.stats, field, getattr(self.stats, field) + 1)
        if kind is Failure.INTERNAL:
            self._internal(what, exc)
            return kind
        closed, pause = self._gates.close(kind, direction, what == "connect")
        if closed:
            with self._lock:
                self.stats.pauses += 1
        if kind.whole_pool:
            self._monitor.wake.set()
        paused = (
            "reads and writes"
            if len(closed) == 2
            else "writes"
            if kind.writes_only
            else f"{direction}s"
        )
        self._log.log(
            logging.ERROR if kind.long_pause else logging.WARNING,
            kind,
            "vllm-overlay KV pool %s: %s failed, %s (%s: %s); %s; requests "
            "recompute instead",
            self.config.redacted_url,
            what,
            kind.value,
            type(exc).__name__,
            self.config.redact(str(exc)),
            f"{paused} paused for {pause:.1f}s"
            + (" (until a PING answers)" if kind.whole_pool else "")
            if closed
            else "this key only",
        )
        return kind

    def _internal(self, what: str, exc: BaseException) -> None:
        """A bug, not the server's doing: logged with its traceback; the
        job it happened in failed (its requests recompute), nothing pauses."""
        self._log.log(
            logging.ERROR,
            ("internal", what),
            "vllm-overlay KV pool %s: %s failed with an internal error (%s: %s), "
            "not the server's doing; that job's requests recompute, the pool "
            "goes on",
            self.config.redacted_url,
            what,
            type(exc).__name__,
            self.config.redact(str(exc)),
            exc_info=exc,
        )

    def _ok(self, direction: str) -> None:
        self._gates.ok(direction)

    def _ping(self) -> None:
        """PING within the monitor: every node of a cluster answers."""
        try:
            if self._ping_client is None:
                self._ping_client = make_client(self.config)
            if self.config.cluster:
                self._ping_client.ping(target_nodes=self._ping_client.ALL_NODES)
            else:
                self._ping_client.ping()
        except Exception:
            if self._ping_client is not None:
                with contextlib.suppress(Exception):
                    self._ping_client.close()
                self._ping_client = None
            raise

    def _reopened(self, ping_ms: float) -> None:
        logger.info(
            "vllm-overlay KV pool %s answers again (PING %.1f ms): "
            "lookups, loads and stores resume",
            self.config.redacted_url,
            ping_ms,
        )

    def _stuck(self) -> str | None:
        """A pool thread busy with one job past its deadline, or None."""
        now = time.monotonic()
        with self._lock:
            busy = list(self._busy.items())
        return next((what for what, (_, end) in busy if now > end + GRACE_S), None)

    def _watchdog(self) -> None:
        """Loads past their deadline (a stuck thread, or queued behind one)
        are cancelled and handed to their caller as failed; a stuck thread
        pauses the pool."""
        now = time.monotonic()
        with self._lock:
            late = [job for job in self._loads if now > job.deadline + GRACE_S]
        for job in late:
            if job.guard.cancel(timeout_s=0.05):
                with self._lock:
                    self.stats.load_timeouts += 1
                self._deliver(job, [None] * len(job.keys))
        who = self._stuck()
        if who is not None and self._gates.reason(READ) is not Failure.STUCK:
            self._failed(
                PoolStuck(f"the {who} thread is busy with one job past its deadline"),
                who,
                READ,
            )

    def probe(self) -> threading.Thread:
        """Check once, in the background, that the pool answers and that it
        is a cluster exactly when ``cluster`` says so; log one warning naming
        the (redacted) URL if it does not answer (and pause the pool until a
        PING answers).  A cluster mismatch is a configuration error: logged
        as such, and the pool is disabled (``misconfigured``; every request
        recomputes) instead of failing on every lookup.  Never blocks the
        caller."""

        def run() -> None:
            try:
                client = make_client(self.config, single_node=True)
                try:
                    client.ping()
                    info = client.info("cluster")
                finally:
                    client.close()
            except Exception as exc:  # noqa: BLE001 - any failure is reported
                logger.warning(
                    "vllm-overlay KV pool %s cannot be reached at startup "
                    "(%s: %s); requests recompute until it can",
                    self.config.redacted_url,
                    type(exc).__name__,
                    self.config.redact(str(exc)),
                )
                self._log.mark(classify(exc))  # the warning above says it all
                self._failed(exc, "startup check", READ)
                return
            self.server_is_cluster = bool(int(info.get("cluster_enabled", 0)))
            if self.server_is_cluster != self.config.cluster:
                self.misconfigured = (
                    f"cluster is {str(self.config.cluster).lower()} but the "
                    f"server {'is' if self.server_is_cluster else 'is not'} "
                    "a cluster node (INFO cluster: cluster_enabled:"
                    f"{int(self.server_is_cluster)}); set cluster to "
                    f"{str(self.server_is_cluster).lower()}"
                )
                logger.error(
                    "vllm-overlay KV pool %s: configuration error: %s. The pool "
                    "is disabled; requests recompute.",
                    self.config.redacted_url,
                    self.misconfigured,
                )

        return start_thread(run, "vllm-overlay-pool-probe")

    # -- lookups ------------------------------------------------------------
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
                    MAX_QUEUED_LOOKUPS,
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
        stop = _STOP in batch
        live = [t for t in batch if t is not _STOP and not t.abandoned]
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
                if ticket is not _STOP and not ticket.done:
                    ticket._finish(None)
            if stop:
                self._lookup_q.put(_STOP)

    # -- stores -------------------------------------------------------------
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
        payloads are the values.  ``on_done()`` is called once when the
        payloads are no longer needed (on the store thread, or here if none
        is admitted).  Returns the number admitted (0: all dropped)."""
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
        if dropped and open_:
            self._warn_dropped(
                "store", admitted, dropped, self.config.max_inflight_bytes
            )
        if admitted:
            self._store_q.put(_Store(items[:admitted], size, encode, on_done))
        elif on_done is not None:
            on_done()
        return admitted

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

    def _release_store(self, job: _Store) -> None:
        """Once per store job: its bytes leave the limit, ``on_done`` runs."""
        with self._lock:
            if job.released:
                return
            job.released = True
            self._inflight -= job.size
        if job.on_done is not None:
            try:
                job.on_done()
            except Exception as exc:  # noqa: BLE001 - a bug: logged, go on
                self._internal("store callback", exc)

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
        items, encode = job.items, job.encode
        stored = 0
        try:
            if not self.writes_open():
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
            values = []
            for key, payload in todo:
                value = encode(key, payload) if encode else payload
                parts = list(value) if isinstance(value, (tuple, list)) else [value]
                values.append((key, parts, sum(memoryview(p).nbytes for p in parts)))
            answers = exchange(
                client,
                self.config.cluster,
                [
                    (key, self._set_command(key, parts, n), None)
                    for key, parts, n in values
                ],
                deadline=deadline,
            )
            elapsed = time.perf_counter() - start
            stored = sum(1 for a in answers if not isinstance(a, Exception))
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
            if (failure := first_failure(answers)) is not None:
                self._failed(failure, "store", WRITE)
            else:
                self._ok(WRITE)
        except Exception as exc:  # noqa: BLE001
            with self._lock:
                self.stats.dropped_stores += len(items) - stored
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

    # -- loads ----------------------------------------------------------------
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
            job = _Load(
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
            self._deliver(job, [None] * len(keys))
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
        if _LOADS_DONE.wait(timeout_s):
            _LOADS_DONE.clear()
            return True
        return False

    def _deliver(self, job: _Load, values: list) -> None:
        """Hand a load's result to its caller, once (the load thread, or the
        watchdog for a load past its deadline, whichever is first)."""
        with self._lock:
            if job.delivered:
                return
            job.delivered = True
            self._loads.discard(job)
            self._pending_loads -= 1
            self._inflight_load -= job.size
        result = values
        if job.prepare is not None:
            try:
                result = job.prepare(values)
            except Exception as exc:  # noqa: BLE001 - a bug: the caller sees None
                self._internal("preparing a load", exc)
                result = None
        self._loads_done.append((job.job_id, result))
        _LOADS_DONE.set()

    def _load(self, client, job: _Load) -> None:
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
                    + (() if landed is None else (functools.partial(landed, i),))
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

    # -- threads ----------------------------------------------------------------
    def _job_deadline(self, what: str, job) -> float:
        if isinstance(job, _Load):
            return job.deadline
        now = time.monotonic()
        if what == "lookup":
            return now + self.config.lookup_wait_s + self.config.timeout_s
        return now + self.config.io_timeout_s + self.config.timeout_s

    def _run(self, jobs: queue.Queue, handle, what: str) -> None:
        """A pool thread: never dies of a job (an exception fails that job
        only: ``handle`` ends every job it is given, even by raising)."""
        client = None
        direction = WRITE if what == "store" else READ
        # Connect, and run one pipeline (redis-py imports lazily on first
        # use), before the first job needs it.
        try:
            client = make_client(self.config)
            pipe = client.pipeline(transaction=False)
            pipe.exists(b"vkv:warm-up")
            pipe.execute()
        except Exception as exc:  # noqa: BLE001
            self._failed(exc, "connect", direction)
        if what == "lookup":
            self._lookups_ready = True
        while True:
            job = jobs.get()
            if job is _STOP:
                break
            with self._lock:
                self._busy[what] = (job, self._job_deadline(what, job))
            try:
                if client is None and (
                    self.reads_open() if direction == READ else self.writes_open()
                ):
                    try:
                        client = make_client(self.config)
                    except Exception as exc:  # noqa: BLE001
                        self._failed(exc, "connect", direction)
                # Without a client the handler sees the gate closed or fails.
                handle(client if client is not None else Unreachable(), job)
            except Exception as exc:  # noqa: BLE001 - a handler's own bug
                self._internal(what, exc)
            finally:
                with self._lock:
                    self._busy.pop(what, None)
        if client is not None:
            with contextlib.suppress(Exception):
                client.close()

    def drain(self, timeout_s: float = 10.0) -> bool:
        """Wait until queued stores and loads are done (tests, shutdown)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self._lock:
                if (
                    self._inflight == 0
                    and self._pending_loads == 0
                    and self._store_q.empty()
                ):
                    return True
            time.sleep(0.01)
        return False

    def close(self) -> None:
        self._closed.set()
        self._monitor.closed.set()
        self._monitor.wake.set()
        for q in (self._store_q, self._load_q, self._lookup_q):
            with contextlib.suppress(queue.Full):
                q.put_nowait(_STOP)
        for thread in self._threads.values():
            thread.join(timeout=5)

    def take_stats(self) -> PoolStats:
        """The stats since the last call (vLLM's metrics report these)."""
        with self._lock:
            stats, self.stats = self.stats, PoolStats()
            self.totals.add(stats)
        return stats

    def cumulative(self) -> dict:
        """Totals since start, including the current interval (leaves the
        interval to ``take_stats``)."""
        with self._lock:
            total = PoolStats()
            total.add(self.totals)
            total.add(self.stats)
        return total.as_dict()
