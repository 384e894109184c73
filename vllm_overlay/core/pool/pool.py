"""KVPool: block values in Redis/Valkey, I/O on background threads.

* ``count_hits(keys)``: how many leading keys exist (one pipelined EXISTS
  round trip; called by the scheduler, so it fails fast when the pool is down).
* ``submit_store(items)``: queue values for writing; a background thread
  writes them in pipelined batches, skipping keys already present.  Items
  are admitted in order (a block is useless without its predecessors) up to
  ``max_inflight_bytes``; the rest are dropped, counted and warned about.
* ``submit_load(job, keys, value_bytes)`` / ``poll_loads()``: a background
  thread fetches the values in one pipelined MGET-like batch; results come
  back as bytes or None (missing, failed, refused by the codec check, or
  beyond ``max_inflight_load_bytes``: the caller reports those blocks as
  load errors and vLLM recomputes them).

The threads block in socket I/O, which releases the GIL, so the engine's own
Python keeps running while the network waits.  When the pool is unreachable
the pool marks itself down for a growing back-off (1 s .. 30 s), answers
"miss" at once, logs a rate-limited warning, and tries again after the
back-off: requests still complete by recomputing.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import queue
import threading
import time

from vllm_overlay.core.pool.config import PoolConfig

logger = logging.getLogger("vllm.overlay")

_STOP = object()


@dataclasses.dataclass
class PoolStats:
    lookups: int = 0
    hits: int = 0  # blocks found by count_hits
    misses: int = 0  # blocks not found (first gap ends a lookup)
    loaded_blocks: int = 0
    load_failures: int = 0  # missing or refused values on load
    stored_blocks: int = 0
    skipped_existing: int = 0
    dropped_stores: int = 0  # over the in-flight limit, or pool down
    limited_loads: int = 0  # blocks not loaded: over the in-flight load limit
    bad_signatures: int = 0  # values refused: unsigned, or a wrong MAC
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
    client even for a cluster, as the startup probe needs)."""
    import redis

    kwargs = config.client_kwargs()
    if config.cluster and not single_node:
        from redis.cluster import RedisCluster

        return RedisCluster(**kwargs)
    kwargs.setdefault("db", 0)
    # No client-side retries (as Redis.from_url): the pool backs off itself.
    return redis.Redis(retry=None, **kwargs)


