"""vllm/distributed/kv_transfer/kv_connector/v1/offloading/scheduler.py: a
store whose copy failed on any worker is completed as not stored (0.32).

The scheduler completes a store job once every worker reported it: each
step's ``OffloadingWorkerMetadata.completed_jobs`` (summed over the workers
by ``aggregate``) is counted down from ``num_workers`` in the job's
``pending_count``, across steps, and at zero the scheduler calls
``manager.complete_store(keys, ...)``, which marks the blocks stored and
loadable: by a load, and by the tiering spec's secondary tiers, which copy
them out of the primary tier.  The manager takes ``success=False`` for a
store that failed (its blocks are dropped), but no worker can say so.
With OF32-04 (``patch_offloading_worker``) a worker adds ``FAILED`` to a
failed store's count; ``update_connector_output`` takes it off before
upstream's bookkeeping runs unchanged, and remembers the job as failed
until it completes: with several workers (TP) one worker's failure may
arrive steps before the others' completions, and the store is failed if
any worker's copy failed.  The manager's ``complete_store`` of those jobs
gets ``success=False``.
"""

from __future__ import annotations

from vllm_overlay.core.patching import REGISTRY, Patch
from vllm_overlay.patches.v0_32.patch_offloading_worker import FAILED, UNIT

MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler"
PATCH_ID = "OF32-06"
FAILED_JOBS = "_overlay_failed_store_jobs"  # on OffloadingConnectorScheduler


def update_connector_output(self, connector_output):
    meta = connector_output.kv_connector_worker_meta
    # Jobs a worker reported failed, in this step or an earlier one: kept
    # until the job completes (or a reset_cache drops it from _jobs).
    failed = self.__dict__.setdefault(FAILED_JOBS, set())
    for job_id, count in getattr(meta, "completed_jobs", {}).items():
        if count >= FAILED:
            meta.completed_jobs[job_id] = count % FAILED
            failed.add(job_id)
    failed_keys = [self._jobs[j].keys for j in failed if j in self._jobs]
    if not failed_keys:
        failed.clear()  # none still pending (stale: dropped by a reset)
        return REGISTRY.original(PATCH_ID)(self, connector_output)
    manager = self.manager
    complete_store = manager.complete_store

    def complete(keys, req_context, success=True):
        ok = success and not any(keys is k for k in failed_keys)
        return complete_store(keys, req_context, success=ok)

    # Upstream's bookkeeping unchanged; only these jobs' stores fail.
    manager.complete_store = complete
    try:
        return REGISTRY.original(PATCH_ID)(self, connector_output)
    finally:
        del manager.complete_store
        failed.intersection_update(self._jobs)  # completed ones are done


PATCHES = [
    Patch(
        id=PATCH_ID,
        module=MODULE,
        target="OffloadingConnectorScheduler.update_connector_output",
        new=update_connector_output,
        feature="host offloading on the CPU platform",
        why="A store job is completed as stored whatever happened to its copy; "
        "with OF32-04 a worker marks a failed store in its completion count, "
        "and this completes it with complete_store(success=False), so its "
        "blocks are neither loaded nor copied to a secondary tier. A failure "
        "is kept until the job completes: with several workers one worker's "
        "failure can arrive steps before the others' completions.",
        upstream="none (OffloadingWorkerMetadata reports completions only)",
        removal="Drop with OF32-04 once the worker metadata carries failures.",
        unit=UNIT,
    ),
]
