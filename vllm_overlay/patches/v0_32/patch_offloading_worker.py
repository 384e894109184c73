"""vllm/distributed/kv_transfer/kv_connector/v1/offloading/worker.py: a failed
transfer fails its request's load, not the engine (0.32).

``OffloadingConnectorWorker.get_finished`` asserts that every
``TransferResult`` succeeded ("we currently do not support job failures"):
one failed copy kills the engine, and under ``python -O`` a failed load is
reported finished and the request runs on KV that was never written.  The
overlay's CPU worker (``integration/v0_32/offload_worker``) redoes a
transfer whose copy raised (``TRANSFER_RETRIES`` more times) and reports
one that still fails as failed, so the consumer must take it.  Patched, a
failed result is handled through upstream's own failure paths:

* a failed load: its request is still reported finished receiving, and
  also as a failed receive (``KVConnectorTransferResults.failed_recving``,
  which the connector's ``get_transfer_results`` returns: OF32-05 in
  ``patch_offloading_connector``).  The scheduler then applies the
  configured ``kv_load_failure_policy``: ``recompute`` computes the
  request's KV again, ``fail`` (upstream's default) ends the request with
  an error.  Either way its blocks are freed, never served;
* a failed store: its job is still reported completed (the scheduler frees
  what it holds), with ``FAILED`` added to its count; the scheduler side
  (OF32-06, ``patch_offloading_scheduler``) takes it off and completes the
  store with ``success=False``, so the blocks are not marked stored and no
  load or secondary tier reads them.  Counts add up across workers, so a
  failure on any worker fails the job.

OF32-04, OF32-05 and OF32-06 are one unit (``UNIT``): without OF32-05 a
failed load would be reported finished and its request would run on KV
never written; without OF32-06 the ``FAILED`` mark would reach upstream's
count and its assert.  Skipping one (``VLLM_OVERLAY_SKIP_PATCHES``) skips
all three, and host offloading on the CPU platform is refused at startup
(``core.patching.unit_skips``, ``patch_features``).
"""

from __future__ import annotations

import logging

from vllm_overlay.core.patching import Patch

logger = logging.getLogger("vllm.overlay")

MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.offloading.worker"
PATCH_ID = "OF32-04"
FAILED = 1 << 20  # added to a failed store's completion count (OF32-06)
FAILED_LOADS = "_failed_load_req_ids"  # on OffloadingConnectorWorker
UNIT = ("OF32-04", "OF32-05", "OF32-06")  # work only together (Patch.unit)


def get_finished(self, finished_req_ids):
    assert self.worker is not None
    meta = self._connector_worker_meta
    failed_loads = self.__dict__.setdefault(FAILED_LOADS, set())
    finished_recving = set()
    for result in self.worker.get_finished():
        job_id = result.job_id
        req_id = self._load_jobs.pop(job_id, None)
        meta.mark_completed(job_id)
        if req_id is not None:
            finished_recving.add(req_id)
        if not result.success:
            logger.error(
                "KV offloading: %s job %d failed; %s",
                "load" if req_id is not None else "store",
                job_id,
                f"request {req_id} gets no KV from it"
                if req_id is not None
                else "its blocks are not marked stored",
            )
            if req_id is not None:
                failed_loads.add(req_id)
            else:
                meta.completed_jobs[job_id] += FAILED
            continue
        if result.transfer_size is not None and result.transfer_time is not None:
            stats = meta.transfer_stats
            (stats.load if req_id is not None else stats.store).record(
                result.transfer_size, result.transfer_time
            )
    return set(), finished_recving


PATCHES = [
    Patch(
        id=PATCH_ID,
        module=MODULE,
        target="OffloadingConnectorWorker.get_finished",
        new=get_finished,
        feature="host offloading on the CPU platform",
        why="Upstream asserts every transfer succeeded: one failed copy kills "
        "the engine, and under python -O a failed load is reported done and "
        "its request runs on KV never written. Patched, a failed load is "
        "reported as a failed receive (the scheduler recomputes or fails the "
        "request, per kv_load_failure_policy) and a failed store is "
        "completed as not stored (OF32-06). OF32-04/05/06 work only "
        "together: skipping one skips all three and refuses host offloading "
        "on the CPU platform at startup.",
        upstream="none (worker.py: 'we currently do not support job failures')",
        removal="Drop with OF32-05 and OF32-06 once OffloadingConnectorWorker "
        "reports failed transfers itself.",
        unit=UNIT,
    ),
]
