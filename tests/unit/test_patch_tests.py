"""Each patch's marked tests fail without it and pass with it.

Runs tests/support/patch_tests.py: for every patch id, the tests marked
``@pytest.mark.patch_test(ID)`` run in a fresh pytest (a child forked from
one interpreter that imported vLLM once) with
``VLLM_OVERLAY_SKIP_PATCHES=ID``; they must all fail, in the test itself.
A control run of every marked test with nothing skipped must pass, so the
failures come from the missing patch, not from the harness.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

from vllm_overlay.patches import all_patches

ROOT = pathlib.Path(__file__).resolve().parents[2]
DRIVER = ROOT / "tests" / "support" / "patch_tests.py"
PATCH_IDS = [p.id for p in all_patches()]


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("patch-tests") / "report.json"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    env.pop("VLLM_OVERLAY_SKIP_PATCHES", None)
    env.pop("VLLM_OVERLAY_DISABLE", None)
    proc = subprocess.run(
        [sys.executable, str(DRIVER), str(out), *PATCH_IDS],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0 and out.exists(), proc.stdout + proc.stderr
    return json.loads(out.read_text())


def _describe(child: dict) -> str:
    outcomes = {k: v["outcome"] for k, v in child.get("outcomes", {}).items()}
    return f"rc={child.get('rc')} outcomes={outcomes}\n{child.get('log', '')}"


def test_marked_tests_pass_with_every_patch(report):
    child = report["children"]["control"]
    assert child["rc"] == 0, _describe(child)
    assert child["selected"], "no marked tests were collected"
    assert set(child["states"]) == set(PATCH_IDS)
    assert set(child["states"].values()) == {"applied"}, child["states"]
    assert {v["outcome"] for v in child["outcomes"].values()} == {"passed"}


@pytest.mark.parametrize("patch_id", PATCH_IDS)
def test_marked_tests_fail_without_their_patch(report, patch_id):
    child = report["children"][patch_id]
    assert child["rc"] == 1, _describe(child)  # 1: tests failed
    assert child["states"][patch_id] == "skipped", child["states"]
    assert child["selected"], f"{patch_id}: no test is marked for it"
    for nodeid in child["selected"]:
        result = child["outcomes"].get(nodeid, {"outcome": "not run"})
        assert result["outcome"] == "failed", (
            f"{nodeid} is marked patch_test({patch_id!r}) but "
            f"{result['outcome']} without it:\n{result.get('text', '')}"
        )
        # Failing only because the test asked the registry for the stock
        # method of the missing patch proves nothing about the patch.
        assert "has no original" not in result["text"], (
            f"{nodeid} fails without {patch_id} only because it asks "
            f"REGISTRY.original for the stock method:\n{result['text']}"
        )
