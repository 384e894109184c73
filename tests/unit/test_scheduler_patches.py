"""KV-01..04 on a real vLLM 0.11.2 Scheduler with the offloading connector
(no worker: tests/support/sched_scenarios.py)."""

from __future__ import annotations

import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from support.sched_scenarios import (  # noqa: E402
    build,
    head_that_does_not_fit,
    offload,
    parked_load,
    report_loaded,
    status,
)


@pytest.fixture
def make(overlay):
    return build()


@pytest.mark.patch_test("KV-01")
def test_kv01_parked_request_keeps_a_deficit(make):
    from vllm_overlay.patches.v0_11_2.patch_kv_cache_manager import parked_deficits

    sched, a, out = parked_load(make)
    manager = sched.kv_cache_manager
    assert len(manager.get_block_ids("A")[0]) == 2
    assert parked_deficits(manager) == {"A": 1}
    # B's prompt (7 blocks, 6 in the host pool) would fit the 7 free
    # blocks, but not next to the block promised to A: deferred.
    _, request = make
    b = request("B", 100, seed=2)
    offload(sched, b, 6)
    sched.add_request(b)
    sched.schedule()
    assert b.status == status("WAITING")
    assert not manager.get_block_ids("B")[0]
    assert manager.vllm_overlay_admission["deferred"] >= 1
    # A's load lands: A is scheduled, its deficit released.
    report_loaded(sched, out, "A")
    out = sched.schedule()
    assert out.num_scheduled_tokens.get("A") == 40 - 32
    assert "A" not in parked_deficits(manager)


def test_kv01_stock_admits_loads_that_cannot_finish(make):
    from vllm_overlay.core.patching import REGISTRY

    sched, a, _ = parked_load(make)
    _, request = make
    b = request("B", 100, seed=2)
    offload(sched, b, 6)
    manager = sched.kv_cache_manager
    stock = REGISTRY.original("KV-01")
    blocks = stock(manager, b, 96, 0, None, 0, True)
    # Stock takes 6 of the 7 free blocks: A (needs 1) and B (needs 1 more)
    # could then only finish with blocks that no longer exist.
    assert blocks is not None and len(blocks.get_block_ids()[0]) == 6


@pytest.mark.patch_test("KV-03")
def test_kv03_parked_request_is_not_stranded(make):
    sched, a, p = head_that_does_not_fit(make)
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"A": 8}
    assert sched.vllm_overlay_reordered == 1


def test_kv03_stock_scheduler_strands_it(make):
    from vllm_overlay.core.patching import REGISTRY

    sched, a, p = head_that_does_not_fit(make)
    stock = REGISTRY.original("KV-03")
    for _ in range(3):  # nothing runs, nothing is freed: for good
        out = stock(sched)
        assert out.total_num_scheduled_tokens == 0
    assert not sched.running
    assert a.status == status("WAITING_FOR_REMOTE_KVS")


@pytest.mark.patch_test("KV-04")
def test_kv04_preempted_request_resumes_as_resumed(make):
    sched, a, out = parked_load(make)
    a.num_preemptions = 1  # as if preempted before this load
    report_loaded(sched, out, "A")
    first = sched.schedule()  # promoted, kept PREEMPTED
    assert first.total_num_scheduled_tokens == 0
    assert sched.vllm_overlay_resumed_after_load == 1
    second = sched.schedule()
    assert [r.req_id for r in second.scheduled_new_reqs] == []
    assert second.scheduled_cached_reqs.resumed_req_ids == {"A"}
    assert second.num_scheduled_tokens == {"A": 8}


def test_kv04_stock_schedules_it_as_new(make):
    from vllm_overlay.core.patching import REGISTRY

    sched, a, out = parked_load(make)
    a.num_preemptions = 1
    report_loaded(sched, out, "A")
    sched._update_waiting_for_remote_kv = lambda r: REGISTRY.original("KV-04")(sched, r)
    second = sched.schedule()
    assert [r.req_id for r in second.scheduled_new_reqs] == ["A"]


@pytest.mark.patch_test("KV-02")
def test_kv02_aborted_parked_request_releases_its_promise(make):
    from vllm_overlay.patches.v0_11_2.patch_kv_cache_manager import parked_deficits

    sched, a, _ = parked_load(make)
    sched.finish_requests("A", status("FINISHED_ABORTED"))
    assert parked_deficits(sched.kv_cache_manager) == {}
    assert sched.kv_cache_manager.block_pool.get_num_free_blocks() == 9
