"""A throwaway redis-server for the demo, the eval suites and the tests'
support code (tests/support/redis_server.py builds on the command)."""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import tempfile
import time


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pong(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


def redis_server_command(port: int, workdir: str) -> list[str]:
    """redis-server on loopback PORT, no persistence (RDB nor AOF)."""
    return [
        "redis-server",
        "--port",
        str(port),
        "--bind",
        "127.0.0.1",
        "--save",
        "",
        "--appendonly",
        "no",
        "--dir",
        workdir,
    ]


@contextlib.contextmanager
def redis_server(start_timeout_s: float = 10.0):
    """A redis-server on a free loopback port, no persistence; yields its
    URL and is killed on exit."""
    port = _free_port()
    workdir = tempfile.mkdtemp(prefix="vllm-overlay-redis-")
    proc = subprocess.Popen(
        redis_server_command(port, workdir),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + start_timeout_s
        while not _pong(port):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"redis-server on port {port} did not start")
            time.sleep(0.05)
        yield f"redis://127.0.0.1:{port}"
    finally:
        proc.kill()
        proc.wait(timeout=10)
        shutil.rmtree(workdir, ignore_errors=True)
