"""Real redis-server instances on free loopback ports, for tests."""

from __future__ import annotations

import contextlib
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time

from vllm_overlay.testing.redis import redis_server_command


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
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(20000, 50000)
        if _is_free(port) and _is_free(port + 10000):
            return port
    raise RuntimeError("no free port pair for a cluster node")


class RedisServer:
    def __init__(self, *extra: str, port: int | None = None) -> None:
        if shutil.which("redis-server") is None:
            raise RuntimeError(
                "redis-server not found (scripts/setup_env.sh installs it)"
            )
        self.port = port or free_port(cluster="--cluster-enabled" in extra)
        self.dir = tempfile.mkdtemp(prefix="vllm-overlay-redis-")
        self._spawn(extra)

    def _spawn(self, extra: tuple[str, ...] = ()) -> None:
        """Start redis-server on this port and folder; wait until it answers."""
        self.proc = subprocess.Popen(
            [*redis_server_command(self.port, self.dir), *extra],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self.wait_ready()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def cli(self, *args: str) -> str:
        return subprocess.run(
            ["redis-cli", "-p", str(self.port), *args],
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout.strip()

    def wait_ready(self, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server on {self.port} exited")
            if self.cli("ping") == "PONG":
                return
            time.sleep(0.05)
        raise RuntimeError(f"redis-server on {self.port} not ready")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)

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
def redis_server(*extra: str):
    server = RedisServer(*extra)
    try:
        yield server
    finally:
        server.stop()
        shutil.rmtree(server.dir, ignore_errors=True)


@contextlib.contextmanager
def redis_cluster(nodes: int = 3):
    """A local Redis Cluster of ``nodes`` masters (no replicas)."""
    servers = [
        RedisServer(
            "--cluster-enabled",
            "yes",
            "--cluster-config-file",
            "nodes.conf",
            "--cluster-node-timeout",
            "2000",
        )
        for _ in range(nodes)
    ]
    try:
        out = subprocess.run(
            [
                "redis-cli",
                "--cluster",
                "create",
                *[f"127.0.0.1:{s.port}" for s in servers],
                "--cluster-replicas",
                "0",
                "--cluster-yes",
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        if out.returncode != 0:
            raise RuntimeError(out.stdout + out.stderr)
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
            s.stop()
            shutil.rmtree(s.dir, ignore_errors=True)
