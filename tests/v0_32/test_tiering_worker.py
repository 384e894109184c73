"""``TieringOffloadingSpec``'s worker on the CPU platform (patch OF32-02).

The spec's worker-side ``get_worker`` gives the overlay's worker its slot
of the primary tier's shared region; the scheduler-side ``get_manager``
maps the same region, and its secondary tiers read and write the primary
tier through ``primary_kv_view``.  Stored blocks land in that view at this
rank's slot of each chunk row (upstream's order: tensor after tensor, block
``j`` of a chunk ``j`` pages into its tensor's part) and nowhere else;
bytes a tier writes there are what a load brings back.  Chunk rows back
to back and apart (padding, another rank's slot).  Real vLLM 0.32 specs
and regions, no engine.
"""

from __future__ import annotations

import mmap
import pathlib
import random
import uuid

import numpy
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
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

import vllm_overlay

BLOCKS, CHUNKS = 24, 8  # device blocks; primary-tier chunks


@pytest.fixture(scope="module", autouse=True)
def overlay():
    assert vllm_overlay.register() == "applied"


def make_spec(rank, world, page, tensors, per, engine_id, canonical=False):
    from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

    block = page * tensors
    row = -(-block * per * world // mmap.PAGESIZE) * mmap.PAGESIZE
    config = OffloadingConfig(
        groups=(OffloadingGroupConfig(16, tuple(f"l{i}" for i in range(tensors)), 0),),
        worker_kv_bytes_per_block=block,
        enable_kv_cache_events=False,
        extra_config={"cpu_bytes_to_use": CHUNKS * row},
        engine_id=engine_id,
        model=OffloadingModelConfig("tiny", "float32"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=per),
        parallel=OffloadingParallelConfig(
            rank, world, world, 1, 1, 1, 0, 1, None, True
        ),
        canonical_layout=canonical,
    )
    return TieringOffloadingSpec(config)


def caches(page: int, tensors: int) -> CanonicalKVCaches:
    ts = [
        CanonicalKVCacheTensor(
            torch.randint(-128, 127, (BLOCKS, page), dtype=torch.int8), page
        )
        for _ in range(tensors)
    ]
    return CanonicalKVCaches(
        ts, [[CanonicalKVCacheRef(i, page) for i in range(tensors)]]
    )


def finish(worker, job_id) -> None:
    worker.wait({job_id})
    assert [(r.job_id, r.success) for r in worker.get_finished()] == [(job_id, True)]


@pytest.mark.parametrize(
    "world, rank, page, tensors, per, apart",
    [
        (1, 0, 1024, 4, 1, False),  # a row is one chunk: back to back
        (1, 0, 1024, 1, 4, False),  # one packed (cross-layer) tensor
        (1, 0, 96, 4, 2, True),  # rows padded to a page
        (2, 1, 1024, 2, 1, True),  # rank 1's slot, after rank 0's
        (2, 1, 96, 3, 2, True),  # both
    ],
)
def test_blocks_land_in_the_primary_tiers_view(world, rank, page, tensors, per, apart):
    engine_id = f"overlay-test-{uuid.uuid4().hex}"
    scheduler = make_spec(0, world, page, tensors, per, engine_id)
    manager = scheduler.get_manager()
    kv = caches(page, tensors)
    try:
        worker = make_spec(rank, world, page, tensors, per, engine_id).get_worker(kv)
    except BaseException:
        manager.shutdown()
        raise
    try:
        assert type(worker).__name__ == "CPUPlatformOffloadingWorker"
        assert (not worker.host_blocks.flat) == (apart or tensors > 1)
        # What the secondary tiers see: [chunk, row bytes].
        view = numpy.asarray(manager.primary_tier.get_kv_memoryview())
        block = page * tensors
        slot = rank * block * per  # this rank's bytes in a row
        rng = random.Random(world * 100 + page + per)
        n = rng.randint(2, CHUNKS)
        first = rng.randrange(0, 3)
        skip = first % per
        src = rng.sample(range(BLOCKS), n)
        chunks = rng.sample(range(CHUNKS), -(-(skip + n) // per))
        assert worker.submit_store(
            1, GPULoadStoreSpec(src, [n], [first]), CPULoadStoreSpec(chunks)
        )
        finish(worker, 1)
        written = numpy.zeros(view.shape, dtype=bool)
        places = [(c, j) for c in chunks for j in range(per)][skip : skip + n]
        for b, (c, j) in zip(src, places):
            for s, t in enumerate(kv.tensors):
                at = slot + s * page * per + j * page
                assert numpy.array_equal(view[c, at : at + page], t.tensor[b].numpy())
                written[c, at : at + page] = True
        assert not view[~written].any()  # nothing else in the region changed

        # A tier writes bytes into those places; a load brings them back.
        for c in chunks:
            view[c, slot : slot + block * per] = numpy.random.default_rng(c).integers(
                -128, 127, block * per, dtype=numpy.int8
            )
        dst = rng.sample([b for b in range(BLOCKS) if b not in src], n)
        before = [t.tensor.clone() for t in kv.tensors]
        assert worker.submit_load(
            2, CPULoadStoreSpec(chunks), GPULoadStoreSpec(dst, [n], [first])
        )
        finish(worker, 2)
        for b, (c, j) in zip(dst, places):
            for s, t in enumerate(kv.tensors):
                at = slot + s * page * per + j * page
                assert numpy.array_equal(t.tensor[b].numpy(), view[c, at : at + page])
        untouched = [b for b in range(BLOCKS) if b not in dst]
        for t, old in zip(kv.tensors, before):
            assert torch.equal(t.tensor[untouched], old[untouched])
    finally:
        worker.shutdown()
        manager.shutdown()
    assert worker.host is None  # the region's view was handed back


def test_canonical_layout_is_refused_on_cpu():
    from vllm_overlay.patches.v0_32.patch_tiering_spec import cpu_platform_worker

    spec = make_spec(0, 1, 1024, 4, 1, f"overlay-test-{uuid.uuid4().hex}", True)
    # Upstream's create_worker checks the refs first (these have no
    # mapping); the overlay's worker refuses the layout whatever the refs.
    with pytest.raises(RuntimeError, match="canonical_layout"):
        spec.get_worker(caches(1024, 4))
    with pytest.raises(NotImplementedError, match="canonical_layout"):
        cpu_platform_worker(caches(1024, 4), 1, 8, object(), canonical_layout=True)


def test_a_shut_down_worker_leaves_no_region_mapped_nor_held(monkeypatch):
    """Issue 27 (8c): the worker's exit hook held its region until the
    interpreter exited; now the hook holds the file's name only, and the
    region goes with the worker's shutdown: no mapping of its file, no
    reference to it left."""
    import gc
    import weakref

    import vllm.v1.kv_offload.tiering.spec as tiering

    regions = []

    class Recorded(tiering.SharedOffloadRegion):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            regions.append(weakref.ref(self))

    monkeypatch.setattr(tiering, "SharedOffloadRegion", Recorded)
    engine_id = f"overlay-test-{uuid.uuid4().hex}"
    name = f"vllm_offload_{engine_id}.mmap"

    def mapped() -> int:
        with open("/proc/self/maps") as maps:
            return sum(1 for line in maps if name in line)

    worker = make_spec(0, 1, 1024, 4, 1, engine_id).get_worker(caches(1024, 4))
    assert len(regions) == 1 and mapped() == 1  # built through upstream's names
    worker.shutdown()
    del worker
    gc.collect()
    assert mapped() == 0
    assert regions[0]() is None  # nothing holds the region any more
    assert not pathlib.Path(f"/dev/shm/{name}").exists()
