"""KVPool: block values in Redis/Valkey; every network call on a background
thread, so its callers (vLLM's scheduler and engine threads) never wait on
the network.

* ``submit_lookup(keys)`` returns a ``LookupTicket`` at once; the lookup
  thread answers it (pipelined EXISTS; tickets queued meanwhile share one
  round trip).  The caller polls ``ticket.done`` and gives up after
  ``lookup_wait_s`` (``abandon``), which marks the pool slow.
* ``submit_store(items, encode, on_done)``: queue ``(key, payload)`` pairs;
  the store thread encodes each payload (header, CRC, MAC) and writes it
  (EXISTS, then SET NX, the header and the payload sent as two buffers:
  never joined).  Admitted in prefix order up to ``max_inflight_bytes``.
* ``submit_load(job, keys, value_bytes, prepare, into, landed)`` /
  ``poll_loads()``: the load thread sends the GETs (one pipeline per
  server) and reads each value straight into the buffers ``into`` gives
  (``RespReader``: ``recv_into`` the caller's memory), calls ``landed`` on
  each value as it lands (checks) and ``prepare`` on them all, so the
  caller only consumes the result.  ``wait_for_loads`` lets an idle engine
  sleep until a load is done.
* The raw pipelines use redis-py's own connections (its connect, AUTH,
  TLS, health checks and cluster slot map); lookups and deletes use
  redis-py's pipeline.
* Health (``errors.py`` lists the kinds): reads and writes each have a gate.
  Unreachable or slow closes both; only the health thread reopens them,
  after a back-off, when a PING answers (in time) - no request is ever used
  as a probe.  Full or read-only closes writes; denied or a bad request
  closes the direction it happened in; those reopen after their back-off.
  A bad key (WRONGTYPE) loses its block only, and is deleted.
  ``count_hits`` is a blocking convenience for tests and tools, never for
  vLLM's threads.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import logging
import queue
import socket
import threading
import time

from vllm_overlay.core.pool.config import PoolConfig
from vllm_overlay.core.pool.errors import Failure, PoolTooSlow, classify

logger = logging.getLogger("vllm.overlay")

_STOP = object()
READ, WRITE = "read", "write"
# Set by the load thread of every KVPool of this process when a load is
# done; ``KVPool.wait_for_loads`` waits on it (the engine, while it has
# nothing to run but requests waiting for their loads).
_LOADS_DONE = threading.Event()
_SMALL_CHUNK = 64 << 10  # command pieces shorter than this are sent joined


@dataclasses.dataclass
class PoolStats:
    lookups: int = 0
    hits: int = 0  # blocks found by lookups
    misses: int = 0  # blocks not found (first gap ends a lookup)
    lookups_skipped: int = 0  # answered "miss" at once: reads paused
    lookup_timeouts: int = 0  # not answered within lookup_wait_s
    loaded_blocks: int = 0
    load_failures: int = 0  # missing or refused values on load
    stored_blocks: int = 0
    skipped_existing: int = 0
    dropped_stores: int = 0  # over the in-flight limit, or writes paused
    limited_loads: int = 0  # blocks not loaded: over the in-flight load limit
    bad_signatures: int = 0  # values refused: unsigned, or a wrong MAC
    bad_keys: int = 0  # WRONGTYPE keys: a miss, deleted
    bytes_in: int = 0
    bytes_out: int = 0
    errors: int = 0
    io_seconds_in: float = 0.0
    io_seconds_out: float = 0.0

    def as_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out["gb_per_s_in"] = (
            self.bytes_in / self.io_seconds_in / 1e9 if self.io_seconds_in else 0.0
        )
        out["gb_per_s_out"] = (
            self.bytes_out / self.io_seconds_out / 1e9 if self.io_seconds_out else 0.0
        )
        return out


def make_client(config: PoolConfig, single_node: bool = False):
    """A client built from the config's parsed URL (``single_node``: a plain
    client even for a cluster, as the startup probe needs).  No client-side
    retries: the pool pauses and probes by itself."""
    import redis

    kwargs = config.client_kwargs()
    if config.cluster and not single_node:
        from redis.backoff import NoBackoff
        from redis.cluster import RedisCluster
        from redis.retry import Retry

        # One retry lets the client follow a failover (slots moved).
        return RedisCluster(retry=Retry(NoBackoff(), 1), **kwargs)
    kwargs.setdefault("db", 0)
    return redis.Redis(retry=None, **kwargs)


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


@dataclasses.dataclass
class _Gate:
    """Whether reads (or writes) go to the network now."""

    backoff: float
    reason: Failure | None = None
    until: float = 0.0


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
        self._gates = {
            READ: _Gate(config.retry_backoff_s),
            WRITE: _Gate(config.retry_backoff_s),
        }
        self._last_warning: dict[Failure, float] = {}
        self._last_drop_warning = 0.0
        self.misconfigured: str | None = None  # set by probe(): pool disabled
        self.server_is_cluster: bool | None = None
        self._inflight = 0
        self._inflight_load = 0
        self._pending_loads = 0
        self._loads_done: collections.deque = collections.deque()
        self._store_q: queue.Queue = queue.Queue()
        self._load_q: queue.Queue = queue.Queue()
        self._lookup_q: queue.Queue = queue.Queue()
        self._closed = threading.Event()
        self._wake_health = threading.Event()
        self._threads: list[threading.Thread] = []
        self._lookup_thread: threading.Thread | None = None
        self._lookups_ready = False  # the lookup thread has connected (or failed)
        self._health_thread: threading.Thread | None = None
        self._io = io_threads
        if io_threads:
            self._start(self._run, self._store_q, self._store, "store")
            self._start(self._run, self._load_q, self._load, "load")
        if lookups:
            self._start_lookups()

    def _start(self, target, *args) -> threading.Thread:
        thread = threading.Thread(
            target=target,
            args=args,
            name=f"vllm-overlay-pool-{args[-1]}",
            daemon=True,
        )
        thread.start()
        self._threads.append(thread)
        return thread

    def _need_io_threads(self) -> None:
        if not self._io:
            raise RuntimeError(
                "this KVPool was created for lookups only "
                "(io_threads=False): it cannot store or load"
            )

    # -- health -----------------------------------------------------------
    def _open(self, direction: str) -> bool:
        if self.misconfigured is not None:
            return False
        gate = self._gates[direction]
        if gate.reason is None:
            return True
        if gate.reason.whole_pool:  # only the health thread reopens it
            return False
        if time.monotonic() >= gate.until:
            with self._lock:
                if gate.reason is not None and not gate.reason.whole_pool:
                    gate.reason = None
            return True
        return False

    def reads_open(self) -> bool:
        """Lookups and loads go to the network now."""
        return self._open(READ)

    def writes_open(self) -> bool:
        """Stores go to the network now."""
        return self._open(WRITE)

    def is_down(self) -> bool:
        return not self.reads_open()

    def state(self) -> dict[str, str]:
        """``{"read": "open" | <failure kind>, "write": ...}``."""
        out = {}
        for direction in (READ, WRITE):
            if self.misconfigured is not None:
                out[direction] = "misconfigured"
            elif self._open(direction):
                out[direction] = "open"
            else:
                out[direction] = self._gates[direction].reason.value
        return out

    def _failed(self, exc: BaseException, what: str, direction: str) -> Failure:
        """Count, classify and react to a failure; returns its kind."""
        kind = classify(exc)
        with self._lock:
            self.stats.errors += 1
            if kind is Failure.BAD_KEY:
                self.stats.bad_keys += 1
            if kind.whole_pool or (what == "connect" and kind.long_pause):
                gates = [self._gates[READ], self._gates[WRITE]]
            elif kind.writes_only:
                gates = [self._gates[WRITE]]
            elif kind is Failure.BAD_KEY:
                gates = []
            else:
                gates = [self._gates[direction]]
            now = time.monotonic()
            pause = 0.0
            for gate in gates:
                if gate.reason is not None and now < gate.until:
                    pause = max(pause, gate.until - now)
                    if gate.reason.whole_pool or not kind.whole_pool:
                        continue  # already paused for this (or worse)
                if kind.long_pause:
                    gate.backoff = self.config.max_retry_backoff_s
                gate.reason, gate.until = kind, now + gate.backoff
                pause = max(pause, gate.backoff)
                gate.backoff = min(gate.backoff * 2, self.config.max_retry_backoff_s)
            last = self._last_warning.get(kind, -1e9)
            warn = now - last >= 30.0
            if warn:
                self._last_warning[kind] = now
        if kind.whole_pool:
            self._ensure_health_thread()
            self._wake_health.set()
        if warn:
            paused = (
                "reads and writes"
                if len(gates) == 2
                else "writes"
                if kind.writes_only
                else f"{direction}s"
            )
            log = logger.error if kind.long_pause else logger.warning
            log(
                "vllm-overlay KV pool %s: %s failed, %s (%s: %s); %s; requests "
                "recompute instead. This message repeats at most every 30 s.",
                self.config.redacted_url,
                what,
                kind.value,
                type(exc).__name__,
                self.config.redact(str(exc)),
                f"{paused} paused for {pause:.1f}s"
                + (" (until a PING answers)" if kind.whole_pool else "")
                if gates
                else "this key only",
            )
        return kind

    def _ok(self, direction: str) -> None:
        gate = self._gates[direction]
        if gate.backoff != self.config.retry_backoff_s and gate.reason is None:
            with self._lock:
                gate.backoff = self.config.retry_backoff_s

    def _ensure_health_thread(self) -> None:
        with self._lock:
            if self._health_thread is not None or self._closed.is_set():
                return
            self._health_thread = self._start(self._health_loop, "health")

    def _health_loop(self, _name: str) -> None:
        """Reopen the gates an unreachable or slow pool closed: after the
        back-off, PING (every node of a cluster); an answer within
        ``lookup_wait_s`` reopens, anything else doubles the back-off."""
        client = None
        while not self._closed.is_set():
            self._wake_health.wait(timeout=1.0)
            self._wake_health.clear()
            while not self._closed.is_set():
                with self._lock:
                    closed = [
                        g
                        for g in self._gates.values()
                        if g.reason is not None and g.reason.whole_pool
                    ]
                    until = max((g.until for g in closed), default=None)
                if until is None:
                    break
                if self._closed.wait(max(0.0, until - time.monotonic())):
                    return
                start = time.monotonic()
                try:
                    if client is None:
                        client = make_client(self.config)
                    if self.config.cluster:  # every node answers
                        client.ping(target_nodes=client.ALL_NODES)
                    else:
                        client.ping()
                    latency = time.monotonic() - start
                    if latency > self.config.lookup_wait_s:
                        raise PoolTooSlow(
                            f"PING answered in {latency * 1e3:.0f} ms, more than "
                            f"lookup_wait_s ({self.config.lookup_wait_s * 1e3:.0f} ms)"
                        )
                except Exception as exc:  # noqa: BLE001 - any failure: stay closed
                    if client is not None:
                        with contextlib.suppress(Exception):
                            client.close()
                        client = None
                    kind = classify(exc)
                    with self._lock:
                        for gate in closed:
                            gate.reason = kind if kind.whole_pool else gate.reason
                            gate.until = time.monotonic() + gate.backoff
                            gate.backoff = min(
                                gate.backoff * 2, self.config.max_retry_backoff_s
                            )
                    continue
                with self._lock:
                    for gate in closed:
                        gate.reason = None
                logger.info(
                    "vllm-overlay KV pool %s answers again (PING %.1f ms): "
                    "lookups, loads and stores resume",
                    self.config.redacted_url,
                    (time.monotonic() - start) * 1e3,
                )
        if client is not None:
            client.close()

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
                with self._lock:  # the warning above says it all
                    self._last_warning[classify(exc)] = time.monotonic()
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

        thread = threading.Thread(
            target=run, name="vllm-overlay-pool-probe", daemon=True
        )
        thread.start()
        return thread

    # -- lookups ------------------------------------------------------------
    def submit_lookup(self, keys: list[bytes]) -> LookupTicket:
        """Start a lookup; the ticket is done at once (a miss) when reads
        are paused.  Never blocks."""
        ticket = LookupTicket(keys)
        if not keys:
            ticket._finish([])
        elif not self.reads_open():
            with self._lock:
                self.stats.lookups_skipped += 1
            ticket._finish(None)
        else:
            if self._lookup_thread is None:
                self._start_lookups()
            self._lookup_q.put(ticket)
        return ticket

    def _start_lookups(self) -> None:
        with self._lock:
            if self._lookup_thread is None:
                self._lookup_thread = self._start(
                    self._run, self._lookup_q, self._lookup, "lookup"
                )

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
            if live:
                if not self.reads_open():
                    raise _Skipped()
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
        except _Skipped:
            with self._lock:
                self.stats.lookups_skipped += len(live)
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
            self._store_q.put((items[:admitted], size, encode, on_done))
        elif on_done is not None:
            on_done()
        return admitted

    def _warn_dropped(self, what: str, kept: int, dropped: int, limit: int) -> None:
        now = time.monotonic()
        with self._lock:
            if now - self._last_drop_warning < 30.0:
                return
            self._last_drop_warning = now
        logger.warning(
            "vllm-overlay KV pool %s: %s of %d block(s): %d admitted, %d dropped "
            "(over the in-flight limit of %d B%s); this warning repeats at "
            "most every 30 s, stats count every block",
            self.config.redacted_url,
            what,
            kept + dropped,
            kept,
            dropped,
            limit,
            "; dropped blocks are recomputed" if what == "load" else "",
        )

    def submit_delete(self, keys: list[bytes]) -> None:
        """Remove values that failed their check (background)."""
        self._need_io_threads()
        self._store_q.put(("delete", keys))

    def _store(self, client, job) -> None:
        if job[0] == "delete":
            if not self.writes_open():
                return  # a later load refuses the value again
            try:
                pipe = client.pipeline(transaction=False)
                for key in job[1]:
                    pipe.delete(key)
                pipe.execute()
            except Exception as exc:  # noqa: BLE001
                self._failed(exc, "delete", WRITE)
            return
        items, size, encode, on_done = job
        stored = 0
        try:
            if not self.writes_open():
                raise _Skipped()
            start = time.perf_counter()
            present = self._exchange(
                client, [(key, [_command(b"EXISTS", key)], None) for key, _ in items]
            )
            failure = next(
                (
                    a
                    for a in present
                    if isinstance(a, Exception) and not isinstance(a, _Redirected)
                ),
                None,
            )
            if failure is not None:
                raise failure
            todo = [(k, v) for (k, v), p in zip(items, present) if not p]
            values = []
            for key, payload in todo:
                value = encode(key, payload) if encode else payload
                parts = list(value) if isinstance(value, (tuple, list)) else [value]
                values.append((key, parts, sum(memoryview(p).nbytes for p in parts)))
            answers = self._exchange(
                client,
                [
                    (key, self._set_command(key, parts, n), None)
                    for key, parts, n in values
                ],
            )
            elapsed = time.perf_counter() - start
            failure = next(
                (
                    a
                    for a in answers
                    if isinstance(a, Exception) and not isinstance(a, _Redirected)
                ),
                None,
            )
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
            if failure is not None:
                self._failed(failure, "store", WRITE)
            else:
                self._ok(WRITE)
        except _Skipped:
            with self._lock:
                self.stats.dropped_stores += len(items)
        except Exception as exc:  # noqa: BLE001
            with self._lock:
                self.stats.dropped_stores += len(items) - stored
            self._failed(exc, "store", WRITE)
        finally:
            with self._lock:
                self._inflight -= size
            if on_done is not None:
                try:
                    on_done()
                except Exception:  # noqa: BLE001 - a bug: logged, the thread goes on
                    logger.exception("vllm-overlay KV pool: a store callback failed")

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

    # -- raw pipelines ----------------------------------------------------------
    def _groups(self, client, keys: list[bytes]) -> list[tuple[object, list[int]]]:
        """(connection pool, indexes of ``keys``) per server."""
        if isinstance(client, _Unreachable):
            import redis

            raise redis.ConnectionError("pool unreachable (no client)")
        if not self.config.cluster:
            return [(client.connection_pool, list(range(len(keys))))]
        nodes: dict[str, tuple[object, list[int]]] = {}
        for i, key in enumerate(keys):
            node = client.get_node_from_key(key)
            nodes.setdefault(node.name, (node, []))[1].append(i)
        return [
            (client.get_redis_connection(node).connection_pool, idxs)
            for node, idxs in nodes.values()
        ]

    def _exchange(self, client, requests: list, retry: bool = True) -> list:
        """Send ``requests`` (key, command pieces, ``into`` or None[, a
        callback for the reply]) as one pipeline per server and read every
        reply (``RespReader.reply``; the callback, if any, gets each reply
        that is not an error as soon as it is read):
        error replies come back as exception instances, in place.  A
        cluster's MOVED updates the client's slot map and is tried once
        more; a redirect left after that is a ``_Redirected``.  A socket
        failure or a protocol error raises (the connection is dropped)."""
        import redis

        replies: list = [None] * len(requests)
        taken = []
        try:
            for pool, idxs in self._groups(client, [r[0] for r in requests]):
                conn = pool.get_connection()
                taken.append((pool, conn, idxs))
                conn.send_packed_command(
                    _coalesce(piece for i in idxs for piece in requests[i][1])
                )
            for _, conn, idxs in taken:
                reader = RespReader(conn._sock)
                for i in idxs:
                    replies[i] = reply = reader.reply(requests[i][2])
                    if len(requests[i]) > 3 and not isinstance(reply, Exception):
                        requests[i][3](reply)  # e.g. check it while more arrive
                if reader.buffered:
                    raise redis.InvalidResponse("more bytes than replies")
        except BaseException as exc:
            for _, conn, _ in taken:
                conn.disconnect()
            if isinstance(exc, socket.timeout):
                raise redis.TimeoutError("Timeout reading from the pool") from exc
            if isinstance(exc, OSError):
                raise redis.ConnectionError(f"reading from the pool: {exc}") from exc
            raise
        finally:
            for pool, conn, _ in taken:
                pool.release(conn)
        moved = [
            i
            for i, r in enumerate(replies)
            if isinstance(r, redis.ResponseError)
            and str(r).startswith(("MOVED ", "ASK "))
        ]
        if moved:
            for i in moved:
                text = str(replies[i])
                if retry and text.startswith("MOVED "):
                    client.nodes_manager.move_slot(
                        redis.exceptions.MovedError(text[6:])
                    )
                replies[i] = _Redirected(text)
            if retry:
                again = self._exchange(client, [requests[i] for i in moved], False)
                for i, reply in zip(moved, again):
                    replies[i] = reply
        return replies

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
        them.  ``into(i, length)`` may give the buffers (a list of writable
        memoryviews of ``length`` bytes in all) that value ``i`` is read
        into, straight from the socket: it then comes back as an
        ``InPlace``; otherwise (or when ``into`` answers None) as bytes.
        ``landed(i, value)`` runs on the load thread as soon as value ``i``
        is read, before the next one is parsed (checking it there overlaps
        the check with the server sending the next values).  ``prepare``
        (values -> anything) runs on the load thread once all are read;
        ``poll_loads`` then returns its result instead of the values.
        Returns the number of keys fetched."""
        self._need_io_threads()
        limit = self.config.load_limit_bytes
        with self._lock:
            n = len(keys) if max_keys is None else min(len(keys), max_keys)
            if value_bytes:
                room = max(0, limit - self._inflight_load)
                n = min(n, room // value_bytes)
            size = n * value_bytes
            self._inflight_load += size
            self.stats.limited_loads += len(keys) - n
            self._pending_loads += 1
        if n < len(keys):
            self._warn_dropped("load", n, len(keys) - n, limit)
        self._load_q.put((job_id, keys, n, size, prepare, into, landed))
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

    def _load(self, client, job) -> None:
        job_id, keys, n, size, prepare, into, landed = job
        values: list = [None] * len(keys)
        try:
            if n and not self.reads_open():
                raise _Skipped()
            start = time.perf_counter()
            if n:
                answers = self._exchange(
                    client,
                    [
                        (
                            key,
                            [_command(b"GET", key)],
                            None if into is None else functools.partial(into, i),
                        )
                        + (() if landed is None else (functools.partial(landed, i),))
                        for i, key in enumerate(keys[:n])
                    ],
                )
                bad_keys = []
                for i, answer in enumerate(answers):
                    if isinstance(answer, _Redirected):
                        continue  # a cluster moving slots: a miss, no pause
                    if isinstance(answer, Exception):
                        if self._failed(answer, "load", READ) is Failure.BAD_KEY:
                            bad_keys.append(keys[i])
                    elif isinstance(answer, (bytes, InPlace)):
                        values[i] = answer
                if bad_keys:
                    self.submit_delete(bad_keys)
            with self._lock:
                self.stats.bytes_in += sum(len(v) for v in values if v is not None)
                self.stats.io_seconds_in += time.perf_counter() - start
            self._ok(READ)
        except _Skipped:
            pass
        except Exception as exc:  # noqa: BLE001
            values = [None] * len(keys)
            self._failed(exc, "load", READ)
        result = values
        if prepare is not None:
            try:
                result = prepare(values)
            except Exception:  # noqa: BLE001 - a bug: the caller sees None
                logger.exception("vllm-overlay KV pool: preparing a load failed")
                result = None
        with self._lock:
            self._pending_loads -= 1
            self._inflight_load -= size
        self._loads_done.append((job_id, result))
        _LOADS_DONE.set()

    def record_load(self, loaded: int, failed: int, bad_signatures: int = 0) -> None:
        with self._lock:
            self.stats.loaded_blocks += loaded
            self.stats.load_failures += failed
            self.stats.bad_signatures += bad_signatures

    # -- threads ----------------------------------------------------------------
    def _run(self, jobs: queue.Queue, handle, what: str) -> None:
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
                return
            if client is None and (
                self.reads_open() if direction == READ else self.writes_open()
            ):
                try:
                    client = make_client(self.config)
                except Exception as exc:  # noqa: BLE001
                    self._failed(exc, "connect", direction)
            # Without a client the handler sees the gate closed or fails.
            handle(client if client is not None else _Unreachable(), job)

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
        self._wake_health.set()
        for q in (self._store_q, self._load_q, self._lookup_q):
            q.put(_STOP)
        for thread in self._threads:
            thread.join(timeout=5)

    def take_stats(self) -> PoolStats:
        with self._lock:
            stats, self.stats = self.stats, PoolStats()
            for field in dataclasses.fields(PoolStats):
                setattr(
                    self.totals,
                    field.name,
                    getattr(self.totals, field.name) + getattr(stats, field.name),
                )
        return stats

    def cumulative(self) -> dict:
        """Totals since start, including the current interval."""
        self.take_stats()
        return self.totals.as_dict()


class _Skipped(Exception):
    pass


class _Redirected(Exception):
    """A cluster redirect (MOVED/ASK) still there after one retry: the slot
    is moving; that block is a miss (or a dropped store), nothing pauses."""


class InPlace:
    """A value read straight into the buffers ``submit_load``'s ``into``
    gave for it; ``len()`` is its length."""

    __slots__ = ("length",)

    def __init__(self, length: int) -> None:
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __repr__(self) -> str:
        return f"InPlace({self.length})"


def _command(name: bytes, key: bytes) -> bytes:
    return b"*2\r\n$%d\r\n%s\r\n$%d\r\n%s\r\n" % (len(name), name, len(key), key)


def _coalesce(pieces) -> list:
    """Command pieces to send: runs of short ``bytes`` joined (fewer
    sends), anything else (a payload) passed on as it is (no copy)."""
    out: list = []
    small: list[bytes] = []
    for piece in pieces:
        if isinstance(piece, bytes) and len(piece) < _SMALL_CHUNK:
            small.append(piece)
            continue
        if small:
            out.append(b"".join(small))
            small = []
        out.append(piece)
    if small:
        out.append(b"".join(small))
    return out


class RespReader:
    """Replies (RESP2, and RESP3's null) read from a socket.  Reply lines go
    through a small buffer; a bulk string that the caller has memory for is
    read straight into it with ``recv_into`` (its bytes are never copied in
    Python: only what the line buffer already holds is moved over, at most
    ``buffer_bytes`` per reply).  The socket's own timeout bounds each
    read."""

    # Measured (bench_pool, 256 KiB values): 1 KiB reads put the pool at
    # 0.94x the raw reader, 4 KiB at 0.83x, 64 KiB at 0.73x.
    fill_bytes = 1024

    def __init__(self, sock, buffer_bytes: int = 64 << 10) -> None:
        self.sock = sock
        self._buf = bytearray(buffer_bytes)
        self._view = memoryview(self._buf)
        self._start = 0
        self._end = 0

    @property
    def buffered(self) -> int:
        """Bytes received but not consumed by a reply yet."""
        return self._end - self._start

    def _recv(self, view, nbytes: int) -> int:
        got = self.sock.recv_into(view, nbytes)
        if not got:
            import redis

            raise redis.ConnectionError("connection closed by the pool server")
        return got

    def _fill(self) -> None:
        """Receive more into the line buffer (compacted, or grown for a
        line longer than it, up to 16 MiB)."""
        if self._start == self._end:
            self._start = self._end = 0
        elif self._end == len(self._buf):
            kept = bytes(self._view[self._start : self._end])
            if self._start == 0:
                if len(self._buf) >= 16 << 20:
                    import redis

                    raise redis.InvalidResponse("reply line longer than 16 MiB")
                self._view.release()
                self._buf = bytearray(2 * len(self._buf))
                self._view = memoryview(self._buf)
            self._buf[: len(kept)] = kept
            self._start, self._end = 0, len(kept)
        # A short read: a reply line and the first bytes after it, so little
        # of a value passes through this buffer (the rest goes straight to
        # the caller's memory).
        room = min(len(self._buf) - self._end, self.fill_bytes)
        self._end += self._recv(self._view[self._end :], room)

    def line(self) -> bytes:
        while True:
            at = self._buf.find(b"\r\n", self._start, self._end)
            if at >= 0:
                out = bytes(self._view[self._start : at])
                self._start = at + 2
                return out
            self._fill()

    def read_into(self, dest) -> None:
        """Fill ``dest`` (a writable buffer): what is buffered, then the
        rest straight from the socket."""
        dest = memoryview(dest).cast("B")
        want = dest.nbytes
        got = min(want, self._end - self._start)
        if got:
            dest[:got] = self._view[self._start : self._start + got]
            self._start += got
        while got < want:
            got += self._recv(dest[got:], want - got)

    def _crlf(self) -> None:
        while self._end - self._start < 2:
            self._fill()
        if self._buf[self._start : self._start + 2] != b"\r\n":
            import redis

            raise redis.InvalidResponse("bulk string not followed by CRLF")
        self._start += 2

    def reply(self, into=None):
        """The next reply: bytes (simple or bulk string), int, None (nil),
        a list, an exception instance for an error reply (returned, not
        raised), or ``InPlace(length)`` for a bulk string read into the
        buffers ``into(length)`` gave (None: read as bytes)."""
        import redis

        line = self.line()
        kind, rest = line[:1], line[1:]
        if kind == b"$":
            length = int(rest)
            if length < 0:
                return None
            views = into(length) if into is not None else None
            if views is None:
                out = bytearray(length)
                self.read_into(out)
                self._crlf()
                return bytes(out)
            views = [memoryview(v).cast("B") for v in views]
            if sum(v.nbytes for v in views) != length:
                raise ValueError(f"buffers for {length} B do not add up to it")
            for view in views:
                self.read_into(view)
            self._crlf()
            return InPlace(length)
        if kind == b"+":
            return rest
        if kind == b":":
            return int(rest)
        if kind == b"-":
            return redis.ResponseError(rest.decode(errors="replace"))
        if kind == b"_":
            return None
        if kind == b"*":
            count = int(rest)
            return None if count < 0 else [self.reply() for _ in range(count)]
        raise redis.InvalidResponse(f"unexpected reply {line[:32]!r}")


class _Unreachable:
    """Stands in for a client that could not be created."""

    def pipeline(self, *args, **kwargs):
        import redis

        raise redis.ConnectionError("pool unreachable (no client)")
