"""Driving the benchmark's pieces between replays: the proxy process, the
pool's server (or the fs tier's folder), resetting and warming nodes."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
import time
import urllib.error
import urllib.request

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1] / "tests"))
from support.served_vllm import SERVED_NAME, free_port, post, stop  # noqa: E402


class Proxy:
    """proxy.py in its own process on a free port, in front of ``ports``."""

    def __init__(self, ports: list[int], mode: str, log: pathlib.Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        backends = [f"http://127.0.0.1:{p}" for p in ports]
        self._cmd = [
            sys.executable,
            str(HERE / "proxy.py"),
            "--port",
            str(self.port),
            "--mode",
            mode,
            *backends,
        ]
        self._log = log

    def __enter__(self) -> Proxy:
        with open(self._log, "w") as out:
            self.proc = subprocess.Popen(
                self._cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        deadline = time.monotonic() + 30
        while True:
            try:
                self.sent()
                return self
            except (urllib.error.URLError, OSError):
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    stop(self.proc)
                    raise RuntimeError(
                        f"the proxy did not start: {self._log.read_text()[-2000:]}"
                    ) from None
                time.sleep(0.2)

    def __exit__(self, *exc) -> None:
        stop(self.proc)

    def sent(self) -> list[int]:
        """Requests sent to each node so far."""
        with urllib.request.urlopen(self.url + "/proxy/stats", timeout=5) as r:
            return json.loads(r.read())["sent"]


def reset_prefix_cache(port: int, deadline_s: float = 120.0) -> None:
    """Empty a node's device prefix cache (``VLLM_SERVER_DEV_MODE``).  On
    0.32 the reset fails while blocks are held (a connector's pending
    stores): a one-token request lets them finish, then it is tried again.
    0.11.2 answers no verdict (its nodes serve one configuration only, and
    every repeat's workload is new, so nothing depends on it there)."""
    deadline = time.monotonic() + deadline_s
    while True:
        answer = post(port, "/reset_prefix_cache")
        if answer is None or answer["success"]:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"node :{port} kept its prefix cache held")
        post(
            port,
            "/v1/completions",
            {"model": SERVED_NAME, "prompt": [5], "max_tokens": 1},
        )
        time.sleep(0.5)


def warm(port: int, prompts: list[list[int]]) -> None:
    """Each prompt once on this node (one token generated)."""
    for prompt in prompts:
        post(
            port,
            "/v1/completions",
            {"model": SERVED_NAME, "prompt": prompt, "max_tokens": 1},
            timeout=600,
        )


def pool_backend(
    stack, secondary: str, kinds: set, workdir: pathlib.Path, server_kind=None
) -> dict:
    """What the tiers share: a pool server (``url``, also for 0.11.2's
    connector; ``server_kind``: valkey or redis, default the tests') or,
    ``secondary="fs"``, a folder; ``flush()`` empties it."""
    backend = {"secondary": secondary, "flush": lambda: None}
    if not kinds & {"pool", "hostpool", "hostpool_0112"}:
        return backend
    if secondary == "fs":
        folder = workdir / "fs-tier"
        folder.mkdir()
        backend["fs_dir"] = str(folder)

        def flush_fs() -> None:  # the files; the tiers' folders stay
            for entry in folder.rglob("*"):
                if entry.is_file():
                    entry.unlink()

        backend["flush"] = flush_fs
    if secondary == "pool" or "hostpool_0112" in kinds:
        from support.redis_server import RedisServer

        server = RedisServer(**({"kind": server_kind} if server_kind else {}))
        stack.callback(server.close)
        backend["url"] = backend["url_0112"] = server.url
        backend["server_kind"] = getattr(server, "kind", "redis")
        previous = backend["flush"]

        def flush_redis() -> None:
            previous()
            server.cli("FLUSHALL")

        backend["flush"] = flush_redis
    return backend
