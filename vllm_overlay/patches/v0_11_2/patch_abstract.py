"""vllm/attention/backends/abstract.py: the stride-order keyword on the base.

In 0.11.2 ``AttentionBackend.get_kv_cache_stride_order()`` takes no argument,
so asking a backend that inherits it for a layers dimension raises TypeError.
The base now accepts ``include_num_layers_dimension`` and says, by raising
NotImplementedError with the backend's name, that it has no order (the stock
caller already falls back to the identity order on NotImplementedError).
"""

from vllm_overlay.core.patching import Patch

MODULE = "vllm.attention.backends.abstract"


@classmethod
def get_kv_cache_stride_order(
    cls, include_num_layers_dimension: bool = False
) -> tuple[int, ...]:
    what = "a layers dimension" if include_num_layers_dimension else "one"
    raise NotImplementedError(
        f"attention backend {cls.__name__} defines no KV cache stride order with {what}"
    )


PATCHES = [
    Patch(
        id="CL-01",
        module=MODULE,
        target="AttentionBackend.get_kv_cache_stride_order",
        new=get_kv_cache_stride_order,
        why="Backends without a stride order must answer the "
        "include_num_layers_dimension question with NotImplementedError, "
        "not TypeError, so allocation can fall back to the stock layout.",
        upstream="vllm-project/vllm#27743 (v0.12.0: keyword on the base method)",
        removal="Drop when the base is vLLM >= 0.12.0, which has the keyword.",
    ),
]
