"""Upstream's ``OffloadingConnector`` on the CPU platform, vLLM 0.32
(patch OF32-01: the overlay's worker behind ``CPUOffloadingSpec``).

Stock 0.32 refuses the CPU platform.  With the overlay, the prompts'
blocks are stored to host memory, the device prefix cache is emptied, and
the prompts come back with every full block loaded from the host: the same
tokens and hit lengths as stock 0.32 serving them from its device prefix
cache.  One request at a time the schedule is stock's, and the logprobs
are stock's bit for bit; as a batch, requests that wait for their loads
are scheduled differently, so logprobs are compared within stock 0.32's
own drift (``STOCK_FLOAT32_DRIFT_0_32``; measured here: 1.9e-6, and stock's
batched against one-request drift 2.4e-6).  With cross-layer blocks
(``BLHNC``, patch CL32-01) a block of every layer moves as one copy, and
consecutive blocks as one.

A failed copy (issue 27 (2)): the per-layer run also carries faults, under
upstream's default ``kv_load_failure_policy`` (``"fail"``).  Its first
host-to-device copy attempt raises: the worker redoes it and every pass is
still stock's.  After the passes, in the same engine, every attempt of one
load job raises (its request ends with ``finish_reason`` ``"error"``, the
engine serves on), then every store attempt (nothing is kept on the host,
nothing loaded from it).  Under ``"recompute"`` a load that keeps failing
is recomputed.  Without OF32-04 upstream's consumer asserts on the
failed copy and the engine dies; OF32-04/05/06 work only together, so
skipping any of them refuses this configuration at startup
(``test_failure_unit``).
"""

from __future__ import annotations

import pathlib
import sys

import pytest
from conftest import run, shared_run

sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "e2e"))
from tolerances import STOCK_FLOAT32_DRIFT_0_32, max_abs_diff  # noqa: E402

STOCK = {"VLLM_OVERLAY_DISABLE": "1"}


@pytest.fixture(scope="module")
def stock():
    return run("run_offload.py", {"connector": False}, **STOCK)


@pytest.fixture(scope="module")
def faulty():
    """The per-layer engine: one failed load attempt at first, and the
    fault phases after the passes; upstream's default failure policy."""
    return run(
        "run_offload.py",
        {"connector": True, "fail_loads": 1, "fault_phases": True},
        VLLM_KV_CACHE_LAYOUT="LBHNC",
    )


def field(r, p: int, name: str) -> list:
    return [x[name] for x in r.result["passes"][p]]


def assert_served_like_stock(r, stock) -> None:
    assert all(r.result["resets"])  # the device cache really was emptied
    for p in (0, 1, 2):
        assert field(r, p, "tokens") == field(stock, p, "tokens"), p
        assert field(r, p, "cached_tokens") == field(stock, p, "cached_tokens"), p
    assert field(r, 0, "logprobs") == field(stock, 0, "logprobs")  # cold
    assert field(r, 2, "logprobs") == field(stock, 2, "logprobs")  # one at a time
    batch = max_abs_diff(field(r, 1, "logprobs"), field(stock, 1, "logprobs"))
    assert batch <= STOCK_FLOAT32_DRIFT_0_32, batch
    assert field(stock, 2, "cached_tokens") == [0, 0, 128, 256, 512]


def no_job_left(state: dict) -> None:
    assert state["worker_pending"] == state["load_jobs"] == 0, state
    assert state["scheduler_jobs"] == state["write_pending_chunks"] == 0, state


@pytest.mark.parametrize("layout", ["LBHNC", "BLHNC"])
def test_upstream_offloading_runs_on_cpu(stock, layout, request):
    if layout == "LBHNC":  # (its first load attempt fails and is redone)
        r = request.getfixturevalue("faulty")
    else:
        # (test_rendered_series compares with the same run: made once)
        r = shared_run(
            "run_offload.py", {"connector": True}, VLLM_KV_CACHE_LAYOUT=layout
        )
    info = r.result["after"]
    assert info["worker"] == "CPUPlatformOffloadingWorker"
    assert info["layout"] == layout
    assert_served_like_stock(r, stock)
    # 4 distinct full blocks stored once; loaded back in the batch and
    # then one request at a time (1 + 2 + 4 blocks).
    assert info["blocks"] == {"store": 4, "load": 4 + 7}
    if layout == "BLHNC":  # one run per block; consecutive blocks merged
        assert info["runs_per_block"] == 1
        assert r.result["after_first"]["copies"]["store"] < 4
    else:  # one run per block and layer
        assert info["runs_per_block"] == 4
        assert r.result["after_first"]["copies"]["store"] == 4 * 4


