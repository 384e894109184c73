"""Shared runner for the end-to-end tests: one vLLM run per process.

The runner scripts in ``FORKED`` run as forked children of one process
that imported vLLM once per session (tests/support/run_zygote.py): a
child starts as the script's own process would, with the run's
environment, minus the import (a run whose environment sets ``PYTHONPATH``
forks from a zygote started with it).  ``OVERLAY_TESTS_FORK=0`` runs every
script as a process of its own; so does a run whose environment sets
another variable Python reads only at start-up (``PYTHON*``).
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import tempfile

import pytest
from support.zygote_client import DEADLINE_S, enabled, forked_run

HERE = pathlib.Path(__file__).parent
# Runner scripts (by path) run in a forked child; each was checked to give
# the results and logs of its own process.  What a run leaves running is
# killed with it: a process meant to outlive the run starts a session of
# its own (run_pool.py's restarted server).
FORKED = {
    str(HERE.parent / "v0_32" / name)
    for name in (
        "run_cases.py",
        "run_front_end.py",
        "run_idle.py",
        "run_idle_lookup.py",
        "run_layout.py",
        "run_offload.py",
        "run_pp.py",
        "run_pressure.py",
        "run_refusals.py",
        "run_region_release.py",
    )
} | {
    str(HERE / name)
    for name in (
        "run_llm.py",
        "run_offload.py",
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


def _forks(script: str, env: dict[str, str]) -> bool:
    return (
        enabled()
        and script in FORKED
        and not any(n.startswith("PYTHON") and n != "PYTHONPATH" for n in env)
    )


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
                rc = forked_run(script, [json.dumps(config)], full_env, log)
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
