"""KV-cache sizes derived from a vLLM config (shared by several features)."""

from __future__ import annotations

import dataclasses

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


def layers_per_stage(vllm_config) -> list[int]:
    """The model's layers on each pipeline stage, in stage order
    (``VLLM_PP_LAYER_PARTITION`` or vLLM's default split).  The same in
    every process: the scheduler's and every worker's."""
    from vllm.distributed.utils import get_pp_indices

    total = getattr(vllm_config.model_config.hf_text_config, "num_hidden_layers", 0)
    pp = vllm_config.parallel_config.pipeline_parallel_size
    return [
        end - start for start, end in (get_pp_indices(total, r, pp) for r in range(pp))
    ]


@dataclasses.dataclass(frozen=True)
class HostPoolSize:
    """The host pool of an offloading connector.

    The scheduler hands every pipeline stage the same host block ids, so
    every stage (and the scheduler) must hold the same number of blocks;
    a stage's block holds only its own layers, so bytes differ by stage.
    ``cpu_bytes`` is the host memory for the KV of the whole model (all
    its layers, per tensor-parallel rank): with pipeline parallelism it is
    split across the stages by their layers."""

    blocks: int
    block_size: int  # tokens per offloaded block
    layer_block_bytes: int  # one offloaded block of one layer
    stage_layers: tuple[int, ...]
    cpu_bytes: int | None  # None: num_cpu_blocks was configured

    @property
    def stage_bytes(self) -> list[int]:
        return [self.blocks * self.layer_block_bytes * n for n in self.stage_layers]

    def describe(self) -> str:
        given = (
            f"cpu_bytes={self.cpu_bytes} for all {sum(self.stage_layers)} "
            "layers of the model"
            if self.cpu_bytes is not None
            else f"num_cpu_blocks={self.blocks}"
        )
        text = f"{given}: {self.blocks} blocks of {self.block_size} tokens"
        if not self.stage_layers:
            return text
        if len(self.stage_layers) == 1:
            return f"{text}, {self.stage_bytes[0]} B"
        return (
            f"{text} on every pipeline stage; stages of {list(self.stage_layers)} "
            f"layers hold {self.stage_bytes} B (total {sum(self.stage_bytes)} B)"
        )


def host_pool_size(
    vllm_config,
    block_size: int,
    cpu_bytes: int | None = None,
    num_blocks: int | None = None,
) -> HostPoolSize:
    """Blocks of the host pool from exactly one of ``cpu_bytes`` (for the
    whole model) and ``num_blocks``; computed alike in every process."""
    if (cpu_bytes is None) == (num_blocks is None):
        raise ValueError("give exactly one of cpu_bytes and num_blocks")
    if num_blocks is not None and vllm_config.model_config is None:
        return HostPoolSize(num_blocks, block_size, 0, (), None)  # (unit tests)
    layer_block = kv_bytes_per_token_per_layer(vllm_config) * block_size
    stages = tuple(layers_per_stage(vllm_config))
    if cpu_bytes is not None:
        model_block = layer_block * sum(stages)
        if cpu_bytes < model_block:
            raise ValueError(
                f"cpu_bytes={cpu_bytes} is less than one offloaded block "
                f"of the model's {sum(stages)} layers ({model_block} B)"
            )
        num_blocks = cpu_bytes // model_block
    return HostPoolSize(num_blocks, block_size, layer_block, stages, cpu_bytes)
