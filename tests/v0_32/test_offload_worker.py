"""The CPU offloading worker of vLLM 0.32 (integration/v0_32/offload_worker)
against a plain torch reference: random block ids, chunks of 1 and 2 blocks
entered part way, per-layer tensors and one packed (cross-layer) tensor,
store then load round trips; a transfer that raises is redone, and one
that keeps raising fails alone; upstream's consumer (with OF32-04/05)
takes its failure, also under ``python -O``; ``wait`` returns once its
jobs are done, and past its deadline fails them, through upstream's
caller; a store failure one worker reports steps before another worker's
completion fails the store (OF32-06, through upstream's aggregation).  Real
vLLM 0.32 specs, no engine."""

from __future__ import annotations

import json
import logging
import os
import pathlib
import random
import subprocess
import sys

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
from vllm_overlay.integration.v0_32.offload_worker import (
    TRANSFER_RETRIES,
    CPUPlatformOffloadingWorker,
)

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


def consume_failed_copies() -> dict:
    """Upstream's OffloadingConnectorWorker and OffloadingConnector consume
    the worker's results: a store and a load whose copies raise on every
    attempt (a block id past the cache), and a good store and load beside
    them.  What the consumer reported (no asserts: also run under -O)."""
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

    status = vllm_overlay.register()
    spec = SimpleNamespace(
        replicated_layout=False,
        config=SimpleNamespace(parallel=SimpleNamespace(rank=0)),
    )
    consumer = OffloadingConnectorWorker(spec, None, None)
    kv = caches(1)
    worker = consumer.worker = CPUPlatformOffloadingWorker(kv, 1, num_cpu_chunks=4)
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
        worker.wait({7, 8, 9, 10})
        results = connector.get_transfer_results(set())
        meta = consumer.build_connector_worker_meta()
        later = connector.get_transfer_results(set())
        return {
            "register": status,
            "finished_recving": sorted(results.finished_recving),
            "failed_recving": sorted(results.failed_recving),
            "completed_jobs": dict(meta.completed_jobs),
            "stored_stats": len(meta.transfer_stats.store.sizes),
            "loaded": torch.equal(kv.tensors[0].tensor[5], kv.tensors[0].tensor[3]),
            "failed_later": sorted(later.failed_recving),
            "alive": worker._thread.is_alive(),
            "retries": dict(worker.retries),
            "failed": dict(worker.failed),
        }
    finally:
        worker.shutdown()


def test_upstreams_consumer_takes_a_failed_copy():
    """A failed load is reported finished and failed (failed_recving: the
    scheduler applies kv_load_failure_policy), a failed store completed with
    FAILED in its count (OF32-06 completes it as not stored); a good
    transfer beside them is unaffected.  Each failed job was tried
    1 + TRANSFER_RETRIES times."""
    from vllm_overlay.patches.v0_32.patch_offloading_worker import FAILED

    got = consume_failed_copies()
    assert got["register"] == "applied"
    assert got["finished_recving"] == ["bad", "good"]
    assert got["failed_recving"] == ["bad"]
    assert got["completed_jobs"] == {7: 1 + FAILED, 8: 1, 9: 1, 10: 1}
    assert got["stored_stats"] == 1  # the good one only
    assert got["loaded"]
    assert got["failed_later"] == []
    assert got["alive"]
    assert got["failed"] == {"store": 1, "load": 1}
    assert got["retries"] == {"store": TRANSFER_RETRIES, "load": TRANSFER_RETRIES}


def test_under_python_O_a_failed_load_is_reported_failed():
    """Issue 27 (2): upstream's get_finished checks success with an
    ``assert``, which ``python -O`` removes: a failed load was reported
    finished and its request ran on KV never written.  Under -O (its own
    process, no engine), with OF32-04/05 the CPU worker's real failed load
    is still reported failed, never as a success."""
    here = str(pathlib.Path(__file__).parent)
    script = (
        f"import json, sys\nsys.path.insert(0, {here!r})\n"
        "import test_offload_worker as t\n"
        "optimized = True\n"
        "assert not (optimized := False)\n"
        "print('RESULT:' + json.dumps({'optimized': optimized, "
        "**t.consume_failed_copies()}, default=str))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-O", "-c", script],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "VLLM_OVERLAY_SKIP_PATCHES": ""},
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT:")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    got = json.loads(lines[-1][len("RESULT:") :])
    assert got["optimized"]  # asserts really were off
    assert got["register"] == "applied"
    assert got["finished_recving"] == ["bad", "good"]
    assert got["failed_recving"] == ["bad"]  # never a success
    assert got["failed"]["load"] == 1


