"""The CPU offloading worker of vLLM 0.32 (integration/v0_32/offload_worker)
against a plain torch reference: random block ids, chunks of 1 and 2 blocks
entered part way, per-layer tensors and one packed (cross-layer) tensor,
store then load round trips; a transfer that raises fails alone; ``wait``
returns once its jobs are done.  Real vLLM 0.32 specs, no engine."""

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


def test_a_failed_transfer_fails_alone():
    kv = caches(1)
    worker = CPUPlatformOffloadingWorker(kv, 1, num_cpu_chunks=4)
    try:
        bad = GPULoadStoreSpec([BLOCKS + 5], [1], [0])  # no such block
        worker.submit_store(7, bad, CPULoadStoreSpec([0]))
        good = GPULoadStoreSpec([3], [1], [0])
        worker.submit_store(8, good, CPULoadStoreSpec([1]))
        assert finish(worker, [7, 8]) == {7: False, 8: True}
        assert torch.equal(worker.host[1], kv.tensors[0].tensor[3])
        assert worker._thread.is_alive()
    finally:
        worker.shutdown()


def test_chunks_that_cannot_hold_the_blocks_are_refused():
    worker = CPUPlatformOffloadingWorker(caches(1), 2, num_cpu_chunks=4)
    try:
        with pytest.raises(ValueError, match="do not hold"):
            worker.submit_store(
                1, GPULoadStoreSpec([1, 2, 3], [3], [1]), CPULoadStoreSpec([0])
            )
    finally:
        worker.shutdown()
