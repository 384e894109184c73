"""The CPU offloading worker of vLLM 0.32 (integration/v0_32/offload_worker)
against a plain torch reference: random block ids, chunks of 1 and 2 blocks
entered part way, per-layer tensors and one packed (cross-layer) tensor,
store then load round trips; a transfer that raises fails alone, and
upstream's consumer (with OF32-04/05) takes its failure; ``wait`` returns
once its jobs are done.  Real vLLM 0.32 specs, no engine."""

from __future__ import annotations

import random

import pytest
import torch
from vllm.v1.kv_offload.base import (
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    GPULoadStoreSpec,
)
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

import vllm_overlay
from vllm_overlay.integration.v0_32.offload_worker import CPUPlatformOffloadingWorker

BLOCKS, PAGE = 24, 96  # device blocks; bytes of one tensor's page


def caches(tensors: int) -> CanonicalKVCaches:
    ts = [
        CanonicalKVCacheTensor(
            torch.randint(-128, 127, (BLOCKS, PAGE), dtype=torch.int8), PAGE
        )
        for _ in range(tensors)
    ]
    refs = [CanonicalKVCacheRef(i, PAGE) for i in range(tensors)]
    return CanonicalKVCaches(ts, [refs])


def finish(worker, job_ids) -> dict:
    worker.wait(set(job_ids))
    return {r.job_id: r.success for r in worker.get_finished()}


def host_rows(chunks, per, skip, n):
    return [c * per + j for c in chunks for j in range(per)][skip : skip + n]


