"""The pool under faults (issue 19): redis-py missing, a server that trickles
bytes, a job that raises, a thread that is stuck, integrity refusals against
transient failures.  Real redis-server (or a real loopback socket standing
in for a misbehaving server); every test fails without its fix."""

from __future__ import annotations

import os
import pathlib
import socket
import subprocess
import sys
import textwrap
import threading
import time

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from support.redis_server import redis_server  # noqa: E402

from vllm_overlay.core.pool.config import PoolConfig  # noqa: E402
from vllm_overlay.core.pool.pool import KVPool  # noqa: E402

FAST = dict(
    connect_timeout_s=0.5,
    timeout_s=1.0,
    lookup_wait_s=0.2,
    retry_backoff_s=0.3,
    max_retry_backoff_s=0.6,
)
ROOT = pathlib.Path(__file__).resolve().parents[2]


def _until(predicate, timeout_s: float = 10.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        result = predicate()
        if result:
            return result
        time.sleep(0.01)
    raise AssertionError("timed out")


def _poll_one(pool: KVPool, timeout_s: float):
    return _until(lambda: pool.poll_loads(), timeout_s)[0]


# -- redis-py missing ----------------------------------------------------------
_NO_REDIS = textwrap.dedent(
    """
    import sys, time, json
    sys.modules["redis"] = None  # as after pip install vllm-overlay (no [pool])
    from vllm_overlay.core.pool.config import PoolConfig
    from vllm_overlay.core.pool.errors import PoolDependencyError, require_dependencies
    from vllm_overlay.core.pool.pool import KVPool

    pool = KVPool(PoolConfig(url="redis://127.0.0.1:9", lookup_wait_s=0.2),
                  io_threads=False, lookups=True)
    time.sleep(0.5)
    start = time.monotonic()
    tickets = [pool.submit_lookup([b"k%d" % i]) for i in range(5)]
    while not all(t.done for t in tickets) and time.monotonic() - start < 5:
        time.sleep(0.005)
    out = {
        "done_after_s": time.monotonic() - start,
        "all_done": all(t.done for t in tickets),
        "hits": [t.hits for t in tickets],
        "threads": pool.threads_alive(),
        "lookup_wait_s": pool.lookup_wait_s(),
    }
    try:
        require_dependencies()
        out["error"] = None
    except PoolDependencyError as exc:
        out["error"] = str(exc)
    pool.close()
    print(json.dumps(out))
    """
)


def test_without_redis_py_lookups_answer_at_once_and_startup_says_what_to_install():
    import json

    env = {**os.environ, "VLLM_OVERLAY_DISABLE": "1"}
    run = subprocess.run(
        [sys.executable, "-c", _NO_REDIS],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env=env,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    # Before: the lookup thread died (classify imported redis inside its
    # except block), tickets were never answered and every request waited
    # lookup_wait_s.
    assert out["all_done"] and out["hits"] == [0] * 5
    assert out["done_after_s"] < 1.0
    assert all(out["threads"].values()), out["threads"]
    assert out["lookup_wait_s"] == 0.2  # the lookup thread got going
    assert "pip install 'vllm-overlay[pool]'" in out["error"]
    assert "redis" in out["error"]


_CONNECTOR_NO_REDIS = textwrap.dedent(
    """
    import sys
    sys.modules["redis"] = None
    import vllm_overlay
    vllm_overlay.register()
    from tests.unit.test_pool_connector import make
    from vllm_overlay.core.pool.errors import PoolDependencyError
    for role in ("SCHEDULER", "WORKER"):
        try:
            make(role, "redis://127.0.0.1:9")
        except PoolDependencyError as exc:
            print("REFUSED", role, exc)
        else:
            print("STARTED", role)
    """
)


def test_the_connector_refuses_to_start_without_redis_py():
    run = subprocess.run(
        [sys.executable, "-c", _CONNECTOR_NO_REDIS],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=ROOT,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    lines = [x for x in run.stdout.splitlines() if x.startswith(("REFUSED", "STARTED"))]
    assert [x.split()[:2] for x in lines] == [
        ["REFUSED", "SCHEDULER"],
        ["REFUSED", "WORKER"],
    ], run.stdout
    assert all("pip install 'vllm-overlay[pool]'" in x for x in lines)


# -- a server that trickles its replies --------------------------------------
class TrickleServer:
    """A loopback socket speaking just enough RESP for redis-py: every
    command is answered at once, except GET, whose value (``value_bytes``
    of it) is sent one byte a second."""

    def __init__(self, value_bytes: int = 1000) -> None:
        self.value_bytes = value_bytes
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.stop = threading.Event()
        self.gets = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        self.sock.settimeout(0.2)
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _commands(self, conn):
        buf = b""
        while not self.stop.is_set():
            while True:
                parsed = _parse(buf)
                if parsed is None:
                    break
                args, buf = parsed
                yield args
            chunk = conn.recv(65536)
            if not chunk:
                return
            buf += chunk

    def _serve(self, conn) -> None:
        try:
            for args in self._commands(conn):
                name = args[0].upper()
                if name == b"GET":
                    self.gets += 1
                    reply = b"$%d\r\n" % self.value_bytes
                    conn.sendall(reply)
                    for _ in range(self.value_bytes):
                        if self.stop.wait(1.0):
                            return
                        conn.sendall(b"x")
                elif name == b"EXISTS":
                    conn.sendall(b":1\r\n")
                elif name == b"HELLO":  # redis-py 8 speaks RESP3
                    conn.sendall(b"%1\r\n$5\r\nproto\r\n:3\r\n")
                elif name == b"PING":
                    conn.sendall(b"+PONG\r\n")
                else:
                    conn.sendall(b"+OK\r\n")
        except OSError:
            pass
        finally:
            conn.close()

    def close(self) -> None:
        self.stop.set()
        self.sock.close()


def _parse(buf: bytes):
    """One RESP array of bulk strings from ``buf``: (args, rest) or None."""
    if not buf.startswith(b"*") or b"\r\n" not in buf:
        return None
    head, rest = buf.split(b"\r\n", 1)
    args = []
    for _ in range(int(head[1:])):
        if b"\r\n" not in rest:
            return None
        line, rest = rest.split(b"\r\n", 1)
        n = int(line[1:])
        if len(rest) < n + 2:
            return None
        args.append(rest[:n])
        rest = rest[n + 2 :]
    return args, rest


def test_a_load_from_a_server_that_trickles_bytes_ends_at_its_deadline():
    server = TrickleServer(value_bytes=1000)
    # Each read waits at most timeout_s (1.5 s) and a byte comes every 1 s,
    # so no single read ever times out: only the whole job's deadline
    # (io_timeout_s) can end the load.  (With timeout_s equal to the
    # trickle interval, a late byte ended it after one read's timeout.)
    config = dict(FAST, timeout_s=1.5)
    pool = KVPool(
        PoolConfig(url=f"redis://127.0.0.1:{server.port}", io_timeout_s=3.0, **config)
    )
    try:
        start = time.monotonic()
        assert pool.submit_load("job", [b"k1", b"k2"]) == 2
        job_id, values = _poll_one(pool, 20)
        took = time.monotonic() - start
        # Before: the load (and its request) waited for all 1000 bytes.
        assert job_id == "job" and values == [None, None]  # recompute
        assert 2.5 < took < 5.5, took
        assert server.gets >= 1
        assert all(pool.threads_alive().values())
        assert pool.state()["read"] == "slow"  # paused: no request waits on it
        assert pool.cumulative()["errors"] >= 1
        # While paused, a load is done at once (nothing fetched).
        start = time.monotonic()
        assert pool.submit_load("next", [b"k1"]) == 0
        assert _poll_one(pool, 1)[1] == [None]
        assert time.monotonic() - start < 0.5
    finally:
        server.close()
        pool.close()


# -- a job that raises ---------------------------------------------------------
def test_a_job_that_raises_fails_only_itself_and_pauses_nothing(server_kind):
    with redis_server(kind=server_kind) as server:
        pool = KVPool(PoolConfig(url=server.url, **FAST))
        try:
            assert pool.submit_store([(b"a", b"1" * 64), (b"b", b"2" * 64)]) == 2
            assert pool.drain()

            def broken_into(i, length):
                raise TypeError("a bug in a caller's callback")

            assert pool.submit_load("bad", [b"a", b"b"], into=broken_into) == 2
            job_id, values = _poll_one(pool, 10)
            assert job_id == "bad" and values == [None, None]
            released = []

            def broken_encode(key, payload):
                raise KeyError("a bug in the encoder")

            pool.submit_store(
                [(b"c", b"3" * 64)],
                encode=broken_encode,
                on_done=lambda outcome: released.append(outcome),
            )
            assert pool.drain() and [r.complete for r in released] == [False]
            # Before: each was a 'bad request' (a 30 s pause, logged as the
            # server's fault): the next load and store were skipped.
            assert pool.state() == {"read": "open", "write": "open"}
            assert pool.submit_load("good", [b"a", b"b"]) == 2
            job_id, values = _poll_one(pool, 10)
            assert job_id == "good" and values == [b"1" * 64, b"2" * 64]
            assert pool.submit_store([(b"d", b"4" * 64)]) == 1 and pool.drain()
            assert pool.cumulative()["stored_blocks"] == 3
            assert pool.cumulative()["internal_errors"] == 2
            assert all(pool.threads_alive().values())
        finally:
            pool.close()


def test_a_handler_that_raises_does_not_kill_its_thread(server_kind, monkeypatch):
    """An exception escaping a handler (here: the lookup handler itself) is
    logged; the thread takes the next job."""
    with redis_server(kind=server_kind) as server:
        server.cli("set", "k", "v")
        pool = KVPool(PoolConfig(url=server.url, **FAST), io_threads=False)
        real = pool._lookup
        calls = []

        def flaky(client, ticket):
            calls.append(1)
            if len(calls) == 1:
                raise RuntimeError("a bug outside the handler's own try")
            real(client, ticket)

        monkeypatch.setattr(pool, "_lookup", flaky)
        pool._start_lookups()
        try:
            first = pool.submit_lookup([b"k"])
            time.sleep(0.5)
            assert pool.threads_alive()["lookup"]  # before: died
            assert pool.count_hits([b"k"]) == 1
            assert first.abandoned or not first.done or first.hits == 0
        finally:
            pool.close()


# -- a stuck thread --------------------------------------------------------------
def test_a_stuck_load_thread_is_detected_and_the_pool_pauses_instead(server_kind):
    with redis_server(kind=server_kind) as server:
        pool = KVPool(
            PoolConfig(url=server.url, io_timeout_s=1.0, **FAST), lookups=True
        )
        release = threading.Event()
        try:
            assert pool.submit_store([(b"a", b"1" * 64)]) == 1 and pool.drain()

            def hang(i, value):  # a callback that never returns in time
                release.wait(30)

            start = time.monotonic()
            assert pool.submit_load("stuck", [b"a"], landed=hang) == 1
            job_id, values = _poll_one(pool, 10)
            took = time.monotonic() - start
            # Before: the load (and its request) waited for the callback.
            assert job_id == "stuck" and values == [None]
            assert took < 4.0, took
            _until(lambda: pool.state()["read"] == "stuck", 5)
            # Paused: lookups are misses at once, loads are done at once.
            start = time.monotonic()
            assert pool.count_hits([b"a"], timeout_s=1) == 0
            assert pool.submit_load("later", [b"a"]) == 0
            assert pool.poll_loads() == [("later", [None])]
            assert time.monotonic() - start < 0.5
            assert pool.cumulative()["stuck"] >= 1
            assert pool.cumulative()["load_timeouts"] == 1
            release.set()  # the thread is free again: the pool resumes
            _until(lambda: pool.state()["read"] == "open", 10)
            assert pool.submit_load("again", [b"a"]) == 1
            assert _poll_one(pool, 10) == ("again", [b"1" * 64])
            assert all(pool.threads_alive().values())
        finally:
            release.set()
            pool.close()


# -- bounds --------------------------------------------------------------------
def test_a_value_longer_than_asked_for_is_never_allocated(server_kind):
    with redis_server(kind=server_kind) as server:
        server.cli("set", "big", "x" * 100_000)
        server.cli("set", "ok", "y" * 100)
        pool = KVPool(PoolConfig(url=server.url, **FAST))
        try:
            assert pool.submit_load("j", [b"big", b"ok"], value_bytes=100) == 2
            _, values = _poll_one(pool, 10)
            assert type(values[0]).__name__ == "Oversized"
            assert len(values[0]) == 100_000 and values[1] == b"y" * 100
        finally:
            pool.close()


def test_limits_smaller_than_one_value_are_refused_at_startup():
    pool = KVPool(
        PoolConfig(url="redis://127.0.0.1:9", max_inflight_bytes=1000),
        io_threads=False,
    )
    try:
        pool.check_value_size(1000)
        with pytest.raises(ValueError, match="max_inflight_bytes .* smaller than"):
            pool.check_value_size(1001)
    finally:
        pool.close()


def test_the_lookup_queue_is_bounded(server_kind, monkeypatch):
    from vllm_overlay.core.pool import pool as pool_module

    monkeypatch.setattr(pool_module, "MAX_QUEUED_LOOKUPS", 3)
    with redis_server(kind=server_kind) as server:
        server.pause()  # lookups pile up
        pool = KVPool(PoolConfig(url=server.url, **FAST), io_threads=False)
        try:
            tickets = [pool.submit_lookup([b"k%d" % i]) for i in range(10)]
            skipped = [t for t in tickets if t.done]
            assert len(skipped) >= 6  # answered "miss" at once
            assert pool.cumulative()["lookups_skipped"] >= 6
        finally:
            server.resume()
            pool.close()


def test_tls_clients_check_the_host_name():
    config = PoolConfig(url="rediss://pool.example:6380")
    assert config.client_kwargs()["ssl_check_hostname"] is True
    off = PoolConfig(url="rediss://pool.example:6380?ssl_cert_reqs=none")
    assert off.client_kwargs()["ssl_check_hostname"] is False


def test_cumulative_leaves_the_interval_to_take_stats(server_kind):
    with redis_server(kind=server_kind) as server:
        pool = KVPool(PoolConfig(url=server.url, **FAST))
        try:
            assert pool.submit_store([(b"a", b"1")]) == 1 and pool.drain()
            assert pool.cumulative()["stored_blocks"] == 1
            # Before: cumulative() consumed the interval vLLM's metrics report.
            assert pool.take_stats().stored_blocks == 1
            assert pool.cumulative()["stored_blocks"] == 1
            assert pool.take_stats().stored_blocks == 0
        finally:
            pool.close()
