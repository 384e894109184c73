"""KVPool: block values in Redis/Valkey; every network call on a background
thread, so its callers (vLLM's scheduler and engine threads) never wait on
the network.  One class, in parts of one job each: lookups (lookups.py),
stores (stores.py), loads (loads.py), what a failure does (failures.py);
this file starts and runs the threads, makes their connections and checks
the server at startup (``probe``).

Every job ends, and ends once: a load is done within ``io_timeout_s`` of
its submission or fails (its reads stop at the deadline; the watchdog
cancels one still running after it and hands its caller the failure), and
an exception from a job fails that job only (its requests recompute; the
thread goes on).  A thread busy with one job past its deadline is stuck:
the pool pauses (lookups answer "miss" at once, loads fail at once) until
it is free and a PING answers.  ``health.py`` holds the gates and that
thread; ``transport.py`` the clients and raw pipelines; ``resp.py`` the
reply reader; ``jobs.py`` what the threads are handed; ``stats.py`` the
counters.  ``count_hits`` is a blocking convenience for tests and tools,
never for vLLM's threads.

``close`` ends it all within ``CLOSE_S``: it hangs up every connection
(redis-py lets another thread disconnect a connection in use), so a thread
blocked on the server returns at once; each thread then fails the jobs it
will not run (a lookup misses, a load fails, a store is not stored) and
ends, even when its queue is too full for the stop signal.

Why one object in parts (mixins), not four objects: the parts share what
must be one for the pool to be right.  One ``_lock`` guards every count
that a check reads together (``drain`` sees the loads and the stores idle
at one instant; ``stats`` is one set of counters that ``take_stats``
swaps whole).  One failure path, ``_failed``, closes the gates every
part reads, so a server found unreachable by a load also pauses the
lookups and the stores.  One set of threads, queues and connections,
which ``close`` ends together.  Split into objects, each would hold a
reference to the others and to that lock, and the same calls would go
through attributes.  So each part owns its state, which only its own
methods write (the constructor sets it), and the others call its
interface (named in its class doc):

- this file: the threads, their queues and clients (``_threads``,
  ``_clients``, ``_ping_client``, ``_store_q``, ``_load_q``,
  ``_lookup_q``), ``_busy`` (what each thread runs, read by ``_stuck``),
  ``_closed``, ``_lookups_ready`` (set by ``_run``), ``misconfigured``
  (set by ``probe``), and the shared ``_lock``, ``stats``, ``_gates``,
  ``_log``, ``_monitor``.  Interface: ``_start``, ``_run``, ``_connect``,
  ``_stuck``, ``_need_io_threads``.
- failures.py: no state of its own; it writes the gates and the failure
  counters.  Interface: ``reads_open``, ``writes_open``, ``_failed``,
  ``_internal``, ``_ok``, ``_watchdog``.
- lookups.py: no state of its own; its tickets go through ``_lookup_q``.
  Interface: ``submit_lookup``, ``abandon``, ``lookup_wait_s``.
- stores.py: ``_inflight``, ``_store_jobs``, ``_queued_deletes``.
  Interface: ``submit_delete``, ``_stores_idle``, ``_abandon_store``,
  ``_warn_dropped``.
- loads.py: ``_inflight_load``, ``_pending_loads``, ``_loads``,
  ``_loads_done``.  Interface: ``_fail_load``, ``_loads_idle``,
  ``_cancel_late_loads``.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import logging
import queue
import threading
import time

from vllm_overlay.core.pool.config import PoolConfig
from vllm_overlay.core.pool.errors import classify
from vllm_overlay.core.pool.failures import GRACE_S, PoolFailures
from vllm_overlay.core.pool.health import READ, WRITE, Gates, Monitor, start_thread
from vllm_overlay.core.pool.jobs import STOP, LoadJob, LookupTicket, StoreJob
from vllm_overlay.core.pool.loads import PoolLoads
from vllm_overlay.core.pool.lookups import PoolLookups
from vllm_overlay.core.pool.ratelog import RateLimitedLog
from vllm_overlay.core.pool.resp import InPlace
from vllm_overlay.core.pool.stats import PoolStats
from vllm_overlay.core.pool.stores import PoolStores
from vllm_overlay.core.pool.transport import Unreachable, make_client

logger = logging.getLogger("vllm.overlay")

MAX_QUEUED_LOOKUPS = 4096  # more waiting: answered "miss" at once
CLOSE_S = 3.0  # close() returns within this, its threads ended or not

__all__ = [
    "CLOSE_S",
    "GRACE_S",
    "InPlace",
    "KVPool",
    "LookupTicket",
    "PoolStats",
    "make_client",
]


class KVPool(PoolFailures, PoolLookups, PoolStores, PoolLoads):
    """``io_threads=False``: no store or load threads (the scheduler's
    side).  ``lookups=True``: start the lookup thread now and let it connect
    in the background, so the first lookup does not pay for the connection
    (otherwise it starts with the first lookup)."""

    # Called on a pool thread each time a result is ready to be polled (a
    # lookup answered, a load's result queued), after it is: lets a caller
    # that sleeps meanwhile wake (the 0.32 tier: the engine's idle wait).
    # Must return at once and not raise.
    on_result = None

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
        self._store_jobs: set[StoreJob] = set()  # admitted, not released
        self._inflight_load = 0
        self._pending_loads = 0
        self._queued_deletes = 0
        self._loads: set[LoadJob] = set()  # submitted, not delivered
        self._busy: dict[str, tuple[object, float]] = {}  # thread -> job, deadline
        self._loads_done: collections.deque = collections.deque()
        self._store_q: queue.Queue = queue.Queue()
        self._load_q: queue.Queue = queue.Queue()
        self._lookup_q: queue.Queue = queue.Queue(maxsize=MAX_QUEUED_LOOKUPS)
        self._closed = threading.Event()
        self._threads: dict[str, threading.Thread] = {}
        self._clients: dict[str, object] = {}  # thread -> its client (close)
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
        """``PoolConfig.check_value_size``; a pool that fails it is closed
        (its threads end) before the error is raised."""
        try:
            self.config.check_value_size(value_bytes)
        except ValueError:
            self.close()
            raise

    # -- connections --------------------------------------------------------
    def _connect(self, what: str):
        """A client for the ``what`` thread, known to ``close``."""
        client = make_client(self.config)
        with self._lock:
            self._clients[what] = client
        if self._closed.is_set():  # (close ran meanwhile: it missed it)
            _hang_up(client)
        return client

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

    # -- threads ----------------------------------------------------------------
    def _job_deadline(self, what: str, job) -> float:
        if isinstance(job, LoadJob):
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
            client = self._connect(what)
            pipe = client.pipeline(transaction=False)
            pipe.exists(b"vkv:warm-up")
            pipe.execute()
        except Exception as exc:  # noqa: BLE001
            self._failed(exc, "connect", direction)
        if what == "lookup":
            self._lookups_ready = True
        while True:
            job = jobs.get()
            if job is STOP or self._closed.is_set():
                self._abandon(job)
                break
            with self._lock:
                self._busy[what] = (job, self._job_deadline(what, job))
            try:
                if client is None and (
                    self.reads_open() if direction == READ else self.writes_open()
                ):
                    try:
                        client = self._connect(what)
                    except Exception as exc:  # noqa: BLE001
                        self._failed(exc, "connect", direction)
                # Without a client the handler sees the gate closed or fails.
                handle(client if client is not None else Unreachable(), job)
            except Exception as exc:  # noqa: BLE001 - a handler's own bug
                self._internal(what, exc)
            finally:
                with self._lock:
                    self._busy.pop(what, None)
        while True:  # closed: what is still queued ends now, failed
            try:
                self._abandon(jobs.get_nowait())
            except queue.Empty:
                break
        with self._lock:
            self._clients.pop(what, None)
        if client is not None:
            with contextlib.suppress(Exception):
                client.close()

    def _stuck(self) -> str | None:
        """A pool thread busy with one job past its deadline (plus
        ``GRACE_S``), or None."""
        now = time.monotonic()
        with self._lock:
            busy = list(self._busy.items())
        return next((what for what, (_, end) in busy if now > end + GRACE_S), None)

    def _abandon(self, job) -> None:
        """A job its thread will not run (the pool is closed): it ends now
        as failed (a lookup misses, a load fails, a store is not stored)."""
        if isinstance(job, LookupTicket):
            if not job.done:
                job._finish(None)
        elif isinstance(job, LoadJob):
            self._fail_load(job)
        elif isinstance(job, (StoreJob, tuple)):  # or deletes
            self._abandon_store(job)

    def drain(self, timeout_s: float = 10.0) -> bool:
        """Wait until every submitted store and load is done, its result
        handed over (a store's ``on_done`` has returned, a load's result is
        queued for ``poll_loads``); False if ``timeout_s`` passed first
        (``cancel_loads`` and ``cancel_stores`` then stop them touching
        the caller's memory)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self._lock:  # loads first: a load may queue a delete
                if self._loads_idle() and self._stores_idle():
                    return True
            time.sleep(0.01)
        return False

    def close(self) -> None:
        """End the threads and close every connection, within ``CLOSE_S``
        (see the module doc); reads and writes stay closed after."""
        self._closed.set()
        self._monitor.closed.set()
        self._monitor.wake.set()
        for q in (self._store_q, self._load_q, self._lookup_q):
            # A full queue has no room: its thread sees _closed instead.
            with contextlib.suppress(queue.Full):
                q.put_nowait(STOP)
        with self._lock:
            clients = [*self._clients.values(), self._ping_client]
        for client in clients:  # a thread blocked on the server returns now
            _hang_up(client)
        deadline = time.monotonic() + CLOSE_S
        for thread in self._threads.values():
            thread.join(timeout=max(0.0, deadline - time.monotonic()))
        ping, self._ping_client = self._ping_client, None
        if ping is not None:
            with contextlib.suppress(Exception):
                ping.close()
        alive = sorted(n for n, t in self._threads.items() if t.is_alive())
        if alive:
            logger.warning(
                "vllm-overlay KV pool %s: thread(s) %s still running %.0f s "
                "after close; they end with their current job",
                self.config.redacted_url,
                ", ".join(alive),
                CLOSE_S,
            )

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


def _hang_up(client) -> None:
    """Disconnect every connection of ``client``, those another thread is
    using too: a read blocked on one ends at once (the thread reconnects
    only if it goes on)."""
    if client is None or isinstance(client, Unreachable):
        return
    with contextlib.suppress(Exception):
        if hasattr(client, "disconnect_connection_pools"):  # a cluster
            client.disconnect_connection_pools()
        else:
            client.connection_pool.disconnect(inuse_connections=True)
