"""OF32-04/05/06 carry a failed transfer from the CPU worker to the
scheduler and work only together: skipping one of them
(``VLLM_OVERLAY_SKIP_PATCHES``) skips all three and refuses upstream's
``OffloadingConnector`` on the CPU platform at startup, with one line
naming the three (issue 39, "Required 5").  Before, skipping one left the
others applied, which is worse than upstream: without OF32-05 a failed
load was reported finished (its request ran on KV never written), without
OF32-06 the failure mark reached upstream's count and its assert.  What
does not use host offloading on the CPU still starts.

Each case runs in a forked child of one process that imported vLLM once
(run_cases.py); no engine starts."""

from __future__ import annotations

import pytest
from conftest import run_cases

pytestmark = pytest.mark.v0_32_b  # tox -e v0_32_b (tox.ini)

UNIT = ("OF32-04", "OF32-05", "OF32-06")
SKIPS = {"none": "", **{pid: pid for pid in UNIT}, "all": ",".join(UNIT)}
CASES = {
    name: ({}, {"VLLM_OVERLAY_SKIP_PATCHES": skip}) for name, skip in SKIPS.items()
}


@pytest.fixture(scope="module")
def cases():
    return run_cases("run_failure_unit.py", CASES)


def test_with_none_skipped_host_offloading_starts(cases):
    result = cases["none"].result
    assert result["outcome"] == "applied"
    assert result["offloading"] == {"error": None}
    assert all(status != "skipped" for status, _ in result["patches"].values())


@pytest.mark.parametrize("skipped", [*UNIT, "all"])
def test_skipping_one_skips_all_three_and_refuses_host_offloading(cases, skipped):
    result = cases[skipped].result
    assert result["outcome"] == "applied"
    patches = result["patches"]
    assert [status for status, _ in patches.values()] == ["skipped"] * 3
    for pid, (_, detail) in patches.items():
        if skipped == "all" or pid == skipped:
            assert detail == "skipped by VLLM_OVERLAY_SKIP_PATCHES"
        else:
            assert detail == (
                f"skipped by VLLM_OVERLAY_SKIP_PATCHES with {skipped} "
                "(one unit: OF32-04, OF32-05, OF32-06)"
            )
    assert result["stock"] == {"error": None}
    refused = result["offloading"]
    assert refused["error"] == "PatchNotApplied"
    message = refused["message"]
    assert "\n" not in message
    assert message.startswith(
        "vllm-overlay: host offloading on the CPU platform (kv_connector "
        "'OffloadingConnector' on the CPU platform) needs patches OF32-04, "
        "OF32-05, OF32-06, which work only together; "
    )
    assert "VLLM_OVERLAY_SKIP_PATCHES" in message
    assert message.endswith(
        "or remove kv_connector 'OffloadingConnector' on the CPU platform."
    )
