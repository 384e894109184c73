"""The cross-layer series in patches/, applied to a copy of the installed
vLLM 0.11.2 and run with the overlay disabled, behaves like the overlay."""

from __future__ import annotations

import importlib.util
import pathlib
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def patched_tree(tmp_path_factory):
    site = pathlib.Path(importlib.util.find_spec("vllm").origin).parent
    tree = tmp_path_factory.mktemp("patched-vllm")
    shutil.copytree(site, tree / "vllm")
    for line in (ROOT / "patches" / "series").read_text().split():
        subprocess.run(
            ["git", "apply", "-p1", str(ROOT / "patches" / line)],
            cwd=tree,
            check=True,
            capture_output=True,
        )
    return tree


def test_patched_vllm_equals_the_overlay(llm_run, patched_tree):
    config = {"dtype": "float32", "chunked": True, "connector": "probe"}
    overlay = llm_run(config)
    patched = llm_run(config, VLLM_OVERLAY_DISABLE="1", PYTHONPATH=str(patched_tree))
    assert "disabled by VLLM_OVERLAY_DISABLE" in patched.log
    for run in (overlay, patched):
        assert run.kv["cross_layer"] and run.kv["storages"] == 1
        assert run.kv["blocks_contiguous_all_layers"]
        assert run.kv["layout_matches_written_bytes"]
        assert run.kv["connector_registered"] == "cross-layer"
    assert patched.kv["layout"] == overlay.kv["layout"]
    for p in range(2):
        assert patched.tokens(p) == overlay.tokens(p)
        assert patched.logprobs(p) == overlay.logprobs(p)


def test_patched_vllm_offloads_under_pressure_like_the_overlay(patched_tree):
    """The whole series with the overlay disabled: cross-layer blocks, the
    scheduler fixes (kv-pressure) and the offloading connector all come from
    the patched tree.  Many async loads into a small cache: no stall, the
    overlay's tokens, one copy per block."""
    from conftest import _memoized

    run = _memoized("run_pressure.py")
    overlay = run({"connector": "offload"})
    patched = run(
        {
            "connector": "offload",
            "name": "CrossLayerOffloadingConnector",
            "stall_s": 10,
        },
        VLLM_OVERLAY_DISABLE="1",
        PYTHONPATH=str(patched_tree),
    )
    assert "disabled by VLLM_OVERLAY_DISABLE" in patched.log
    assert patched.result["totals"]["connector_module"] == (
        "vllm.distributed.kv_transfer.kv_connector.v1.cross_layer_offloading_connector"
    )
    assert not any(p["stalled"] for p in patched.passes)
    assert patched.result["overlay"].get("deferred") is None  # not KV-01
    assert patched.result["totals"]["load"]["blocks"] >= 16
    loads = patched.result["totals"]["load"]
    assert loads["copy_calls"] <= loads["blocks"]  # cross-layer: 1 per block
    for p in range(2):
        assert [o["tokens"] for o in patched.passes[p]["outputs"]] == [
            o["tokens"] for o in overlay.passes[p]["outputs"]
        ]
        # KV-01..04 both ways: the same scheduling decisions, step by step
        assert patched.passes[p]["trace"] == overlay.passes[p]["trace"]
    assert overlay.result["overlay"]["resumed_after_load"] > 0  # KV-04 acted


def test_kv_pressure_scenarios_schedule_the_same_both_ways(patched_tree):
    """patches/kv-pressure is hand-written, the runtime patches KV-01..04
    and EC-01 differ in form (wrappers around vLLM's methods): each scenario
    of tests/support/sched_scenarios.py gives the same scheduler steps in
    the overlay and on the patched tree with the overlay disabled (the lines
    name the new and resumed requests, tokens, waiting queue, free blocks;
    the idle engine waits instead of spinning).  The series once resumed a
    request one step earlier than the runtime."""
    from conftest import _memoized

    run = _memoized("run_sched_scenarios.py")
    overlay = run({})
    patched = run(
        {"connector": "CrossLayerOffloadingConnector"},
        VLLM_OVERLAY_DISABLE="1",
        PYTHONPATH=str(patched_tree),
    )
    assert patched.result["vllm"].startswith(str(patched_tree))
    assert not overlay.result["vllm"].startswith(str(patched_tree))
    assert patched.result["traces"] == overlay.result["traces"]
    kv04 = overlay.result["traces"]["kv04-resume-after-load"]
    assert "resumed=A " in kv04[1] and "waiting=A:PREEMPTED" in kv04[0]
    kv03 = overlay.result["traces"]["kv03-head-does-not-fit"]
    assert kv03[0].startswith("new=A@32 ")  # A not stranded behind P
    assert overlay.result["traces"]["ec01-idle-engine"] == ["waits"]  # EC-01


def test_patched_vllm_shares_a_pool_like_the_overlay(patched_tree):
    import sys

    sys.path.insert(0, str(ROOT / "tests"))
    from conftest import _memoized
    from support.redis_server import redis_server

    run = _memoized("run_pressure.py")
    overlay = run({"connector": None}, VLLM_OVERLAY_DISABLE="1")
    with redis_server() as server:
        patched = run(
            {"connector": "pool", "url": server.url, "stall_s": 10},
            VLLM_OVERLAY_DISABLE="1",
            PYTHONPATH=str(patched_tree),
        )
    assert "disabled by VLLM_OVERLAY_DISABLE" in patched.log
    assert not any(p["stalled"] for p in patched.passes)
    assert patched.result["totals"]["loaded_blocks"] >= 16
    assert patched.result["totals"]["connector_module"] == (
        "vllm.distributed.kv_transfer.kv_connector.v1.shared_pool_connector"
    )
    for p in range(2):
        assert [o["tokens"] for o in patched.passes[p]["outputs"]] == [
            o["tokens"] for o in overlay.passes[0]["outputs"]
        ]


def test_patched_vllm_splits_the_pp_budget_like_the_overlay(patched_tree, pp_run):
    """patches/pp-kv-budget: the engine argument enable_pp_prop_kv_cache on
    the patched tree, overlay disabled, gives the overlay's split."""
    partition = {"VLLM_PP_LAYER_PARTITION": "3,1"}
    overlay = pp_run({"pp": 2, "flag": True, "kv_bytes": 16 << 20}, **partition)
    patched = pp_run(
        {"pp": 2, "flag_field": True, "kv_bytes": 16 << 20},
        VLLM_OVERLAY_DISABLE="1",
        PYTHONPATH=str(patched_tree),
        **partition,
    )
    assert "disabled by VLLM_OVERLAY_DISABLE" in patched.log

    def ranks(run):
        return sorted(run.result["workers"], key=lambda w: w["pp_rank"])

    assert (
        [w["blocks"] for w in ranks(patched)]
        == [w["blocks"] for w in ranks(overlay)]
        == [64, 64]
    )
    assert [w["kv_bytes"] for w in ranks(patched)] == [
        w["kv_bytes"] for w in ranks(overlay)
    ]
    assert patched.result["tokens"] == overlay.result["tokens"]
    assert any(
        "PP rank 1: 1 layers" in line and "64 blocks" in line
        for line in patched.log.splitlines()
    )
