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
"""

from __future__ import annotations

import pathlib
import sys

import pytest
from conftest import run

sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "e2e"))
from tolerances import STOCK_FLOAT32_DRIFT_0_32, max_abs_diff  # noqa: E402

STOCK = {"VLLM_OVERLAY_DISABLE": "1"}


@pytest.fixture(scope="module")
def stock():
    return run("run_offload.py", {"connector": False}, **STOCK)


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


@pytest.mark.parametrize("layout", ["LBHNC", "BLHNC"])
def test_upstream_offloading_runs_on_cpu(stock, layout):
    r = run("run_offload.py", {"connector": True}, VLLM_KV_CACHE_LAYOUT=layout)
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


def test_a_failed_load_is_recomputed_and_the_engine_serves_on(stock):
    """Issue 27 (2): the worker's first host-to-device copy raises.  Its
    request is recomputed (kv_load_failure_policy "recompute") with stock's
    tokens, and every later pass loads from host memory again.  Without
    OF32-04 upstream's consumer asserts and the engine dies."""
    r = run("run_offload.py", {"connector": True, "fail_loads": 1})
    assert r.result["failed_loads"] == 1
    assert all(r.result["resets"])
    for p in (0, 1, 2):
        assert field(r, p, "tokens") == field(stock, p, "tokens"), p
    assert field(r, 2, "cached_tokens") == field(stock, 2, "cached_tokens")
    assert r.result["after"]["blocks"]["load"] >= 7  # one at a time: loaded


def test_without_of32_04_a_failed_load_kills_the_engine():
    """The failing half of the test above: upstream's consumer asserts on the
    failed copy and the engine dies."""
    with pytest.raises(AssertionError) as failed:
        run(
            "run_offload.py",
            {"connector": True, "fail_loads": 1},
            VLLM_OVERLAY_SKIP_PATCHES="OF32-04",
        )
    assert "transfer_result.success" in str(failed.value)
