"""Real redis-server instances on free loopback ports, for tests."""

from __future__ import annotations

import contextlib
import random
import shutil
import socket
import subprocess
import tempfile
import time


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
            [
                "redis-server",
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                self.dir,
                *extra,
            ],
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

    def restart(self) -> None:
        """Stop and start again on the same port and folder (plain options)."""
        self.stop()
        self._spawn()


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
