"""Upstream's ``TieringOffloadingSpec`` on the CPU platform, vLLM 0.32
(patch OF32-02, on OF32-01's worker): upstream's ``OffloadingConnector``,
its CPU primary tier and its ``fs`` secondary tier (a tmp directory),
configured with upstream's keys (``spec_name``, ``secondary_tiers``).

* A first engine serves the prompts like stock 0.32 (test_offloading_cpu's
  checks: tokens and hit lengths, logprobs bit for bit one request at a
  time) from the primary tier, and the fs tier holds the 4 distinct full
  blocks.
* A second engine, a fresh process with empty host memory, shares that
  directory: each prompt alone, the device prefix cache emptied before
  each, gets stock's hit lengths, tokens and logprobs (stock's hits come
  from its device prefix cache).  Its worker stored nothing before the
  first hit, so that hit was read from the fs tier, promoted to the primary
  tier and loaded.  The fs blocks serve an engine on the other layout too
  (cross-layer ``BLHNC``: one run per block of every layer, the same bytes).
* The primary tier's /dev/shm file has no name left while the engine runs
  (OF32-03), so no exit leaks it; without OF32-03 an engine that ends
  without shutting its worker down (``os._exit``, as if killed) leaves it
  behind.
* Without OF32-02 the overlay refuses the spec on CPU, stock 0.32 too.
"""

from __future__ import annotations

import pathlib

import pytest
from conftest import run
from test_offloading_cpu import STOCK, assert_served_like_stock, field, stock

__all__ = ["stock"]  # the module's fixture: stock 0.32, its prefix cache


@pytest.fixture(scope="module")
def fs_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("fs_tier"))


@pytest.fixture(scope="module")
def first(fs_dir):
    return run("run_offload.py", {"connector": True, "fs_dir": fs_dir, "fs_files": 4})


def test_the_primary_tier_serves_like_stock(first, stock):
    info = first.result["after"]
    assert info["worker"] == "CPUPlatformOffloadingWorker"
    assert_served_like_stock(first, stock)
    assert info["blocks"] == {"store": 4, "load": 4 + 7}
    assert first.result["fs_files"] == 4  # cascaded to the fs tier
    assert first.result["region_named"] is False  # OF32-03: removed once mapped


@pytest.mark.parametrize("skip", ["", "OF32-03"])
def test_an_abrupt_exit_leaks_the_region_file_only_without_of32_03(
    tmp_path, stock, skip
):
    config = {"connector": True, "fs_dir": str(tmp_path), "passes": ["first"]}
    r = run(
        "run_offload.py", {**config, "exit": "abrupt"}, VLLM_OVERLAY_SKIP_PATCHES=skip
    )
    region = pathlib.Path(r.result["region_file"])
    try:
        assert field(r, 0, "tokens") == field(stock, 0, "tokens")
        # While the engine ran, and after it ended without a shutdown:
        assert r.result["region_named"] is bool(skip)
        assert region.exists() is bool(skip)
    finally:
        region.unlink(missing_ok=True)


@pytest.mark.parametrize("layout", ["LBHNC", "BLHNC"])
def test_a_fresh_engine_loads_the_prefixes_from_the_fs_tier(
    first, stock, fs_dir, layout
):
    assert first.result["fs_files"] == 4
    r = run(
        "run_offload.py",
        {"connector": True, "fs_dir": fs_dir, "passes": ["single"]},
        VLLM_KV_CACHE_LAYOUT=layout,
    )
    assert all(r.result["resets"])  # each prompt found the device cache empty
    assert r.result["after"]["layout"] == layout
    assert field(r, 0, "cached_tokens") == field(stock, 2, "cached_tokens")
    assert field(r, 0, "cached_tokens") == [0, 0, 128, 256, 512]
    assert field(r, 0, "tokens") == field(stock, 2, "tokens")
    assert field(r, 0, "logprobs") == field(stock, 2, "logprobs")
    # Nothing stored from this engine's KV cache: every hit came from the fs
    # tier (promoted to the primary tier) and was loaded, 1 + 2 + 4 blocks.
    assert r.result["after"]["blocks"] == {"store": 0, "load": 1 + 2 + 4}


@pytest.mark.parametrize(
    "env, error",
    [
        (STOCK, "only supported on CUDA-alike and XPU GPUs"),
        ({"VLLM_OVERLAY_SKIP_PATCHES": "OF32-02"}, "needs patch OF32-02"),
    ],
)
def test_without_the_patch_it_is_refused_on_cpu(tmp_path, env, error):
    with pytest.raises(AssertionError) as failed:
        run("run_offload.py", {"connector": True, "fs_dir": str(tmp_path)}, **env)
    assert error in str(failed.value)


def test_a_shut_down_in_process_engine_unmaps_the_primary_tier(tmp_path, stock):
    """Issue 27 (8c): the region's mappings (worker's and scheduler's) go
    with the engine's shutdown while the interpreter lives."""
    r = run("run_region_release.py", {"fs_dir": str(tmp_path)})
    assert r.result["tokens"] == field(stock, 0, "tokens")[-1]
    assert r.result["serving"] == 2  # the worker's slot, the scheduler's view
    assert r.result["after_shutdown"] == 0
    assert r.result["file_left"] is False
