"""Shared runner for the end-to-end tests: one vLLM run per process."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import tempfile

import pytest

HERE = pathlib.Path(__file__).parent


class LLMRun:
    def __init__(
        self, config: dict, env: dict[str, str], script: str = "run_llm.py"
    ) -> None:
        with tempfile.TemporaryDirectory() as tmp:
            out = pathlib.Path(tmp) / "result.json"
            full_env = {**os.environ, **env, "OVERLAY_RESULT_FILE": str(out)}
            proc = subprocess.run(
                [sys.executable, str(HERE / script), json.dumps(config)],
                env=full_env,
                capture_output=True,
                text=True,
                timeout=300,
            )
            text = out.read_text() if out.exists() else ""
        self.log = proc.stdout + proc.stderr
        if proc.returncode != 0 or not text:
            raise AssertionError(
                f"vLLM run {config} {env} failed "
                f"(rc={proc.returncode}):\n{self.log[-6000:]}"
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
