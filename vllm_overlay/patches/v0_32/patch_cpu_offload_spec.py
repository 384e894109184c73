"""vllm/v1/kv_offload/cpu/spec.py: upstream's offloading on the CPU platform.

``CPUOffloadingSpec.get_worker`` raises on any platform but CUDA-alike and
XPU ("CPU Offloading is currently only supported on CUDA-alike and XPU
GPUs"), and its worker runs on CUDA streams.  On the CPU platform the patched
method returns the overlay's worker (``integration/v0_32/offload_worker``):
upstream's ``OffloadingConnector``, manager and ``kv_connector_extra_config``
keys unchanged, bytes moved by ``core/ops``.  ``TieringOffloadingSpec``
(whose primary tier the scheduler reads through a shared memory region)
gets its worker from its own ``create_worker``, whose worker OF32-02
(``patch_tiering_spec``) gives a CPU path; without it, it is refused on CPU
with a clear error.  Other platforms: upstream's.
"""

from vllm_overlay.core.patching import REGISTRY, Patch

MODULE = "vllm.v1.kv_offload.cpu.spec"
PATCH_ID = "OF32-01"


def get_worker(self, kv_caches):
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return REGISTRY.original(PATCH_ID)(self, kv_caches)
    if self._worker is None:
        from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

        if isinstance(self, TieringOffloadingSpec):
            # runtime only: begin
            from vllm.v1.kv_offload.tiering import spec as tiering

            if not getattr(tiering.CPUOffloadingWorker, "cpu_platform", False):
                raise NotImplementedError(
                    "vllm-overlay: TieringOffloadingSpec on the CPU platform "
                    "needs patch OF32-02 (its worker maps the primary "
                    "tier's shared region), which is not applied; use "
                    "CPUOffloadingSpec or enable OF32-02"
                )
            # runtime only: end
            self._worker = self.create_worker(kv_caches)
            return self._worker
        from vllm_overlay.integration.v0_32.offload_worker import (
            CPUPlatformOffloadingWorker,
        )

        self._worker = CPUPlatformOffloadingWorker(
            kv_caches, self.blocks_per_chunk, self.num_chunks
        )
    return self._worker


PATCHES = [
    Patch(
        id=PATCH_ID,
        module=MODULE,
        target="CPUOffloadingSpec.get_worker",
        new=get_worker,
        feature="host offloading on the CPU platform",
        why="Upstream's OffloadingConnector refuses the CPU platform and its "
        "worker needs CUDA streams; on CPU this gives it a worker that moves "
        "blocks with core/ops (one copy per block with cross-layer blocks), "
        "keeping upstream's connector, manager and configuration.",
        upstream="none: no upstream path offloads KV on the CPU platform "
        "(llm-d-kv-cache#526; LMCache RFC #4266 open)",
        removal="Drop once upstream's CPUOffloadingSpec has a CPU-platform worker.",
    ),
]