@pytest.mark.parametrize("env", [STOCK, {"VLLM_OVERLAY_SKIP_PATCHES": "OF32-01"}])
def test_without_the_patch_upstream_refuses_the_cpu_platform(env):
    with pytest.raises(AssertionError) as failed:
        run("run_offload.py", {"connector": True}, **env)
    assert "only supported on CUDA-alike and XPU GPUs" in str(failed.value)


def test_a_failed_load_attempt_is_redone_under_the_default_policy(faulty, stock):
    """Issue 27 (2), upstream's default kv_load_failure_policy ("fail"): the
    worker's first host-to-device copy attempt raises; the worker redoes it,
    so no request ends with an error: stock's tokens and hit lengths on
    every pass.  Without the retry that request ends with an error."""
    r = faulty
    assert r.result["failed_loads"] == 1
    state = r.result["state"]
    assert state["retries"] == {"store": 0, "load": 1}
    assert state["failed"] == {"store": 0, "load": 0}
    assert_served_like_stock(r, stock)
    for p in (0, 1, 2):
        assert set(field(r, p, "finish_reason")) == {"length"}, p
    no_job_left(state)
    assert "kv_load_failure_policy 'fail', vLLM's default" in r.log


def test_a_load_that_keeps_failing_ends_its_request_only(faulty, stock):
    """Every attempt of one load job raises, under the default policy: its
    request ends with finish_reason "error" and no token (none computed on
    KV never written); the engine serves on, and the next batch loads from
    host memory again: stock's tokens and hit lengths."""
    lost = faulty.result["lost_load"]
    assert lost["reset_before"] and lost["reset"]
    assert lost["failed_attempts"] == faulty.result["tries"]
    assert lost["armed_left"] == 0
    (failed,) = lost["request"]
    assert failed["finish_reason"] == "error" and failed["tokens"] == []
    assert lost["state"]["failed"]["load"] == 1
    then = lost["then"]
    assert [x["tokens"] for x in then] == field(stock, 1, "tokens")
    assert [x["cached_tokens"] for x in then] == field(stock, 1, "cached_tokens")
    no_job_left(lost["state"])


def test_a_store_that_keeps_failing_is_not_kept(faulty, stock):
    """Host memory emptied, then every device-to-host copy attempt raises:
    requests complete with stock's tokens, no chunk is counted stored, and
    the same prompts later are computed again (cold hit lengths, nothing
    loaded from host memory); no job is left anywhere."""
    lost = faulty.result["lost_stores"]
    assert lost["cleared"] and lost["reset"]
    assert lost["cleared_state"]["stored_chunks"] == 0
    for name in ("first", "again"):
        assert [x["tokens"] for x in lost[name]] == field(stock, 0, "tokens")
        cached = [x["cached_tokens"] for x in lost[name]]
        assert cached == field(stock, 0, "cached_tokens"), name  # cold
    state = lost["state"]
    assert state["failed"]["store"] >= 1
    tries = faulty.result["tries"]
    assert lost["failed_attempts"] == tries * state["failed"]["store"]
    assert state["blocks"] == lost["cleared_state"]["blocks"]  # none moved
    assert state["stored_chunks"] == 0
    no_job_left(state)


def test_a_load_that_keeps_failing_is_recomputed_under_recompute(stock):
    """Under kv_load_failure_policy "recompute": every attempt of the first
    load job raises; its request is recomputed with stock's tokens, and
    every later pass loads from host memory again."""
    r = run(
        "run_offload.py",
        {"connector": True, "fail_load_jobs": 1, "load_failure_policy": "recompute"},
    )
    assert r.result["failed_loads"] == r.result["tries"]
    assert r.result["state"]["failed"] == {"store": 0, "load": 1}
    assert all(r.result["resets"])
    for p in (0, 1, 2):
        assert field(r, p, "tokens") == field(stock, p, "tokens"), p
    assert field(r, 2, "cached_tokens") == field(stock, 2, "cached_tokens")
    assert r.result["after"]["blocks"]["load"] >= 7  # one at a time: loaded
    assert "is recomputed (kv_load_failure_policy 'recompute')" in r.log
