"""Issue 27 (6): a host chunk is laid out the way upstream's worker lays it
out, so CPU and GPU engines sharing a pool exchange right KV.

vLLM 0.32's worker (``cpu/gpu_worker.py``) gives each KV tensor its own
view of the worker's slot in a chunk row
(``SharedOffloadRegion.create_next_worker_view``, one per tensor in tensor
order, lines 801-814) and copies block ``j`` of a chunk to ``j`` pages into
that tensor's view (``compute_sub_block_ptrs``, lines 80-127): tensor after
tensor.  The overlay's CPU worker used to put block after block, so with
more than one block per chunk and more than one KV tensor a chunk written
by a CPU engine and one written by a GPU engine differed, under the same
namespace and layout tag, with valid checksums.

The reference is upstream's own code run on CPU: a real
``SharedOffloadRegion``, upstream's ``SingleDirectionOffloadingHandler``
(its ``__init__`` with its shape checks, ``transfer_async`` with its skip
and chunk arithmetic, ``_fill_direct_ops``, ``compute_sub_block_ptrs``);
only the device copy itself (``swap_blocks_batch``, a CUDA kernel) is a
``memmove`` per descriptor it computed, and the KV tensors report
``is_cuda`` for ``__init__``'s device assert.
"""

from __future__ import annotations

import ctypes
import mmap
import random
import uuid

import pytest
import torch
from vllm.v1.kv_offload.base import (
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    GPULoadStoreSpec,
)
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.cpu import gpu_worker
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion

from vllm_overlay.core.pool import codec
from vllm_overlay.core.pool.keys import namespace_tag
from vllm_overlay.integration.v0_32.offload_worker import CPUPlatformOffloadingWorker
from vllm_overlay.integration.v0_32.pool_tier import identity
from vllm_overlay.patches.v0_32.patch_offloading_connector import KV_IDENTITY

BLOCKS, CHUNKS = 24, 8  # device blocks; chunks in the region

# (KV tensors' page bytes, blocks per chunk, world size, rank)
CASES = [
    ((96, 40, 200), 2, 1, 0),  # odd pages, 3 tensors
    ((64, 64), 4, 1, 0),
    ((96, 40, 200), 4, 2, 1),  # rank 1's slot, after rank 0's
    ((1024,), 4, 1, 0),  # one (cross-layer) tensor: both orders agree
]


class _HostEvent:
    """``torch.Event`` for the transfer that ran when it was submitted (the
    CPU backend has no events; upstream's handler records two per job)."""

    def __init__(self, *args, **kwargs):
        pass

    def record(self, stream=None):
        pass

    def query(self):
        return True

    def synchronize(self):
        pass

    def elapsed_time(self, other):
        return 0.0


@pytest.fixture(autouse=True)
def host_events(monkeypatch):
    monkeypatch.setattr(torch, "Event", _HostEvent)


class _OnDevice(torch.Tensor):
    """A host tensor that passes upstream's ``is_cuda`` assert."""

    @property
    def is_cuda(self):
        return True


def caches(pages, fill: bool, seed: int = 0) -> CanonicalKVCaches:
    gen = torch.Generator().manual_seed(seed)
    tensors = [
        CanonicalKVCacheTensor(
            torch.randint(-128, 127, (BLOCKS, p), dtype=torch.int8, generator=gen)
            if fill
            else torch.zeros((BLOCKS, p), dtype=torch.int8),
            p,
        )
        for p in pages
    ]
    refs = [CanonicalKVCacheRef(i, p) for i, p in enumerate(pages)]
    return CanonicalKVCaches(tensors, [refs])


