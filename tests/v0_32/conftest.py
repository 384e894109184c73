"""The vLLM 0.32 suite (tox -e v0_32) runs in .venv-0.32; its runners are
processes of their own, as in tests/e2e (whose LLMRun it shares).

Runs that tests only read are made once per session:

* ``shared_run`` memoizes a run by its script, config and environment (a
  reference several modules compare against, e.g. the PP flag's engine in
  test_pp_budget_cpu and test_rendered_series);
* ``run`` memoizes the runs of stock vLLM (``VLLM_OVERLAY_DISABLE=1``):
  the same arguments give the same run, whichever module asks (the stock
  fixture that test_offloading_cpu, test_tiering_cpu and
  test_pool_tier_cpu each hold).  Every other ``run`` is a new process.

A run that fails raises and is never kept.
"""

from __future__ import annotations

import importlib.util
import json
import pathlib

HERE = pathlib.Path(__file__).parent
_spec = importlib.util.spec_from_file_location(
    "e2e_conftest", HERE.parent / "e2e" / "conftest.py"
)
_e2e = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_e2e)
_E2ERun = _e2e.LLMRun

_shared: dict[str, object] = {}


def shared_run(script: str, config: dict | None = None, **env: str):
    """``run``'s result, made once per session for these arguments."""
    key = json.dumps([script, config or {}, env], sort_keys=True)
    if key not in _shared:
        _shared[key] = _E2ERun(config or {}, env, str(HERE / script))
    return _shared[key]


def run(script: str, config: dict | None = None, **env: str):
    """One runner process (``script`` in this folder); its result (stock
    vLLM's, with the overlay disabled, once per session: see above)."""
    if env.get("VLLM_OVERLAY_DISABLE") == "1":
        return shared_run(script, config, **env)
    return _E2ERun(config or {}, env, str(HERE / script))


class CaseRun:
    """One case of ``run_cases``: its ``result`` and ``log``, as a run's
    (a failed case raises when its result is read, in its own test)."""

    def __init__(self, name: str, out: dict) -> None:
        self.name, self.out, self.log = name, out, out["log"]

    @property
    def result(self) -> dict:
        if self.out["rc"] != 0 or self.out["result"] is None:
            raise AssertionError(
                f"case {self.name} failed (rc={self.out['rc']}):\n{self.log[-6000:]}"
            )
        return self.out["result"]


def run_cases(script: str, cases: dict[str, tuple[dict, dict]]) -> dict:
    """name -> CaseRun: each case (``script``'s config, its environment)
    in a forked child of one process that imported vLLM once
    (run_cases.py; for cases that start no engine).  Once per session for
    the same arguments."""
    spec = {
        "script": script,
        "cases": {n: {"config": c, "env": e} for n, (c, e) in cases.items()},
    }
    outs = shared_run("run_cases.py", spec).result
    return {name: CaseRun(name, outs[name]) for name in cases}
