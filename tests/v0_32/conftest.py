"""The vLLM 0.32 suite (tox -e v0_32) runs in .venv-0.32; its runners are
processes of their own, as in tests/e2e (whose LLMRun it shares)."""

from __future__ import annotations

import importlib.util
import pathlib

HERE = pathlib.Path(__file__).parent
_spec = importlib.util.spec_from_file_location(
    "e2e_conftest", HERE.parent / "e2e" / "conftest.py"
)
_e2e = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_e2e)
_E2ERun = _e2e.LLMRun


def run(script: str, config: dict | None = None, **env: str):
    """One runner process (``script`` in this folder); its result."""
    return _E2ERun(config or {}, env, str(HERE / script))
