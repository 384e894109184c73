"""The runtime patches, in the order they are applied (the manifest).

One ``patch_<module>.py`` per upstream module; each lists its ``PATCHES``
with their catalogue entries.  ``PATCHES.md`` is generated from them
(``python -m vllm_overlay catalogue``).
"""

from __future__ import annotations

from vllm_overlay import envs
from vllm_overlay.core.patching import REGISTRY, Patch
from vllm_overlay.patches import (
    patch_abstract,
    patch_arg_utils,
    patch_cpu_attn,
    patch_cpu_worker,
    patch_engine_core,
    patch_flash_attn,
    patch_flashinfer,
    patch_gpu_model_runner,
    patch_gpu_worker,
    patch_kv_cache_manager,
    patch_kv_connector_base,
    patch_mla_common,
    patch_mla_indexer,
    patch_scheduler,
)

MODULES = (
    # Cross-layer KV blocks (vLLM RFC #27742 / PR #27743)
    patch_abstract,
    patch_flash_attn,
    patch_flashinfer,
    patch_mla_common,
    patch_mla_indexer,
    patch_cpu_attn,
    patch_kv_connector_base,
    patch_gpu_model_runner,
    # Pipeline-parallel KV budget (vLLM PR #25164)
    patch_arg_utils,
    patch_gpu_worker,
    patch_cpu_worker,
    # Async KV loads under KV pressure (offloading, shared pool)
    patch_kv_cache_manager,
    patch_scheduler,
    # No busy loop while requests only wait for async KV loads
    patch_engine_core,
)


def all_patches() -> list[Patch]:
    return [patch for module in MODULES for patch in module.PATCHES]


def apply_all() -> None:
    """Register every patch (applied when its module is imported)."""
    known = {patch.id for patch in all_patches()}
    skipped = set(envs.SKIP_PATCHES.items())
    unknown = skipped - known
    if unknown:
        raise ValueError(
            f"{envs.SKIP_PATCHES.name}: unknown patch ids "
            f"{sorted(unknown)}; known: {sorted(known)}"
        )
    for patch in all_patches():
        reason = f"skipped by {envs.SKIP_PATCHES.name}" if patch.id in skipped else None
        REGISTRY.add(patch, skip_reason=reason)
