"""vllm/v1/attention/backends/mla/indexer.py: the DeepSeek-V3.2 indexer.

The indexer's order takes no argument in 0.11.2, so the new keyword would
raise TypeError.  It keeps ``(0, 1, 2)`` without layers and refuses a layers
dimension: its cache sits in a model with two KV specs, which never gets
cross-layer blocks, and upstream's answer (layers outermost) gives no
per-block contiguity.
"""

from vllm_overlay.core.patching import Patch

MODULE = "vllm.v1.attention.backends.mla.indexer"


@staticmethod
def get_kv_cache_stride_order(
    include_num_layers_dimension: bool = False,
) -> tuple[int, ...]:
    if include_num_layers_dimension:
        raise NotImplementedError(
            "the DeepSeek-V3.2 indexer cache does not support cross-layer blocks"
        )
    return (0, 1, 2)


PATCHES = [
    Patch(
        id="CL-05",
        module=MODULE,
        target="DeepseekV32IndexerBackend.get_kv_cache_stride_order",
        new=get_kv_cache_stride_order,
        why="Accept the include_num_layers_dimension keyword (no TypeError) "
        "and refuse a layers dimension explicitly.",
        upstream="vllm-project/vllm#27743 (v0.12.0 adds the keyword; it "
        "returns layers outermost)",
        removal="Drop when the base is vLLM >= 0.12.0.",
    ),
]
