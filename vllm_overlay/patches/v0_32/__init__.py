"""The runtime patches for vLLM 0.32.x, in the order they are applied (the
manifest).  Upstream 0.32 has cross-layer blocks and a tiered offloading
framework; the overlay adds only what it lacks, through its interfaces."""

from __future__ import annotations

from vllm_overlay.patches.v0_32 import (
    patch_arg_utils,
    patch_cpu_attn,
    patch_cpu_offload_spec,
    patch_engine_core,
    patch_offloading_connector,
    patch_offloading_scheduler,
    patch_offloading_worker,
    patch_rotary_embedding,
    patch_tiering_spec,
)

MODULES = (
    # Cross-layer KV blocks on the CPU platform
    patch_cpu_attn,
    # Upstream's OffloadingConnector on the CPU platform
    patch_cpu_offload_spec,
    # ... and its TieringOffloadingSpec (CPU primary tier + secondary tiers)
    patch_tiering_spec,
    # ... whose config names the model config its KV comes from (pool
    # tier), and whose failed copies fail their loads, not the engine
    patch_offloading_connector,
    patch_offloading_worker,
    patch_offloading_scheduler,
    # Pipeline-parallel KV budget split by layers (--enable-pp-prop-kv-cache)
    patch_arg_utils,
    patch_engine_core,
    # DeepSeek MLA on the CPU platform (the CPU rotary kernel)
    patch_rotary_embedding,
)
