"""KVPool.close(): every thread ends and every connection closes (the
health thread's PING client too), within ``CLOSE_S`` even with a stopped
server and a full lookup queue; jobs it did not run end as failed (a
lookup misses, a load fails, a store is not stored)."""

from __future__ import annotations

import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).parents[1]))
from support.redis_server import redis_server  # noqa: E402

from vllm_overlay.core.pool.config import PoolConfig  # noqa: E402
from vllm_overlay.core.pool.pool import (  # noqa: E402
    CLOSE_S,
    MAX_QUEUED_LOOKUPS,
    KVPool,
)


def _alive(pool: KVPool) -> list[str]:
    return sorted(n for n, alive in pool.threads_alive().items() if alive)


def _until(check, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not check() and time.monotonic() < deadline:
        time.sleep(0.05)
    return check()


def _clients(server) -> int:
    """Connections the server holds, less the one asking."""
    return int(server.info("clients")["connected_clients"]) - 1


def test_close_ends_every_thread_and_connection_the_ping_clients_too(server_kind):
    with redis_server(kind=server_kind) as server:
        base = _clients(server)
        pool = KVPool(
            PoolConfig(
                url=server.url,
                lookup_wait_s=0.2,
                timeout_s=1.0,
                retry_backoff_s=0.1,
                max_retry_backoff_s=0.2,
            ),
            lookups=True,
        )
        try:
            assert pool.count_hits([b"k"]) == 0  # the lookup thread answers
            assert pool.submit_store([(b"k", b"v")]) == 1 and pool.drain()
            # A lookup not answered in time pauses the pool; the health
            # thread reopens it once its own client's PING answers.
            server.pause()
            ticket = pool.submit_lookup([b"k"])
            time.sleep(0.3)
            pool.abandon(ticket)
            assert not pool.reads_open()
            server.resume()
            assert _until(pool.reads_open, 20)
            assert _clients(server) >= base + 4  # store, load, lookup, PING
        finally:
            pool.close()
        assert _alive(pool) == []
        # Before: the PING client's connection stayed open.
        assert _until(lambda: _clients(server) == base, 5), _clients(server)


def test_close_is_bounded_with_a_stopped_server_and_a_full_lookup_queue(
    server_kind,
):
    """Every thread blocked on a stopped server, the lookup queue full (no
    room for the thread's stop signal): close() returns within CLOSE_S,
    every thread has ended, every job has its (failed) result."""
    with redis_server(kind=server_kind) as server:
        pool = KVPool(
            PoolConfig(
                url=server.url, timeout_s=8.0, io_timeout_s=8.0, lookup_wait_s=8.0
            ),
            lookups=True,
        )
        try:
            assert pool.count_hits([b"k"]) == 0  # connected
            assert pool.submit_store([(b"w", b"v" * 64)]) == 1 and pool.drain()
            server.pause()
            first = pool.submit_lookup([b"a"])  # its thread waits on the server
            assert pool.submit_load("L", [b"w"]) == 1
            stored: list = []
            assert pool.submit_store([(b"x", b"v")], on_done=stored.append) == 1
            time.sleep(0.5)  # each taken by its thread
            tickets = [
                pool.submit_lookup([b"%d" % i]) for i in range(MAX_QUEUED_LOOKUPS + 1)
            ]
            assert tickets[-1].done and tickets[-1].present is None  # queue full
            start = time.monotonic()
        finally:
            pool.close()
        took = time.monotonic() - start
        assert took < CLOSE_S + 1.0, took  # before: 5 s per blocked thread
        assert _until(lambda: _alive(pool) == [], 2), _alive(pool)
        assert first.done and all(t.done for t in tickets)
        assert [job for job, _ in pool.poll_loads()] == ["L"]
        assert [s.complete for s in stored] == [False]
        server.resume()