@pytest.mark.parametrize("tensors", [1, 4])  # packed (cross-layer) / per layer
@pytest.mark.parametrize("per", [1, 2])  # blocks per chunk
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_store_then_load_matches_the_torch_reference(tensors, per, seed):
    rng = random.Random(seed)
    kv = caches(tensors)
    worker = CPUPlatformOffloadingWorker(kv, per, num_cpu_chunks=16)
    try:
        n = rng.randint(1, 9)
        first = rng.randrange(0, 5)  # the request's first block index
        skip = first % per
        src = rng.sample(range(BLOCKS), n)
        chunks = rng.sample(range(16), -(-(skip + n) // per))
        gpu = GPULoadStoreSpec(src, [n], [first])
        assert worker.submit_store(1, gpu, CPULoadStoreSpec(chunks))
        assert finish(worker, [1]) == {1: True}
        rows = host_rows(chunks, per, skip, n)
        expect = torch.cat([t.tensor[src] for t in kv.tensors], dim=1)
        # Upstream's chunk order: tensor after tensor, each one's blocks.
        host = worker.host.view(16, tensors, per, PAGE)
        got = torch.stack([host[r // per, :, r % per].reshape(-1) for r in rows])
        assert torch.equal(got, expect)
        # Load them back into other blocks.
        dst = rng.sample([b for b in range(BLOCKS) if b not in src], n)
        before = [t.tensor.clone() for t in kv.tensors]
        load = GPULoadStoreSpec(dst, [n], [first])
        assert worker.submit_load(2, CPULoadStoreSpec(chunks), load)
        assert finish(worker, [2]) == {2: True}
        for t, old in zip(kv.tensors, before):
            assert torch.equal(t.tensor[dst], old[src])
            untouched = [b for b in range(BLOCKS) if b not in dst]
            assert torch.equal(t.tensor[untouched], old[untouched])
        assert worker.blocks == {"store": n, "load": n}
    finally:
        worker.shutdown()


def test_upstreams_consumer_takes_a_failed_copy():
    """Upstream's OffloadingConnectorWorker and OffloadingConnector consume
    the worker's failed results: a failed load is reported finished and
    failed (failed_recving: the scheduler applies kv_load_failure_policy),
    a failed store completed with FAILED in its count (OF32-06 completes it
    as not stored); a good transfer beside them is unaffected."""
    from types import SimpleNamespace

    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
        OffloadingConnectorMetadata,
        TransferJob,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.worker import (
        OffloadingConnectorWorker,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
        OffloadingConnector,
    )

    from vllm_overlay.patches.v0_32.patch_offloading_worker import FAILED

    assert vllm_overlay.register() == "applied"
    spec = SimpleNamespace(
        replicated_layout=False,
        config=SimpleNamespace(parallel=SimpleNamespace(rank=0)),
    )
    consumer = OffloadingConnectorWorker(spec, None, None)
    kv = caches(1)
    consumer.worker = CPUPlatformOffloadingWorker(kv, 1, num_cpu_chunks=4)
    connector = OffloadingConnector.__new__(OffloadingConnector)
    connector.connector_worker = consumer
    try:
        bad, good = (
            GPULoadStoreSpec([BLOCKS + 5], [1], [0]),
            GPULoadStoreSpec([3], [1], [0]),
        )
        stores = {
            7: TransferJob("s", bad, CPULoadStoreSpec([0])),
            8: TransferJob("s", good, CPULoadStoreSpec([1])),
        }
        consumer.prepare_store_kv(OffloadingConnectorMetadata({}, stores))
        loads = {
            9: TransferJob("bad", CPULoadStoreSpec([1]), bad),
            10: TransferJob(
                "good", CPULoadStoreSpec([1]), GPULoadStoreSpec([5], [1], [0])
            ),
        }
        metadata = OffloadingConnectorMetadata(loads, {})
        connector._connector_metadata = metadata
        consumer.start_kv_transfers(metadata)
        consumer.worker.wait({7, 8, 9, 10})
        results = connector.get_transfer_results(set())
        assert results.finished_recving == {"bad", "good"}
        assert results.failed_recving == {"bad"}
        meta = consumer.build_connector_worker_meta()
        assert meta.completed_jobs == {7: 1 + FAILED, 8: 1, 9: 1, 10: 1}
        assert len(meta.transfer_stats.store.sizes) == 1  # the good one only
        assert torch.equal(kv.tensors[0].tensor[5], kv.tensors[0].tensor[3])
        assert connector.get_transfer_results(set()).failed_recving == set()
        assert consumer.worker._thread.is_alive()
    finally:
        consumer.worker.shutdown()


def test_chunks_that_cannot_hold_the_blocks_are_refused():
    worker = CPUPlatformOffloadingWorker(caches(1), 2, num_cpu_chunks=4)
    try:
        with pytest.raises(ValueError, match="do not hold"):
            worker.submit_store(
                1, GPULoadStoreSpec([1, 2, 3], [3], [1]), CPULoadStoreSpec([0])
            )
    finally:
        worker.shutdown()


def test_upstreams_scheduler_completes_a_failed_store_as_not_stored():
    """Upstream's OffloadingConnectorScheduler.update_connector_output with a
    failed store (FAILED in its count, from OF32-04) and a good one: its
    bookkeeping runs as upstream's, and the manager's complete_store gets
    success=False for the failed store only."""
    from types import SimpleNamespace

    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
        OffloadingWorkerMetadata,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import (
        OffloadingConnectorScheduler,
        TransferJobStatus,
    )

    from vllm_overlay.patches.v0_32.patch_offloading_worker import FAILED

    assert vllm_overlay.register() == "applied"

    class Manager:
        def __init__(self):
            self.stores = []

        def complete_store(self, keys, req_context, success=True):
            self.stores.append((sorted(keys), req_context, success))

    scheduler = OffloadingConnectorScheduler.__new__(OffloadingConnectorScheduler)
    scheduler.manager = manager = Manager()
    scheduler._stale_job_threshold = 0
    scheduler._block_id_to_pending_jobs = {}
    scheduler._chunks_being_loaded = set()
    scheduler._jobs = {
        7: TransferJobStatus("r", 2, {"k7"}, True),  # two workers
        8: TransferJobStatus("r", 2, {"k8"}, True),
    }
    scheduler._req_status = {
        "r": SimpleNamespace(
            req_context="ctx", transfer_jobs={7, 8}, finished_signaled=False, req=None
        )
    }
    # Worker 0's store 7 failed, worker 1's did not: summed by aggregate().
    worker0 = OffloadingWorkerMetadata(completed_jobs={7: 1 + FAILED, 8: 1})
    worker1 = OffloadingWorkerMetadata(completed_jobs={7: 1, 8: 1})
    meta = worker0.aggregate(worker1)
    scheduler.update_connector_output(SimpleNamespace(kv_connector_worker_meta=meta))
    assert manager.stores == [(["k7"], "ctx", False), (["k8"], "ctx", True)]
    assert scheduler._jobs == {} and scheduler._req_status["r"].transfer_jobs == set()
    assert "complete_store" not in vars(manager)  # the manager is its own again
