"""The chaos test's processes: a real pool server (``kind``), two vLLM
nodes that share it through ``SharedKVPoolConnector`` (signed: a shared
secret file) and a stock vLLM node (no connector, overlay disabled) for
the reference tokens.  Each node is its own process
(``chaos_node.py``); every wait here has a deadline."""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import queue
import subprocess
import sys
import threading
import time

from vllm_overlay.testing.redis import DEFAULT_KIND

HERE = pathlib.Path(__file__).parent
NODE_SCRIPT = HERE / "chaos_node.py"
# Short timeouts and back-offs: a fault costs seconds, and the pool comes
# back within about a second of the server.  lookup_wait_s 1 s: a lookup
# starved of CPU on a loaded 2-core runner is not a pool fault.
POOL_OPTIONS = {
    "namespace": "chaos",
    "timeout_s": 1.0,
    "connect_timeout_s": 0.5,
    "lookup_wait_s": 1.0,
    "retry_backoff_s": 0.2,
    "max_retry_backoff_s": 1.0,
}
START_TIMEOUT_S = 420.0  # three engines starting at once on 2 cores


class NodeDied(RuntimeError):
    pass


class NodeProc:
    """A node process: commands on its stdin, JSON lines back on a pipe."""

    def __init__(
        self,
        name: str,
        config: dict,
        log_dir: pathlib.Path,
        env: dict,
        script: pathlib.Path = NODE_SCRIPT,
    ):
        self.name = name
        read_fd, write_fd = os.pipe()
        self.log_path = log_dir / f"node-{name}.log"
        self._log = open(self.log_path, "w")  # noqa: SIM115 - open while it runs
        self.proc = subprocess.Popen(
            [
                sys.executable,
                str(script),
                json.dumps({**config, "name": name, "result_fd": write_fd}),
            ],
            stdin=subprocess.PIPE,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            pass_fds=(write_fd,),
            env={**os.environ, **env},
            text=True,
        )
        os.close(write_fd)
        self.messages: queue.Queue = queue.Queue()
        self.done: dict[str, dict] = {}  # request id -> its "done" message
        self._replies: dict[tuple, dict] = {}
        self._cv = threading.Condition()
        self.closed = False
        self._reader = threading.Thread(
            target=self._read, args=(read_fd,), name=f"chaos-{name}", daemon=True
        )
        self._reader.start()

    def _read(self, fd: int) -> None:
        with os.fdopen(fd, "r") as f:
            for line in f:
                msg = json.loads(line)
                with self._cv:
                    if msg["kind"] == "done":
                        self.done[msg["id"]] = msg
                    else:
                        self._replies[(msg["kind"], msg.get("tag"))] = msg
                    self._cv.notify_all()
        with self._cv:
            self.closed = True
            self._cv.notify_all()

    def send(self, **cmd) -> None:
        try:
            self.proc.stdin.write(json.dumps(cmd) + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError) as exc:
            raise NodeDied(f"node {self.name}: {exc}; {self.why_dead()}") from exc

    def why_dead(self) -> str:
        """The exit status and the node's own error report (or its log)."""
        with self._cv:
            err = self._replies.get(("error", None))
        rc = self.proc.poll()
        if err is not None:
            return f"exited (rc={rc}) with:\n{err['traceback']}"
        return f"exited (rc={rc}); its log ends:\n{self.log_tail()}"

    def wait_for(self, kind: str, tag=None, timeout_s: float = 60.0) -> dict:
        deadline = time.monotonic() + timeout_s
        with self._cv:
            while (kind, tag) not in self._replies:
                if ("error", None) in self._replies:
                    err = self._replies[("error", None)]
                    raise NodeDied(f"node {self.name}: {err['traceback']}")
                if self.closed:
                    raise NodeDied(
                        f"node {self.name} exited (rc={self.proc.poll()}) "
                        f"before {kind!r}:\n{self.log_tail()}"
                    )
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(
                        f"node {self.name}: no {kind!r} within {timeout_s:.0f} s"
                    )
                self._cv.wait(min(left, 1.0))
            return self._replies.pop((kind, tag))

    def wait_done(self, req_id: str, timeout_s: float) -> dict | None:
        """The request's result, or None after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        with self._cv:
            while req_id not in self.done:
                left = deadline - time.monotonic()
                if left <= 0 or self.closed:
                    return None
                self._cv.wait(min(left, 0.5))
            return self.done[req_id]

    def request(self, op: str, wait_s: float = 60.0, **fields) -> dict:
        """Send ``op`` (stats, drain, or a node's own command, which
        replies with its name) and wait ``wait_s`` for its reply."""
        tag = f"{op}-{time.monotonic_ns()}"
        self.send(op=op, tag=tag, **fields)
        reply = {"stats": "stats", "drain": "drained"}.get(op, op)
        return self.wait_for(reply, tag, wait_s)

    def log_tail(self, chars: int = 6000) -> str:
        with contextlib.suppress(OSError):
            self._log.flush()
            return self.log_path.read_text(errors="replace")[-chars:]
        return ""

    def finish(self, timeout_s: float) -> dict:
        self.send(op="finish", timeout_s=timeout_s)
        return self.wait_for("final", None, timeout_s + 60.0)

    def stop(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=30)
        self._log.close()


class Cluster:
    """The pool server (``kind``: vllm_overlay/testing/redis.py), the secret,
    two pool nodes and (``stock``) a stock node, each running ``script``
    (a node of this interpreter's vLLM release: chaos_node.py for 0.11.2).
    A context manager: everything it started is stopped on exit."""

    def __init__(
        self,
        workdir: pathlib.Path,
        stock: bool = True,
        num_blocks: int = 48,
        kind: str = DEFAULT_KIND,
        script: pathlib.Path = NODE_SCRIPT,
    ) -> None:
        from support.redis_server import RedisServer

        self.workdir = workdir
        workdir.mkdir(parents=True, exist_ok=True)
        self.secret_file = workdir / "pool-secret"
        self.secret_file.write_text(os.urandom(32).hex())
        self.server = RedisServer(kind=kind)
        pool = {**POOL_OPTIONS, "secret_file": str(self.secret_file)}
        env = {
            "TORCHDYNAMO_DISABLE": "1",
            "TOKENIZERS_PARALLELISM": "false",
            "HF_HUB_OFFLINE": "1",
            "VLLM_CPU_OMP_THREADS_BIND": "nobind",
            # One compute thread per engine: the 2 cores are shared by
            # three engines, the pool server and the pool threads.
            "OMP_NUM_THREADS": "1",
        }
        self.nodes = [
            NodeProc(
                name,
                {"url": self.server.url, "pool": pool, "num_blocks": num_blocks},
                workdir,
                env,
                script,
            )
            for name in ("a", "b")
        ]
        self.stock = (
            NodeProc(
                "stock",
                {"url": None, "num_blocks": 256, "logprobs": True},
                workdir,
                {**env, "VLLM_OVERLAY_DISABLE": "1"},
                script,
            )
            if stock
            else None
        )

    @property
    def mac_key(self) -> bytes:
        from vllm_overlay.core.pool.config import PoolConfig

        return PoolConfig(
            url=self.server.url, secret_file=str(self.secret_file)
        ).mac_key

    def all_nodes(self) -> list[NodeProc]:
        return self.nodes + ([self.stock] if self.stock else [])

    def wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        for node in self.all_nodes():
            node.wait_for("ready", None, max(1.0, deadline - time.monotonic()))

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        for node in self.all_nodes():
            node.stop()
        with contextlib.suppress(Exception):
            self.server.resume()  # a SIGSTOPped server cannot be killed cleanly
        self.server.close()
