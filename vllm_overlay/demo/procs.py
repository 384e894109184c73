"""Demo engines in forked children of the demo's process."""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import time

from vllm_overlay.testing.forked import fork_child, log_tail


def wait_for(path: str, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {path} after {timeout_s} s")
        time.sleep(0.05)


class NodeProcess:
    """A ``node.Node`` in a forked child of this process.

    The parent has imported vLLM (the bulk of an engine's start-up on CPU)
    but not started an engine nor registered the overlay, so the child only
    builds its engine, and registers the overlay with its own environment
    (the config's ``env``: e.g. patches to skip).  The child builds its
    engine at once, writes ``<name>.json.ready``, waits for ``.go`` (the
    demo measures one engine at a time), runs its passes and writes
    ``<name>.json``.
    """

    def __init__(self, name: str, config: dict, workdir: str) -> None:
        self.name = name
        self.out = os.path.join(workdir, f"{name}.json")
        self.log_path = os.path.join(workdir, f"{name}.log")
        self.returncode: int | None = None
        self.pid = fork_child(lambda: self._child(config), self.log_path)

    def _child(self, config: dict) -> None:
        from vllm_overlay.demo.node import Node

        node = Node(config)
        open(self.out + ".ready", "w").close()
        wait_for(self.out + ".go")
        result = node.run_passes()
        with open(self.out + ".tmp", "w") as f:
            json.dump(result, f)
        os.replace(self.out + ".tmp", self.out)

    def _poll(self) -> bool:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode is not None

    def _wait(self, path: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not os.path.exists(path):
            if self._poll() and not os.path.exists(path):
                raise RuntimeError(
                    self._failure(f"exited with status {self.returncode}")
                )
            if time.monotonic() > deadline:
                raise RuntimeError(self._failure("timed out"))
            time.sleep(0.05)

    def _failure(self, what: str) -> str:
        tail = log_tail(self.log_path)
        return f"{self.name} engine {what} (log {self.log_path}):\n{tail}"

    def wait_ready(self, timeout_s: float = 300) -> None:
        self._wait(self.out + ".ready", timeout_s)

    def measure(self, timeout_s: float = 180) -> dict:
        open(self.out + ".go", "w").close()
        self._wait(self.out, timeout_s)
        return json.loads(pathlib.Path(self.out).read_text())

    def stop(self) -> None:
        if not self._poll():
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, 9)
            os.waitpid(self.pid, 0)
            self.returncode = -9
