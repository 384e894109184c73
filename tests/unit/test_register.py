"""register(): re-entrant, version-gated, can be disabled or made strict.

Each case runs in a fresh interpreter: register() decides once per process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from vllm_overlay import is_supported_version

PROBE = """
import importlib, json, logging, os, sys, vllm
logging.basicConfig(level=logging.INFO)
if len(sys.argv) > 1:
    vllm.__version__ = sys.argv[1]
gone = os.environ.get("PROBE_GONE")  # module:attribute a patch release removed
if gone:
    module, name = gone.split(":")
    delattr(importlib.import_module(module), name)
import vllm_overlay
from vllm_overlay.core.patching import REGISTRY
first = vllm_overlay.register()
second = vllm_overlay.register()
from vllm.attention.backends.abstract import AttentionBackend
states = REGISTRY.states()
applied = [s.patch.id for s in states if s.status == "applied"]
print("RESULT:" + json.dumps({"first": first, "second": second,
      "applied": applied, "states": len(states),
      "status": {s.patch.id: s.status for s in states},
      "loaded": [s.patch.id for s in states if s.patch.module in sys.modules],
      "has_keyword": "include_num_layers_dimension" in
          AttentionBackend.get_kv_cache_stride_order.__code__.co_varnames}))
"""


def run_probe(*args: str, **env: str) -> tuple[int, dict | None, str]:
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, *args],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=300,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT:")]
    result = json.loads(lines[0][7:]) if lines else None
    return proc.returncode, result, proc.stdout + proc.stderr


def test_register_twice_applies_once():
    rc, result, log = run_probe()
    assert rc == 0, log
    assert result["first"] == result["second"] == "applied"
    assert result["has_keyword"]
    # Every registered patch is recorded once; importing the abstract
    # backend module applied CL-01 exactly once.
    from vllm_overlay.patches import all_patches

    assert result["states"] == len(all_patches())
    assert "CL-01" in result["applied"]
    assert log.count("vllm-overlay 0.1.0 applied to vLLM 0.11.2") == 1
    # Each patch whose module is loaded is applied; the rest wait for theirs.
    status = result["status"]
    assert result["loaded"] and set(result["applied"]) == set(result["loaded"])
    assert set(status.values()) <= {"applied", "pending"}, status


def test_a_patch_whose_target_is_gone_is_reported_not_applied():
    """A release without CL-06's target class: register() says which patch
    did not apply and the feature refused for it, on every call (it used
    to say "applied"), and the failure is logged as an error."""
    rc, result, log = run_probe(
        PROBE_GONE="vllm.v1.attention.backends.cpu_attn:CPUAttentionBackend"
    )
    assert rc == 0, log
    assert result["status"]["CL-06"] == "failed"
    assert [pid for pid, st in result["status"].items() if st == "failed"] == ["CL-06"]
    for outcome in (result["first"], result["second"]):
        assert outcome.startswith(
            "applied; not applied: CL-06 (cross-layer KV blocks: target not found"
        ), outcome
    assert "ERROR" in log and "patch CL-06" in log
    assert "a configuration that uses cross-layer KV blocks is refused" in log


def test_wrong_vllm_version_warns_and_patches_nothing():
    rc, result, log = run_probe("0.12.0")
    assert rc == 0, log
    assert result["first"] == "unsupported vLLM 0.12.0"
    assert result["states"] == 0 and not result["has_keyword"]
    assert "supports vLLM 0.11.2, 0.32.x or 0.33.x only; found vLLM 0.12.0" in log
    assert log.count("nothing patched") == 1  # one warning, not one per call


def test_wrong_version_is_an_error_when_strict():
    rc, result, log = run_probe("0.10.1", VLLM_OVERLAY_STRICT="1")
    assert rc != 0 and result is None
    assert "UnsupportedVLLMVersion" in log and "0.10.1" in log


def test_disabled_overlay_patches_nothing():
    rc, result, log = run_probe(VLLM_OVERLAY_DISABLE="1")
    assert rc == 0, log
    assert result["first"] == "disabled by VLLM_OVERLAY_DISABLE"
    assert result["states"] == 0 and not result["has_keyword"]


def test_bad_env_values_are_rejected_clearly():
    rc, _, log = run_probe(VLLM_OVERLAY_DISABLE="maybe")
    assert rc != 0 and "VLLM_OVERLAY_DISABLE='maybe'" in log
    rc, _, log = run_probe(VLLM_OVERLAY_SKIP_PATCHES="CL-99")
    assert rc != 0 and "unknown patch ids ['CL-99']" in log


@pytest.mark.parametrize(
    "version,ok",
    [
        ("0.11.2", True),
        ("0.11.2+cpu", True),
        ("0.11.2.post1", True),
        ("0.11.1", False),
        ("0.12.0", False),
        ("0.11.2rc1", False),
        ("0.11.2.dev3", False),
        ("garbage", False),
        (None, False),
    ],
)
def test_version_gate(version, ok):
    assert is_supported_version(version) is ok
