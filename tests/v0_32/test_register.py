"""The overlay on vLLM 0.32: the 0.32 patch set is applied, and what runs
on 0.11.2 only (the overlay's own connectors and offloading spec, also by
module path) is a startup error naming where it runs, never stock vLLM
silently nor a connector against internals it was not written for.
``--enable-pp-prop-kv-cache`` runs on 0.32 (test_pp_budget_cpu.py)."""

from __future__ import annotations

import pytest
from conftest import run


@pytest.fixture(scope="module")
def result():
    return run("run_refusals.py").result


def test_the_0_32_patch_set_is_registered(result):
    """Every patch of the set, each with what happened to it: applied where
    its module is loaded (the front end's EngineArgs, the engine core),
    waiting for its module otherwise (nothing built an engine here), none
    failed (register() would say "applied; not applied: ...")."""
    assert result["outcome"] == "applied"
    waiting = ("CL32-01", "MLA32-01", "OF32-01", "OF32-02", "OF32-03", "PT32-01")
    waiting += ("OF32-04", "OF32-05", "OF32-06")  # failed copies
    applied = ("EC32-01", "EC32-02", "PP32-01", "PP32-02", "PP32-03", "PP32-04")
    applied += ("KI32-01", "KI32-02", "KI32-03")  # the pool's KV identity
    assert result["patches"] == {
        **dict.fromkeys(waiting, "pending"),
        **dict.fromkeys(applied, "applied"),
    }


@pytest.mark.parametrize(
    "case, named",
    [
        ("pool", "kv_connector 'SharedKVPoolConnector'"),
        ("offload_connector", "kv_connector 'OverlayOffloadingConnector'"),
        ("offload_spec", "spec_name 'OverlayCPUOffloadingSpec'"),
        ("module_path", "kv_connector_module_path 'vllm_overlay.connectors"),
    ],
)
def test_features_of_0_11_2_are_refused_at_startup(result, case, named):
    outcome = result[case]
    assert outcome["error"] in ("UnsupportedVLLMVersion", "ArgumentError")
    message = outcome["message"]
    assert named in message
    assert "on vLLM 0.11.2 only; found vLLM 0.32.0" in message
    assert "Install vLLM 0.11.2" in message


def test_the_pp_flag_is_not_refused(result):
    assert result["cli_flag"] == {"error": None}
