"""KV-01..04 on a real vLLM 0.11.2 Scheduler with the offloading connector.

The worker is not needed: the host pool is filled through the connector's
own manager, and load completions are reported with ModelRunnerOutputs the
way the worker reports them.  Blocks of 16 tokens, 10 device blocks (block 0
is vLLM's null block: 9 usable).
"""

from __future__ import annotations

import pytest

BLOCK = 16


@pytest.fixture
def make(overlay):
    import torch
    from vllm.config import (
        CacheConfig,
        KVTransferConfig,
        ModelConfig,
        SchedulerConfig,
        VllmConfig,
    )
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
    )
    from vllm.v1.request import Request
    from vllm.v1.structured_output import StructuredOutputManager

    from vllm_overlay.demo import tiny_model_path

    init_none_hash(sha256)
    hasher = get_request_block_hasher(BLOCK, sha256)

    def scheduler() -> Scheduler:
        cache = CacheConfig(block_size=BLOCK, enable_prefix_caching=True)
        cache.num_gpu_blocks = 10
        config = VllmConfig(
            model_config=ModelConfig(
                model=tiny_model_path(), dtype="float32", max_model_len=256
            ),
            cache_config=cache,
            scheduler_config=SchedulerConfig(
                max_num_seqs=8, max_num_batched_tokens=512, max_model_len=256
            ),
            kv_transfer_config=KVTransferConfig(
                kv_connector="OverlayOffloadingConnector",
                kv_role="kv_both",
                kv_connector_extra_config={"num_cpu_blocks": 32},
            ),
        )
        kv_config = KVCacheConfig(
            num_blocks=10,
            kv_cache_tensors=[],
            kv_cache_groups=[
                KVCacheGroupSpec(
                    ["layer.0"],
                    FullAttentionSpec(
                        block_size=BLOCK,
                        num_kv_heads=1,
                        head_size=16,
                        dtype=torch.float32,
                    ),
                )
            ],
        )
        return Scheduler(
            vllm_config=config,
            kv_cache_config=kv_config,
            structured_output_manager=StructuredOutputManager(config),
            block_size=BLOCK,
        )

    def request(rid: str, n_tokens: int, seed: int) -> Request:
        return Request(
            rid,
            [(seed * 131 + i * 7) % 500 + 1 for i in range(n_tokens)],
            SamplingParams(max_tokens=4),
            None,
            eos_token_id=None,
            block_hasher=hasher,
        )

    return scheduler, request


def status(name: str):
    from vllm.v1.request import RequestStatus

    return RequestStatus[name]


def offload(sched, request, n_blocks: int) -> None:
    """Put the request's first blocks in the host pool, as stores do."""
    manager = sched.connector.connector_scheduler.manager
    hashes = request.block_hashes[:n_blocks]
    manager.prepare_store(hashes)
    manager.complete_store(hashes)


def report_loaded(sched, out, *req_ids: str) -> None:
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

    sched.update_from_output(
        out,
        ModelRunnerOutput(
            req_ids=[],
            req_id_to_index={},
            sampled_token_ids=[],
            logprobs=None,
            prompt_logprobs_dict={},
            pooler_output=[],
            kv_connector_output=KVConnectorOutput(finished_recving=set(req_ids)),
        ),
    )


def parked_load(make):
    """A parked on an async load of 2 blocks (holds 2, needs 3 in all)."""
    scheduler, request = make
    sched = scheduler()
    a = request("A", 40, seed=1)
    offload(sched, a, 2)
    sched.add_request(a)
    out = sched.schedule()
    assert out.total_num_scheduled_tokens == 0
    assert a.status == status("WAITING_FOR_REMOTE_KVS")
    return sched, a, out


@pytest.mark.patch_test("KV-01")
def test_kv01_parked_request_keeps_a_deficit(make):
    from vllm_overlay.patches.patch_kv_cache_manager import parked_deficits

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


def _head_that_does_not_fit(make):
    sched, a, out = parked_load(make)
    _, request = make
    p = request("P", 130, seed=3)  # 9 blocks: more than the 7 free
    sched.add_request(p)
    sched.waiting.remove_request(p)
    sched.waiting.prepend_request(p)  # where a preempted request goes
    report_loaded(sched, out, "A")
    return sched, a, p


@pytest.mark.patch_test("KV-03")
def test_kv03_parked_request_is_not_stranded(make):
    sched, a, p = _head_that_does_not_fit(make)
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"A": 8}
    assert sched.vllm_overlay_reordered == 1


def test_kv03_stock_scheduler_strands_it(make):
    from vllm_overlay.core.patching import REGISTRY

    sched, a, p = _head_that_does_not_fit(make)
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
    from vllm_overlay.patches.patch_kv_cache_manager import parked_deficits

    sched, a, _ = parked_load(make)
    sched.finish_requests("A", status("FINISHED_ABORTED"))
    assert parked_deficits(sched.kv_cache_manager) == {}
    assert sched.kv_cache_manager.block_pool.get_num_free_blocks() == 9
