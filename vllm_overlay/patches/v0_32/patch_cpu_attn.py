"""vllm/v1/attention/backends/cpu_attn.py: cross-layer KV blocks on CPU.

vLLM 0.32 chooses one KV cache layout for the model from what every
attention backend supports (``supported_kv_cache_layouts``).  A
blocks-outermost layout (``BLHNC``: ``[blocks, layers, heads, tokens,
2*head_size]``) is upstream's cross-layer layout: a block's KV for every
layer is one contiguous run, which an offloading connector moves with one
copy.  CPU_ATTN offers only ``LBHNC``, though its kernels
(``cpu_attn_reshape_and_cache``, ``cpu_attention_with_kv_cache``) index each
layer's cache through its block stride, and the backend splits K and V with
a view of the inner ``[heads, tokens, 2*head_size]`` run, which stays
contiguous.  Offering ``BLHNC`` after ``LBHNC`` keeps the default layout and
lets a connector (``get_required_kvcache_layout``) or
``VLLM_KV_CACHE_LAYOUT=BLHNC`` choose cross-layer blocks on CPU.
"""

from vllm_overlay.core.patching import Patch

MODULE = "vllm.v1.attention.backends.cpu_attn"


@classmethod
def supported_kv_cache_layouts(cls):
    from vllm.v1.kv_cache_layout import KVCacheLayout

    return (KVCacheLayout.LBHNC, KVCacheLayout.BLHNC)


PATCHES = [
    Patch(
        id="CL32-01",
        module=MODULE,
        target="CPUAttentionBackend.supported_kv_cache_layouts",
        new=supported_kv_cache_layouts,
        why="Lets upstream's cross-layer layout (BLHNC) run on the CPU "
        "platform; stock CPU_ATTN offers LBHNC only, so a connector or "
        "VLLM_KV_CACHE_LAYOUT asking for cross-layer blocks on CPU is refused "
        "or ignored.",
        upstream="none: to be proposed (CPU_ATTN's kernels already take the "
        "block stride)",
        removal="Drop once upstream CPU_ATTN lists BLHNC.",
    ),
]
