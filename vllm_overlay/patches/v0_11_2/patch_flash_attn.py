"""vllm/v1/attention/backends/flash_attn.py: stride order with layers.

Per-layer shape ``(2, blocks, tokens, heads, head_size)``.  With a layers
dimension ``(layers, 2, blocks, tokens, heads, head_size)`` is stored as
NHD: ``[blocks, layers, 2, tokens, heads, head_size]``;
HND: ``[blocks, heads, layers, 2, tokens, head_size]`` (upstream's choice: a
TP rank's heads stay contiguous inside a block).
"""

from vllm_overlay.core.patching import Patch
from vllm_overlay.patches.v0_11_2.layout_orders import order_for_layout

MODULE = "vllm.v1.attention.backends.flash_attn"

_ORDERS = {
    # layout: (without layers, with layers)
    "NHD": ((0, 1, 2, 3, 4), (2, 0, 1, 3, 4, 5)),
    "HND": ((0, 1, 3, 2, 4), (2, 4, 0, 1, 3, 5)),
}


def stride_order_for_layout(
    cache_layout: str, include_num_layers_dimension: bool
) -> tuple[int, ...]:
    return order_for_layout(_ORDERS, cache_layout, include_num_layers_dimension)


@staticmethod
def get_kv_cache_stride_order(
    include_num_layers_dimension: bool = False,
) -> tuple[int, ...]:
    from vllm.v1.attention.backends.utils import get_kv_cache_layout

    return stride_order_for_layout(get_kv_cache_layout(), include_num_layers_dimension)


PATCHES = [
    Patch(
        id="CL-02",
        module=MODULE,
        target="FlashAttentionBackend.get_kv_cache_stride_order",
        new=get_kv_cache_stride_order,
        why="FlashAttention reads the KV cache through strides, so one "
        "buffer with blocks outermost and per-layer views works unchanged.",
        upstream="vllm-project/vllm#27743 (v0.12.0)",
        removal="Drop when the base is vLLM >= 0.12.0.",
    ),
]
