"""vllm/v1/attention/backends/mla/common.py: stride order for the MLA family.

MLA caches one latent vector per token: per-layer shape
``(blocks, tokens, head_size)``.  With a layers dimension it is stored as
``[blocks, layers, tokens, head_size]``.  Every backend deriving from
``MLACommonBackend`` (FlashMLA, FlashAttnMLA, CutlassMLA, FlashInferMLA,
TritonMLA, AiterMLA) inherits it.
"""

from vllm_overlay.core.patching import Patch

MODULE = "vllm.v1.attention.backends.mla.common"


@staticmethod
def get_kv_cache_stride_order(
    include_num_layers_dimension: bool = False,
) -> tuple[int, ...]:
    return (1, 0, 2, 3) if include_num_layers_dimension else (0, 1, 2)


PATCHES = [
    Patch(
        id="CL-04",
        module=MODULE,
        target="MLACommonBackend.get_kv_cache_stride_order",
        new=get_kv_cache_stride_order,
        why="MLA latent caches are blocks-first; a layers dimension right "
        "after blocks makes each block one run for all layers.",
        upstream="vllm-project/vllm#27743 (v0.12.0)",
        removal="Drop when the base is vLLM >= 0.12.0.",
    ),
]
