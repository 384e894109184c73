"""vllm/v1/attention/backends/flashinfer.py: stride order with layers.

Per-layer shape ``(blocks, 2, tokens, heads, head_size)``.  With a layers
dimension ``(layers, blocks, 2, tokens, heads, head_size)`` is stored as
NHD: ``[blocks, layers, 2, tokens, heads, head_size]``;
HND: ``[blocks, 2, heads, layers, tokens, head_size]``.

FlashInfer's TRT-LLM kernels (SM100) assert that each layer's cache is
contiguous, so where they may be used the layers dimension is refused and the
stock layout is kept (``VLLM_USE_TRTLLM_ATTENTION=0`` turns them off).
"""

from vllm_overlay.core.patching import Patch
from vllm_overlay.patches.v0_11_2.layout_orders import order_for_layout

MODULE = "vllm.v1.attention.backends.flashinfer"

_ORDERS = {
    "NHD": ((0, 1, 2, 3, 4), (1, 0, 2, 3, 4, 5)),
    "HND": ((0, 1, 3, 2, 4), (1, 2, 4, 0, 3, 5)),
}


def stride_order_for_layout(
    cache_layout: str, include_num_layers_dimension: bool
) -> tuple[int, ...]:
    return order_for_layout(_ORDERS, cache_layout, include_num_layers_dimension)


def trtllm_refusal() -> str | None:
    """Why FlashInfer cannot take a layers dimension here, or None."""
    from vllm.utils.flashinfer import (
        force_use_trtllm_attention,
        supports_trtllm_attention,
    )

    if force_use_trtllm_attention() is False:
        return None
    if supports_trtllm_attention():
        return (
            "FlashInfer may use its TRT-LLM kernels on this GPU, which "
            "need per-layer contiguous KV caches (set "
            "VLLM_USE_TRTLLM_ATTENTION=0 to allow cross-layer blocks)"
        )
    return None


@staticmethod
def get_kv_cache_stride_order(
    include_num_layers_dimension: bool = False,
) -> tuple[int, ...]:
    from vllm.v1.attention.backends.utils import get_kv_cache_layout

    if include_num_layers_dimension:
        reason = trtllm_refusal()
        if reason is not None:
            raise NotImplementedError(reason)
    return stride_order_for_layout(get_kv_cache_layout(), include_num_layers_dimension)


PATCHES = [
    Patch(
        id="CL-03",
        module=MODULE,
        target="FlashInferBackend.get_kv_cache_stride_order",
        new=get_kv_cache_stride_order,
        why="FlashInfer's paged kernels take strided caches; its TRT-LLM "
        "paths do not, so the layers dimension is refused where they may run.",
        upstream="vllm-project/vllm#27743 (v0.12.0; it does not guard the "
        "TRT-LLM paths)",
        removal="Drop when the base is vLLM >= 0.12.0 and its FlashInfer "
        "backend refuses cross-layer blocks for TRT-LLM itself.",
    ),
]
