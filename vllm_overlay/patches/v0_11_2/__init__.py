"""The runtime patches for vLLM 0.11.2, in the order they are applied (the
manifest): one ``patch_<module>.py`` per upstream module, each listing its
``PATCHES`` with their catalogue entries."""

from __future__ import annotations

from vllm_overlay.patches.v0_11_2 import (
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
