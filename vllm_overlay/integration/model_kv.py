"""KV-cache sizes derived from a vLLM config (shared by several features)."""

from __future__ import annotations

import torch


def kv_bytes_per_token_per_layer(vllm_config) -> int:
    """KV bytes one token takes in one attention layer on this rank."""
    from vllm.utils.torch_utils import STR_DTYPE_TO_TORCH_DTYPE

    model, cache = vllm_config.model_config, vllm_config.cache_config
    if model is None:
        raise ValueError("KV sizes need the model config")
    dtype = (
        model.dtype
        if cache.cache_dtype == "auto"
        else STR_DTYPE_TO_TORCH_DTYPE[cache.cache_dtype]
    )
    heads = (
        1 if model.use_mla else 2 * model.get_num_kv_heads(vllm_config.parallel_config)
    )
    return model.get_head_size() * heads * torch.empty((), dtype=dtype).element_size()


def kv_bytes_per_token(vllm_config) -> int:
    """KV bytes one token takes on this rank, all its layers."""
    return kv_bytes_per_token_per_layer(
        vllm_config
    ) * vllm_config.model_config.get_num_layers(vllm_config.parallel_config)