def test_a_transfer_that_raises_is_redone(caplog):
    """A copy that raises once is redone on the worker's thread and the job
    succeeds (the blocks are stored); one that raises on every attempt is
    given up after 1 + TRANSFER_RETRIES attempts and reported failed.  Each
    failed attempt is a warning naming the job; the give-up one error."""
    kv = caches(1)
    worker = CPUPlatformOffloadingWorker(kv, 1, num_cpu_chunks=4)
    move, raised = worker._move, {"n": 0}

    def flaky(kind, ids, rows):
        if raised["n"] < 1 or int(ids[0]) == 9:
            raised["n"] += 1
            raise RuntimeError("injected")
        return move(kind, ids, rows)

    worker._move = flaky
    try:
        with caplog.at_level(logging.WARNING, logger="vllm.overlay"):
            store = GPULoadStoreSpec([2], [1], [0])
            assert worker.submit_store(1, store, CPULoadStoreSpec([0]))
            assert finish(worker, [1]) == {1: True}
            assert torch.equal(worker.host[0], kv.tensors[0].tensor[2])
            lost = GPULoadStoreSpec([9], [1], [0])
            assert worker.submit_store(2, lost, CPULoadStoreSpec([1]))
            assert finish(worker, [2]) == {2: False}
        assert worker.retries == {"store": 1 + TRANSFER_RETRIES, "load": 0}
        assert worker.failed == {"store": 1, "load": 0}
        assert worker.blocks == {"store": 1, "load": 0}
        assert raised["n"] == 1 + (1 + TRANSFER_RETRIES)
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
        errors = [r for r in caplog.records if r.levelno == logging.ERROR]
        assert "store job 1" in warnings[0].getMessage()
        assert len(warnings) == 1 + TRANSFER_RETRIES
        assert len(errors) == 1 and "store job 2" in errors[0].getMessage()
        assert worker._thread.is_alive() and not worker._pending
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


def test_a_failure_one_worker_reports_steps_before_the_other_completes():
    """Two workers' outputs through upstream's own aggregation
    (``KVOutputAggregator``, which sums ``completed_jobs`` per step) into
    upstream's ``update_connector_output``: worker 1's store 7 failed and
    is reported in step 1, worker 0's copy of it completes in step 2.  The
    store completes in step 2 with success=False (without keeping the
    failure across steps it completed as stored); store 8, good on both
    workers and split the same way, completes as stored."""
    from types import SimpleNamespace

    from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
        OffloadingWorkerMetadata,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import (
        OffloadingConnectorScheduler,
        TransferJobStatus,
    )
    from vllm.v1.outputs import KVConnectorOutput

    from vllm_overlay.patches.v0_32.patch_offloading_worker import FAILED

    assert vllm_overlay.register() == "applied"

    class Manager:
        def __init__(self):
            self.stores = []

        def complete_store(self, keys, req_context, success=True):
            self.stores.append((sorted(keys), success))

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
    aggregator = KVOutputAggregator(expected_finished_count=2)

    def step(worker0: dict, worker1: dict) -> None:
        outputs = [
            SimpleNamespace(
                kv_connector_output=KVConnectorOutput(
                    kv_connector_worker_meta=OffloadingWorkerMetadata(
                        completed_jobs=dict(jobs)
                    )
                    if jobs
                    else None
                )
            )
            for jobs in (worker0, worker1)
        ]
        out = aggregator.aggregate(outputs)
        scheduler.update_connector_output(out.kv_connector_output)

    step({}, {7: 1 + FAILED, 8: 1})  # worker 1: 7 failed, 8 done
    assert manager.stores == [] and set(scheduler._jobs) == {7, 8}
    step({7: 1, 8: 1}, {})  # worker 0: both done, a step later
    assert manager.stores == [(["k7"], False), (["k8"], True)]
    assert scheduler._jobs == {} and scheduler._req_status["r"].transfer_jobs == set()
    assert not vars(scheduler).get("_overlay_failed_store_jobs")  # none kept
    assert "complete_store" not in vars(manager)


