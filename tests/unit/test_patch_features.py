"""Which configurations use which patched feature (patch_features): a
patch that did not apply refuses the configurations that use its feature,
and only those.  The refusal on real vLLM 0.32 is in tests/v0_32/test_gate.py."""

from __future__ import annotations

import pytest

from vllm_overlay import patch_features
from vllm_overlay.patches import all_patches

POOL = {
    "kv_connector": "OffloadingConnector",
    "kv_connector_extra_config": {
        "spec_name": "TieringOffloadingSpec",
        "secondary_tiers": [
            {"type": "fs", "root_dir": "/tmp/x"},
            {"type": "SharedPoolTier", "module_path": "vllm_overlay.integration.v0_32"},
        ],
    },
}


@pytest.mark.parametrize("entry", ["0.11.2", "0.32.x"])
def test_every_patched_feature_says_what_uses_it(entry):
    """A new feature gets an entry (else any configuration counts as using
    it, and a failed patch of it refuses everything)."""
    features = {patch.feature for patch in all_patches(entry)}
    assert features <= set(patch_features.FEATURE_NEEDS)


def test_what_uses_each_feature():
    uses = patch_features.uses
    stock = {"kv_transfer_config": None, "additional_config": {}}
    for feature in patch_features.FEATURE_NEEDS:
        assert uses(feature, stock) == [], feature
    pool = {"kv_transfer_config": POOL}
    assert uses("shared KV pool tier", pool) == [
        "secondary tier 'vllm_overlay.integration.v0_32'"
    ]
    # the harness's vLLM runs on the CPU platform
    assert uses("host offloading on the CPU platform", pool) == [
        "kv_connector 'OffloadingConnector' on the CPU platform"
    ]
    nested = {
        "kv_transfer_config": {
            "kv_connector": "MultiConnector",
            "kv_connector_extra_config": {
                "connectors": [{"kv_connector": "SharedKVPoolConnector"}]
            },
        }
    }
    assert uses("async KV loads (shared pool, offloading)", nested) == [
        "kv_connector 'SharedKVPoolConnector'"
    ]
    assert uses("cross-layer KV blocks", nested) == [
        "kv_connector 'SharedKVPoolConnector'"
    ]
    pp = {"additional_config": {"enable_pp_prop_kv_cache": True}}
    assert uses("pipeline-parallel KV budget", pp)
    assert uses("a feature nobody listed", stock)  # always used
