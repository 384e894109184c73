"""Shared runner for the end-to-end tests: one vLLM run per process.

The runner scripts in ``FORKED`` run as forked children of one process
that imported vLLM once per session (tests/support/run_zygote.py): a
child starts as the script's own process would, with the run's
environment, minus the import.  ``OVERLAY_TESTS_FORK=0`` runs every
script as a process of its own; so does a run whose environment sets a
variable Python reads only at start-up (``PYTHONPATH``).
"""

from __future__ import annotations

import atexit
import json
import os
import pathlib
import subprocess
import sys
import tempfile

import pytest

HERE = pathlib.Path(__file__).parent
ZYGOTE = HERE.parent / "support" / "run_zygote.py"
DEADLINE_S = 300
# Runner scripts (by path) run in a forked child; each was checked to give
# the results and logs of its own process.  What a run leaves running is
# killed with it: a process meant to outlive the run starts a session of
# its own (run_pool.py's restarted server).
FORKED = {
    str(HERE.parent / "v0_32" / name)
    for name in (
        "run_layout.py",
        "run_pp.py",
        "run_pressure.py",
        "run_refusals.py",
    )
} | {
    str(HERE / name)
    for name in (
        "run_llm.py",
        "run_pp.py",
        "run_pool.py",
        "run_multi.py",
        "run_pool_badbytes.py",
        "run_pressure.py",
        "run_sched_scenarios.py",
        "run_pp_connectors.py",
        "run_mla.py",
    )
}

_zygote: subprocess.Popen | None = None


def _forks(script: str, env: dict[str, str]) -> bool:
    return (
        os.environ.get("OVERLAY_TESTS_FORK", "1") != "0"
        and script in FORKED
        and not any(name.startswith("PYTHON") for name in env)
    )


def _stop_zygote() -> None:
    if _zygote is not None and _zygote.poll() is None:
        _zygote.kill()
        _zygote.wait()


def _forked_run(script: str, argv: list[str], env: dict, log: pathlib.Path) -> int:
    """The run's exit status: run_zygote.py forks it (started on first use)."""
    global _zygote
    if _zygote is None or _zygote.poll() is not None:
        errors = pathlib.Path(tempfile.gettempdir()) / "run_zygote.log"
        with open(errors, "a") as zygote_log:  # the child keeps its own copy
            _zygote = subprocess.Popen(
                [sys.executable, str(ZYGOTE)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=zygote_log,
                text=True,
            )
        atexit.register(_stop_zygote)
        ready = _zygote.stdout.readline()
        if ready.strip() != '{"ready": true}':
            _stop_zygote()
            raise AssertionError(f"run_zygote.py did not start (see {errors})")
    request = {
        "script": script,
        "argv": argv,
        "env": env,
        "log": str(log),
        "deadline_s": DEADLINE_S,
    }
    _zygote.stdin.write(json.dumps(request) + "\n")
    _zygote.stdin.flush()
    answer = _zygote.stdout.readline()
    assert answer, "run_zygote.py exited (see run_zygote.log in the session's TMPDIR)"
    return json.loads(answer)["rc"]


class LLMRun:
    def __init__(
        self, config: dict, env: dict[str, str], script: str = "run_llm.py"
    ) -> None:
        script = str(HERE / script)  # an absolute path stays as it is
        with tempfile.TemporaryDirectory() as tmp:
            out = pathlib.Path(tmp) / "result.json"
            full_env = {**os.environ, **env, "OVERLAY_RESULT_FILE": str(out)}
            if _forks(script, env):
                log = pathlib.Path(tmp) / "run.log"
                rc = _forked_run(script, [json.dumps(config)], full_env, log)
                self.log = log.read_text(errors="replace") if log.exists() else ""
            else:
                proc = subprocess.run(
                    [sys.executable, script, json.dumps(config)],
                    env=full_env,
                    capture_output=True,
                    text=True,
                    timeout=DEADLINE_S,
                )
                rc, self.log = proc.returncode, proc.stdout + proc.stderr
            text = out.read_text() if out.exists() else ""
        if rc != 0 or not text:
            raise AssertionError(
                f"vLLM run {config} {env} failed (rc={rc}):\n{self.log[-6000:]}"
            )
        self.result = json.loads(text)
        self.passes = self.result.get("passes")
        self.kv = self.result.get("kv")

    def tokens(self, pass_index: int = 0) -> list[list[int]]:
        return [p["tokens"] for p in self.passes[pass_index]]

    def logprobs(self, pass_index: int = 0) -> list[list[float]]:
        return [p["logprobs"] for p in self.passes[pass_index]]

    def layout_log_lines(self) -> list[str]:
        return [ln for ln in self.log.splitlines() if "KV cache layout:" in ln]


_cache: dict[str, LLMRun] = {}


@pytest.fixture(scope="session")
def llm_run():
    """llm_run(config, **env) -> LLMRun, memoized for the session."""

    return _memoized("run_llm.py")


@pytest.fixture(scope="session")
def offload_run():
    """offload_run(config, **env) -> LLMRun of run_offload.py."""
    return _memoized("run_offload.py")


@pytest.fixture(scope="session")
def pp_run():
    """pp_run(config, **env) -> LLMRun of run_pp.py."""
    return _memoized("run_pp.py")


@pytest.fixture
def pool_node():
    """pool_node(config, **env) -> LLMRun of run_pool.py (not memoized:
    each call is a new node process against the current pool state)."""
    return lambda config, **env: LLMRun(config, env, "run_pool.py")


def _memoized(script: str):
    def run(config: dict, **env: str) -> LLMRun:
        key = json.dumps([script, config, env], sort_keys=True)
        if key not in _cache:
            _cache[key] = LLMRun(config, env, script)
        return _cache[key]

    return run