class KVPool:
    """``io_threads=False``: lookups only (``count_hits``), no store or load
    threads; what the scheduler side needs."""

    def __init__(self, config: PoolConfig, io_threads: bool = True) -> None:
        self.config = config
        self.stats = PoolStats()  # since the last take_stats()
        self.totals = PoolStats()  # since start, up to the last take_stats()
        self._lock = threading.Lock()
        self._down_until = 0.0
        self._backoff = config.retry_backoff_s
        self._last_warning = 0.0
        self._last_drop_warning = 0.0
        self._inflight_load = 0
        self.misconfigured: str | None = None  # set by probe(): pool disabled
        self._inflight = 0
        self._pending_loads = 0
        self._loads_done: collections.deque = collections.deque()
        self._store_q: queue.Queue = queue.Queue()
        self._load_q: queue.Queue = queue.Queue()
        self._client = None  # scheduler-side calls (count_hits)
        self._threads = (
            [
                threading.Thread(
                    target=self._run,
                    args=(self._store_q, self._store),
                    name="vllm-overlay-pool-store",
                    daemon=True,
                ),
                threading.Thread(
                    target=self._run,
                    args=(self._load_q, self._load),
                    name="vllm-overlay-pool-load",
                    daemon=True,
                ),
            ]
            if io_threads
            else []
        )
        for thread in self._threads:
            thread.start()

    def _need_io_threads(self) -> None:
        if not self._threads:
            raise RuntimeError(
                "this KVPool was created for lookups only "
                "(io_threads=False): it cannot store or load"
            )

    # -- health -----------------------------------------------------------
    def is_down(self) -> bool:
        return self.misconfigured is not None or time.monotonic() < self._down_until

    def _failed(self, exc: Exception, what: str) -> None:
        import redis

        with self._lock:
            self.stats.errors += 1
            unreachable = isinstance(exc, (redis.ConnectionError, redis.TimeoutError))
            if unreachable:
                self._down_until = time.monotonic() + self._backoff
                self._backoff = min(self._backoff * 2, self.config.max_retry_backoff_s)
            now = time.monotonic()
            if now - self._last_warning >= 30.0:
                self._last_warning = now
                logger.warning(
                    "vllm-overlay KV pool %s: %s failed (%s: %s)%s; requests "
                    "recompute instead",
                    self.config.redacted_url,
                    what,
                    type(exc).__name__,
                    self.config.redact(str(exc)),
                    f", retrying in {self._down_until - now:.0f}s"
                    if unreachable
                    else "",
                )

    def _ok(self) -> None:
        if self._backoff != self.config.retry_backoff_s:
            with self._lock:
                self._backoff = self.config.retry_backoff_s
            logger.info(
                "vllm-overlay KV pool %s is reachable again", self.config.redacted_url
            )

    def probe(self) -> threading.Thread:
        """Check once, in the background, that the pool answers and that it
        is a cluster exactly when ``cluster`` says so; log one warning naming
        the (redacted) URL if it does not answer.  A cluster mismatch is a
        configuration error: logged as such, and the pool is disabled
        (``misconfigured``; every request recomputes) instead of failing on
        every lookup.  Bounded by ``connect_timeout_s`` and ``timeout_s``;
        never blocks the caller."""

        def run() -> None:
            try:
                client = make_client(self.config, single_node=True)
                try:
                    client.ping()
                    info = client.info("cluster")
                finally:
                    client.close()
            except Exception as exc:  # noqa: BLE001 - any failure is reported
                detail = self.config.redact(str(exc))
                logger.warning(
                    "vllm-overlay KV pool %s cannot be reached at startup "
                    "(%s: %s); requests recompute until it can",
                    self.config.redacted_url,
                    type(exc).__name__,
                    detail,
                )
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

        self.server_is_cluster: bool | None = None
        thread = threading.Thread(
            target=run, name="vllm-overlay-pool-probe", daemon=True
        )
        thread.start()
        return thread

    def _connection(self):
        if self._client is None:
            self._client = make_client(self.config)
        return self._client

    # -- scheduler side ---------------------------------------------------
    def count_hits(self, keys: list[bytes]) -> int:
        """Number of leading ``keys`` present in the pool (0 when down)."""
        if not keys or self.is_down():
            return 0
        try:
            if self.config.cluster:  # keys hash to different nodes
                present = [bool(self._connection().exists(k)) for k in keys]
            else:
                pipe = self._connection().pipeline(transaction=False)
                for key in keys:
                    pipe.exists(key)
                present = [bool(x) for x in pipe.execute()]
        except Exception as exc:  # noqa: BLE001 - any failure is a miss
            self._failed(exc, "lookup")
            return 0
        self._ok()
        hits = next((i for i, p in enumerate(present) if not p), len(keys))
        with self._lock:
            self.stats.lookups += 1
            self.stats.hits += hits
            self.stats.misses += len(keys) - hits
        return hits

    # -- stores -------------------------------------------------------------
    def submit_store(self, items: list[tuple[bytes, bytes]]) -> int:
        """Queue ``(key, value)`` pairs, in prefix order: the leading items
        that fit under ``max_inflight_bytes`` are admitted; from the first
        one that does not, the rest are dropped (a block is useless without
        its predecessors).  Returns the number admitted (0: all dropped)."""
        self._need_io_threads()
        with self._lock:
            admitted, size = 0, 0
            if not self.is_down():
                room = self.config.max_inflight_bytes - self._inflight
                for _, value in items:
                    if size + len(value) > room:
                        break
                    size += len(value)
                    admitted += 1
            dropped = len(items) - admitted
            self.stats.dropped_stores += dropped
            self._inflight += size
        if dropped and not self.is_down():
            self._warn_dropped(
                "store", admitted, dropped, self.config.max_inflight_bytes
            )
        if admitted:
            self._store_q.put((items[:admitted], size))
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
            try:
                if self.config.cluster:  # keys live on different nodes
                    for key in job[1]:
                        client.delete(key)
                else:
                    client.delete(*job[1])
            except Exception as exc:  # noqa: BLE001
                self._failed(exc, "delete")
            return
        items, size = job
        try:
            if self.is_down():
                raise _Skipped()
            start = time.perf_counter()
            pipe = client.pipeline(transaction=False)
            for key, _ in items:
                pipe.exists(key)
            present = pipe.execute()
            todo = [(k, v) for (k, v), p in zip(items, present) if not p]
            pipe = client.pipeline(transaction=False)
            for key, value in todo:
                pipe.set(key, value, nx=True, ex=self.config.ttl_s)
            pipe.execute()
            elapsed = time.perf_counter() - start
            with self._lock:
                self.stats.stored_blocks += len(todo)
                self.stats.skipped_existing += len(items) - len(todo)
                self.stats.bytes_out += sum(len(v) for _, v in todo)
                self.stats.io_seconds_out += elapsed
            self._ok()
        except _Skipped:
            with self._lock:
                self.stats.dropped_stores += len(items)
        except Exception as exc:  # noqa: BLE001
            with self._lock:
                self.stats.dropped_stores += len(items)
            self._failed(exc, "store")
        finally:
            with self._lock:
                self._inflight -= size

    # -- loads ----------------------------------------------------------------
    def submit_load(self, job_id, keys: list[bytes], value_bytes: int = 0) -> int:
        """Fetch ``keys`` in the background.  With ``value_bytes`` (the size
        of one value), only the leading keys that fit under the in-flight
        load limit are fetched; the others come back as None, so the caller
        reports them as load errors and vLLM recomputes them.  Returns the
        number of keys fetched."""
        self._need_io_threads()
        limit = self.config.load_limit_bytes
        with self._lock:
            n = len(keys)
            if value_bytes:
                room = max(0, limit - self._inflight_load)
                n = min(n, room // value_bytes)
            size = n * value_bytes
            self._inflight_load += size
            self.stats.limited_loads += len(keys) - n
            self._pending_loads += 1
        if n < len(keys):
            self._warn_dropped("load", n, len(keys) - n, limit)
        self._load_q.put((job_id, keys, n, size))
        return n

    def poll_loads(self) -> list[tuple[object, list[bytes | None]]]:
        done = []
        while self._loads_done:
            done.append(self._loads_done.popleft())
        return done

    def _load(self, client, job) -> None:
        job_id, keys, n, size = job
        values: list[bytes | None] = [None] * len(keys)
        try:
            if self.is_down():
                raise _Skipped()
            start = time.perf_counter()
            if self.config.cluster:
                values[:n] = [client.get(k) for k in keys[:n]]
            elif n:
                pipe = client.pipeline(transaction=False)
                for key in keys[:n]:
                    pipe.get(key)
                values[:n] = pipe.execute()
            with self._lock:
                self.stats.bytes_in += sum(len(v) for v in values if v)
                self.stats.io_seconds_in += time.perf_counter() - start
            self._ok()
        except _Skipped:
            pass
        except Exception as exc:  # noqa: BLE001
            values = [None] * len(keys)
            self._failed(exc, "load")
        self._loads_done.append((job_id, values))
        with self._lock:
            self._pending_loads -= 1
            self._inflight_load -= size

    def record_load(self, loaded: int, failed: int, bad_signatures: int = 0) -> None:
        with self._lock:
            self.stats.loaded_blocks += loaded
            self.stats.load_failures += failed
            self.stats.bad_signatures += bad_signatures

    # -- threads ----------------------------------------------------------------
    def _run(self, jobs: queue.Queue, handle) -> None:
        client = None
        while True:
            job = jobs.get()
            if job is _STOP:
                return
            if client is None:
                try:
                    client = make_client(self.config)
                except Exception as exc:  # noqa: BLE001
                    self._failed(exc, "connect")
            if client is not None:
                handle(client, job)
            else:  # cannot even build a client: fail the job
                handle(_Unreachable(), job)

    def drain(self, timeout_s: float = 10.0) -> bool:
        """Wait until queued stores and loads are done (tests, shutdown)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self._lock:
                if self._inflight == 0 and self._pending_loads == 0:
                    return True
            time.sleep(0.01)
        return False

    def close(self) -> None:
        for q in (self._store_q, self._load_q):
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


class _Unreachable:
    """Stands in for a client that could not be created."""

    def _fail(self, *args, **kwargs):
        import redis

        raise redis.ConnectionError("pool unreachable")

    pipeline = get = exists = _fail