def region(pages, per, world, rank) -> SharedOffloadRegion:
    """A chunk row: every rank's slot of ``per`` blocks of every tensor."""
    slot = per * sum(pages)
    row = -(-slot * world // mmap.PAGESIZE) * mmap.PAGESIZE
    return SharedOffloadRegion(
        engine_id=f"overlay-test-{uuid.uuid4().hex}",
        num_chunks=CHUNKS,
        rank=rank,
        kv_bytes_per_chunk=row,
        cpu_page_size=slot,
    )


def _memmove_batch(src, dst, sizes, **_):
    for s, d, n in zip(src.tolist(), dst.tolist(), sizes.tolist()):
        ctypes.memmove(d, s, n)


def upstream_handler(kv, per, area: SharedOffloadRegion, gpu_to_cpu: bool):
    """Upstream's handler over ``area`` as ``CPUOffloadingWorker.__init__``
    builds it for the direct layout (gpu_worker.py lines 799-852)."""
    gpu, cpu = [], []
    for t in kv.tensors:
        page = t.page_size_bytes
        gpu.append(t.tensor.view(torch.int8).view(-1, page).as_subclass(_OnDevice))
        cpu.append(area.create_next_worker_view(page * per))
    handler = gpu_worker.SingleDirectionOffloadingHandler(
        gpu_tensors=gpu,
        cpu_tensors=cpu,
        blocks_per_chunk=per,
        layer_refs_per_group=kv.group_data_refs,
        gpu_to_cpu=gpu_to_cpu,
        host_memory_is_pinned=False,
    )
    handler._swap_blocks_batch = _memmove_batch  # the device copy
    return handler


def overlay_worker(kv, per, area: SharedOffloadRegion):
    """The overlay's worker over ``area`` as OF32-02 builds it: one view of
    the rank's slot (``patch_tiering_spec.cpu_platform_worker``)."""
    return CPUPlatformOffloadingWorker(
        kv, per, CHUNKS, host=lambda n: area.create_next_worker_view(n)
    )


def transfers(per: int, seed: int):
    """(blocks, chunks, first block index): odd counts, consecutive and
    scattered block ids, first chunks entered part way."""
    rng = random.Random(seed)
    free = list(range(CHUNKS))
    rng.shuffle(free)
    start = rng.randrange(0, BLOCKS - 7)
    plans = [
        (list(range(start, start + 7)), 1),  # a run of blocks, entered at 1
        (rng.sample(range(BLOCKS), 3), per - 1),  # scattered, entered late
        (rng.sample(range(BLOCKS), per + 1), 0),
    ]
    out = []
    for blocks, first in plans:
        need = -(-(first % per + len(blocks)) // per)
        chunks, free = free[:need], free[need:]
        out.append((blocks, chunks, first))
    return out


def run_upstream(handler, job_id, gpu_spec, cpu_spec):
    src, dst = (gpu_spec, cpu_spec) if handler.gpu_to_cpu else (cpu_spec, gpu_spec)
    assert handler.transfer_async(job_id, src, dst)
    handler.wait({job_id})
    assert [r.job_id for r in handler.get_finished()] == [job_id]


def run_overlay(worker, job_id, kind, gpu_spec, cpu_spec):
    if kind == "store":
        assert worker.submit_store(job_id, gpu_spec, cpu_spec)
    else:
        assert worker.submit_load(job_id, cpu_spec, gpu_spec)
    worker.wait({job_id})
    assert [(r.job_id, r.success) for r in worker.get_finished()] == [(job_id, True)]


def raw(area: SharedOffloadRegion) -> torch.Tensor:
    return area.base_tensor.clone()


@pytest.mark.parametrize("pages, per, world, rank", CASES)
def test_a_cpu_engine_writes_the_chunk_upstreams_worker_writes(pages, per, world, rank):
    kv = caches(pages, fill=True)
    ours, theirs = region(pages, per, world, rank), region(pages, per, world, rank)
    worker = overlay_worker(kv, per, ours)
    handler = upstream_handler(kv, per, theirs, gpu_to_cpu=True)
    try:
        for job, (blocks, chunks, first) in enumerate(transfers(per, len(pages))):
            gpu = GPULoadStoreSpec(blocks, [len(blocks)], [first])
            run_overlay(worker, job, "store", gpu, CPULoadStoreSpec(chunks))
            run_upstream(handler, job, gpu, CPULoadStoreSpec(chunks))
        expect = raw(theirs)
        assert expect.any()  # upstream wrote something
        # Every byte of the region: the same chunks, nothing else written.
        assert torch.equal(raw(ours), expect)
    finally:
        worker.shutdown()
        handler.shutdown()
        ours.cleanup()
        theirs.cleanup()


@pytest.mark.parametrize("pages, per, world, rank", CASES)
def test_each_engine_loads_the_other_engines_chunks(pages, per, world, rank):
    """A chunk travels as a value: the region's row bytes.  What the
    overlay's worker stored, upstream's loads, and the other way round; and
    the overlay's worker loads back what it stored."""
    kv = caches(pages, fill=True)
    plans = transfers(per, 7 + len(pages))

    def specs(blocks, chunks, first, shift=0):
        dst = [(b + shift) % BLOCKS for b in blocks]
        return GPULoadStoreSpec(dst, [len(dst)], [first]), CPULoadStoreSpec(chunks)

    def assert_loaded(target, shift):
        loaded = {(b + shift) % BLOCKS: b for blocks, _, _ in plans for b in blocks}
        for t, src in zip(target.tensors, kv.tensors):
            for b in range(BLOCKS):
                want = (
                    src.tensor[loaded[b]]
                    if b in loaded
                    else torch.zeros_like(src.tensor[b])
                )
                assert torch.equal(t.tensor[b], want), (b, loaded.get(b))

    # CPU engine stores, GPU engine (upstream's worker) loads.
    cpu_area, gpu_area = (
        region(pages, per, world, rank),
        region(pages, per, world, rank),
    )
    cpu_kv, gpu_kv = caches(pages, fill=False), caches(pages, fill=False)
    worker = overlay_worker(kv, per, cpu_area)
    loader = upstream_handler(gpu_kv, per, gpu_area, gpu_to_cpu=False)
    try:
        for job, plan in enumerate(plans):
            run_overlay(worker, job, "store", *specs(*plan))
        gpu_area.base_tensor.copy_(cpu_area.base_tensor)  # through the pool
        for job, plan in enumerate(plans):
            run_upstream(loader, job, *specs(*plan, shift=5))
        assert_loaded(gpu_kv, shift=5)
    finally:
        worker.shutdown()
        loader.shutdown()
        cpu_area.cleanup()
        gpu_area.cleanup()

    # GPU engine stores, CPU engine loads; then the CPU engine's round trip.
    cpu_area, gpu_area = (
        region(pages, per, world, rank),
        region(pages, per, world, rank),
    )
    storer = upstream_handler(kv, per, gpu_area, gpu_to_cpu=True)
    worker = overlay_worker(cpu_kv, per, cpu_area)
    try:
        for job, plan in enumerate(plans):
            run_upstream(storer, job, *specs(*plan))
        cpu_area.base_tensor.copy_(gpu_area.base_tensor)
        for job, plan in enumerate(plans):
            run_overlay(worker, 10 + job, "load", *specs(*plan, shift=3))
        assert_loaded(cpu_kv, shift=3)
    finally:
        worker.shutdown()
        storer.shutdown()
        cpu_area.cleanup()
        gpu_area.cleanup()

    # The CPU engine's own round trip: store, lose the blocks, load.
    own = CanonicalKVCaches(
        [
            CanonicalKVCacheTensor(t.tensor.clone(), t.page_size_bytes)
            for t in kv.tensors
        ],
        kv.group_data_refs,
    )
    area = region(pages, per, world, rank)
    worker = overlay_worker(own, per, area)
    try:
        for job, plan in enumerate(plans):
            run_overlay(worker, job, "store", *specs(*plan))
        for t in own.tensors:
            t.tensor.zero_()
        for job, plan in enumerate(plans):
            run_overlay(worker, 10 + job, "load", *specs(*plan))
        assert_loaded(own, shift=0)
    finally:
        worker.shutdown()
        area.cleanup()


def config(pages, per, kv_cache_layout="LBHNC") -> OffloadingConfig:
    return OffloadingConfig(
        groups=(OffloadingGroupConfig(16, tuple(f"l{i}" for i in pages), 0),),
        worker_kv_bytes_per_block=sum(pages),
        enable_kv_cache_events=False,
        extra_config={KV_IDENTITY: ["model-hash=test", "weights=w", "pages=p"]},
        engine_id="e",
        model=OffloadingModelConfig("tiny", "float32"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=per),
        parallel=OffloadingParallelConfig(0, 1, 1, 1, 1, 1, 0, 1, None, True),
        kv_cache_layout=kv_cache_layout,
    )


def test_the_namespace_and_layout_tag_name_the_chunk_order():
    """An overlay from before the fix wrote block-major chunks under these
    factors and this tag; the new ones differ, so neither namespace nor
    value check lets one node load the other's chunks."""
    cfg, chunk = config((96, 40, 200), 4), 4 * 336
    factors = identity.tier_factors(cfg, chunk, "ns")
    assert identity.CHUNK_ORDER == "chunk-order=tensor-major"
    assert identity.CHUNK_ORDER in factors
    old_factors = [
        f for f in factors if not f.startswith(("chunk-order=", "kv-cache-"))
    ]
    assert namespace_tag(factors) != namespace_tag(old_factors)
    tag = identity.layout_description(cfg, chunk)
    old_tag = f"tier-chunk|direct|chunk-bytes={chunk}"  # the old overlay's
    assert identity.CHUNK_ORDER in tag
    assert codec.layout_tag(tag) != codec.layout_tag(old_tag)
    # Per-layer tensors and one cross-layer tensor fill a chunk differently.
    cross = config((96, 40, 200), 4, kv_cache_layout="BLHNC")
    assert namespace_tag(identity.tier_factors(cross, chunk, "ns")) != namespace_tag(
        factors
    )
    assert identity.layout_description(cross, chunk) != tag