def test_a_flush_past_the_wait_deadline_fails_its_jobs_not_the_engine(
    monkeypatch, caplog
):
    """Upstream's caller of ``wait``, ``OffloadingConnectorWorker.
    handle_preemptions`` (a flush: preempted requests, reused blocks,
    reset_cache), with a load whose copy does not finish and a store queued
    behind it.  Past the deadline (shortened here: 120 s in the engine)
    the step goes on (upstream's waits block; this one raised TimeoutError
    into the engine's step, which killed the engine): the load is reported
    finished and failed (kv_load_failure_policy applies), the store
    completed with FAILED (not kept).  The queued store never runs (its
    host chunk stays as it was), the stuck copy's late result is dropped
    (never reported twice), and the worker serves on."""
    import threading
    import time
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

    from vllm_overlay.integration.v0_32 import offload_worker
    from vllm_overlay.patches.v0_32.patch_offloading_worker import FAILED

    assert vllm_overlay.register() == "applied"
    monkeypatch.setattr(offload_worker, "WAIT_DEADLINE_S", 0.5)
    spec = SimpleNamespace(
        replicated_layout=False,
        config=SimpleNamespace(parallel=SimpleNamespace(rank=0)),
    )
    consumer = OffloadingConnectorWorker(spec, None, None)
    kv = caches(1)
    worker = consumer.worker = CPUPlatformOffloadingWorker(kv, 1, num_cpu_chunks=4)
    connector = OffloadingConnector.__new__(OffloadingConnector)
    connector.connector_worker = consumer
    gate, move = threading.Event(), worker._move

    def stuck(kind, ids, rows):
        if kind == "load" and int(ids[0]) == 5:
            assert gate.wait(timeout=60)
        return move(kind, ids, rows)

    worker._move = stuck
    try:
        worker.host[1].fill_(7)
        load = TransferJob("r9", CPULoadStoreSpec([1]), GPULoadStoreSpec([5], [1], [0]))
        loads = OffloadingConnectorMetadata({9: load}, {})
        connector._connector_metadata = loads
        consumer.start_kv_transfers(loads)
        store = TransferJob(
            "r7", GPULoadStoreSpec([3], [1], [0]), CPULoadStoreSpec([2])
        )
        consumer.prepare_store_kv(OffloadingConnectorMetadata({}, {7: store}))
        start = time.monotonic()
        with caplog.at_level(logging.ERROR, logger="vllm.overlay"):
            consumer.handle_preemptions(
                OffloadingConnectorMetadata({}, {}, jobs_to_flush={7, 9})
            )
        assert time.monotonic() - start < 30
        results = connector.get_transfer_results(set())
        assert results.finished_recving == {"r9"}
        assert results.failed_recving == {"r9"}
        meta = consumer.build_connector_worker_meta()
        assert meta.completed_jobs == {7: 1 + FAILED, 9: 1}
        errors = [r for r in caplog.records if r.levelno == logging.ERROR]
        (error,) = [r for r in errors if "not done" in r.getMessage()]
        assert "[7, 9] not done within 0.5 s" in error.getMessage()
        assert "job 9's copy is still under way" in error.getMessage()
        gate.set()  # the stuck copy finishes late
        deadline = time.monotonic() + 30
        while (worker._running is not None or worker._given_up) and (
            time.monotonic() < deadline
        ):
            time.sleep(0.05)
        assert worker._given_up == set() and worker._running is None
        assert worker.get_finished() == []  # the late result dropped
        assert torch.equal(worker.host[2], torch.zeros_like(worker.host[2]))
        assert torch.equal(kv.tensors[0].tensor[5], worker.host[1])  # (late)
        assert worker.failed == {"store": 1, "load": 1}
        # The worker serves on.
        again = GPULoadStoreSpec([3], [1], [0])
        assert worker.submit_store(11, again, CPULoadStoreSpec([2]))
        assert finish(worker, [11]) == {11: True}
        assert torch.equal(worker.host[2], kv.tensors[0].tensor[3])
        assert worker._thread.is_alive() and not worker._pending
    finally:
        gate.set()
        worker.shutdown()
