"""vllm/v1/attention/backends/cpu_attn.py: stride order for CPU_ATTN.

Per-layer shape ``(2, blocks, heads, tokens, head_size)``.  With a layers
dimension it is stored as ``[blocks, layers, 2, heads, tokens, head_size]``.
The CPU kernels (``cpu_attn_reshape_and_cache``,
``cpu_attention_with_kv_cache``) index K and V through their strides, so the
per-layer views need no other change.  Upstream never supported CPU.
"""

from vllm_overlay.core.patching import Patch

MODULE = "vllm.v1.attention.backends.cpu_attn"


@staticmethod
def get_kv_cache_stride_order(
    include_num_layers_dimension: bool = False,
) -> tuple[int, ...]:
    return (2, 0, 1, 3, 4, 5) if include_num_layers_dimension else (0, 1, 2, 3, 4)


PATCHES = [
    Patch(
        id="CL-06",
        module=MODULE,
        target="CPUAttentionBackend.get_kv_cache_stride_order",
        new=get_kv_cache_stride_order,
        why="Lets the CPU platform (and so CI) run cross-layer blocks; stock "
        "CPU_ATTN has no stride order at all.",
        upstream="none: upstream's cross-layer work (#27743) covers GPU "
        "backends only; to be proposed with the patches/ series",
        removal="Drop once upstream CPU_ATTN defines the order, or when the "
        "base moves past 0.11.2 and the series is upstreamed.",
    ),
]
