"""BlockTables for a worker's registered KV cache (vLLM adapter).

Cache-block granularity: the scheduler's block ids index them, even when the
attention kernel uses smaller blocks.
"""

from __future__ import annotations

import torch

from vllm_overlay.core.ops.block_copy import BlockTable


def cross_layer_table(kv_cache: torch.Tensor, layout) -> BlockTable:
    return BlockTable.from_tensors([kv_cache], 0).coarsen(layout.blocks_per_cache_block)


def per_layer_table(vllm_config, kv_caches: dict[str, torch.Tensor]) -> BlockTable:
    from vllm.config import get_layers_from_vllm_config
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

    from vllm_overlay.integration.cross_layer import name_kv_cache_dims

    layers = get_layers_from_vllm_config(
        vllm_config, AttentionLayerBase, list(kv_caches)
    )
    tensors, seen, blocks_dims, kernel_sizes = [], set(), set(), set()
    for name, tensor in kv_caches.items():
        key = (tensor.data_ptr(), tuple(tensor.stride()))
        if key in seen:  # KV-sharing layers alias one tensor
            continue
        seen.add(key)
        dims = name_kv_cache_dims(
            layers[name].get_attn_backend(), 97, 16, 2, 64, "auto"
        )
        blocks_dims.add(dims.index("blocks"))
        kernel_sizes.add(tensor.shape[dims.index("tokens")])
        tensors.append(tensor)
    if len(blocks_dims) != 1 or len(kernel_sizes) != 1:
        raise ValueError(
            "per-layer KV caches differ in layout; cannot move "
            "them with one block table"
        )
    table = BlockTable.from_tensors(tensors, blocks_dims.pop())
    return table.coarsen(vllm_config.cache_config.block_size // kernel_sizes.pop())
