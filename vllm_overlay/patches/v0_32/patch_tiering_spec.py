"""vllm/v1/kv_offload/tiering/spec.py: tiered offloading on the CPU platform.

``TieringOffloadingSpec`` keeps its primary (CPU) tier in a
``SharedOffloadRegion``: an mmap under /dev/shm that the worker writes and
the scheduler's secondary tiers (``fs``, ``obj``...) read and write through
``primary_kv_view``.  Its ``create_worker`` maps the worker's slot of that
region and hands it to ``CPUOffloadingWorker``, upstream's CUDA-stream
worker, which this module imports by name.  OF32-02 replaces only that
name: on the CPU platform it builds the overlay's worker
(``integration/v0_32/offload_worker``) over the same region, as its host
memory, so a block a worker stores is the block the secondary tiers copy
out, and a block they promote is the block the worker loads.  The rest of
``create_worker`` (the rank's slot, the region's sizes, the canonical refs'
check, cleaning the region when the worker cannot be built) stays
upstream's, and resolves its names through upstream's module.  Inside its
slot of a chunk row the overlay's worker lays the bytes out as upstream's
does (tensor after tensor, each tensor's blocks back to back), so a chunk
a CPU engine writes to a persistent tier or a pool is one a GPU engine
loads, and the other way round (tests/v0_32/test_chunk_layout.py).
``canonical_layout`` is refused on CPU (the overlay's worker moves the
direct layout only).  Other platforms: upstream's worker.

The region's file, ``/dev/shm/vllm_offload_<engine_id>.mmap``, is created
by the first worker (the engine core initializes the workers' KV caches,
and with them the connector's workers, before it builds the scheduler) and
joined by the scheduler's manager.  Upstream removes it only when the
worker shuts down cleanly, so an engine that exits without that shutdown
(an in-process ``LLM`` at interpreter exit, SIGKILL, the OOM killer) leaves
the file and its memory behind.  ``get_manager`` (OF32-03) removes the name
once the scheduler, the last to open it, has mapped it, as upstream's
``CPUOffloadingSpec`` does after its barrier: the mappings stay valid and
the kernel frees the memory when the last process exits, however it exits.
A worker whose engine fails to start before that (its scheduler's tiers
refused) removes the name when its process exits; its exit hook holds the
name only, and the worker's shutdown drops it with the region, so an
engine shut down in a living process leaves no mapping behind.
"""

import atexit
import contextlib
import logging
import os

from vllm_overlay.core.patching import REGISTRY, Patch

logger = logging.getLogger("vllm.overlay")

MODULE = "vllm.v1.kv_offload.tiering.spec"
PATCH_ID = "OF32-02"
UNLINK_ID = "OF32-03"


def cpu_platform_worker(
    kv_caches,
    blocks_per_chunk,
    num_cpu_chunks,
    mmap_region=None,
    canonical_layout=False,
):
    """The worker ``create_worker`` builds over ``mmap_region``: upstream's
    off the CPU platform, the overlay's on it."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return REGISTRY.original(PATCH_ID)(
            kv_caches=kv_caches,
            blocks_per_chunk=blocks_per_chunk,
            num_cpu_chunks=num_cpu_chunks,
            mmap_region=mmap_region,
            canonical_layout=canonical_layout,
        )
    if canonical_layout:
        raise NotImplementedError(
            "canonical_layout is not supported by "
            "TieringOffloadingSpec on the CPU platform; remove it from "
            "kv_connector_extra_config"
        )
    if mmap_region is None:
        raise ValueError("TieringOffloadingSpec's CPU worker needs its region")
    from vllm_overlay.integration.v0_32.offload_worker import (
        CPUPlatformOffloadingWorker,
    )

    region = mmap_region
    slot_bytes = region._worker_area_end - region._worker_offset
    path = region.mmap_path

    def forget_name() -> None:
        # At exit, had the scheduler not mapped the file and removed its
        # name (OF32-03) because the engine's start failed after this.
        # Holds the path only: the region is the worker's alone.
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)

    def slot(chunk_bytes: int):
        if chunk_bytes > slot_bytes:
            raise ValueError(
                f"A chunk of this worker's KV blocks is {chunk_bytes} B but "
                f"its slot in the shared region holds {slot_bytes} B"
            )
        return region.create_next_worker_view(chunk_bytes)

    def release() -> None:
        atexit.unregister(forget_name)
        # The scheduler removed the file's name once it mapped it (OF32-03):
        # nothing left to remove.
        if region._creator and not os.path.exists(path):
            region._creator = False
        region.cleanup()

    worker = CPUPlatformOffloadingWorker(
        kv_caches, blocks_per_chunk, num_cpu_chunks, host=slot, release=release
    )
    atexit.register(forget_name)
    logger.info(
        "Tiered offloading on CPU: the worker's host memory is rank %d's "
        "slot of %s (%d chunks of %d B)",
        region.rank,
        path,
        num_cpu_chunks,
        slot_bytes,
    )
    return worker


cpu_platform_worker.cpu_platform = True  # OF32-01's get_worker: CPU path is here


def get_manager(self):
    manager = REGISTRY.original(UNLINK_ID)(self)
    import os

    from vllm.platforms import current_platform

    region = self._scheduler_mmap
    # Only a region the scheduler joined: the workers mapped it before it.
    if current_platform.is_cpu() and region is not None and not region._creator:
        try:
            os.unlink(region.mmap_path)
            logger.info(
                "Removed the name of %s: the workers and the scheduler have "
                "mapped it; its memory is freed when the engine exits",
                region.mmap_path,
            )
        except FileNotFoundError:
            pass
    return manager


PATCHES = [
    Patch(
        id=PATCH_ID,
        module=MODULE,
        target="CPUOffloadingWorker",
        new=cpu_platform_worker,
        feature="host offloading on the CPU platform",
        why="TieringOffloadingSpec.create_worker builds upstream's CUDA-stream "
        "worker (the CPUOffloadingWorker it imports) over its rank's slot of "
        "the primary tier's shared region; on CPU the name builds the "
        "overlay's worker (OF32-01's) over that slot instead, as its host "
        "memory, so the scheduler's secondary tiers (fs, ...) see the bytes "
        "the worker moves. The rest of create_worker is upstream's.",
        upstream="none: no upstream path offloads KV on the CPU platform "
        "(llm-d-kv-cache#526; LMCache RFC #4266 open)",
        removal="Drop with OF32-01, once upstream's offloading workers run on "
        "the CPU platform.",
    ),
    Patch(
        id=UNLINK_ID,
        module=MODULE,
        target="TieringOffloadingSpec.get_manager",
        new=get_manager,
        feature="host offloading on the CPU platform",
        why="The primary tier's /dev/shm file is removed only by a clean "
        "worker shutdown; an in-process engine at exit or a killed one leaves "
        "it (and its memory) behind. Once the scheduler, the last to open it, "
        "has mapped it, its name is removed, as CPUOffloadingSpec does after "
        "its barrier: no exit path leaks it (an engine whose start fails "
        "before that: its worker removes the name at exit, in OF32-02).",
        upstream="none (upstream's CPUOffloadingSpec unlinks after a barrier; "
        "TieringOffloadingSpec does not)",
        removal="Drop when TieringOffloadingSpec removes the file once every "
        "process has mapped it.",
    ),
]
