"""vllm/v1/engine/core.py: the PP KV budget split by layers (0.32).

``EngineCore._initialize_kv_caches`` calls ``get_kv_cache_configs`` (which
it imports into this module) with every worker's KV specs and the memory
each worker reported; upstream then sizes each stage with all of it and
shrinks every stage to the smallest stage's block count (#25164 as
merged).  With ``--enable-pp-prop-kv-cache`` each worker's memory becomes
its stage's share of ``--kv-cache-memory-bytes`` by layers first
(``integration/v0_32/pp_kv``), so every stage fits the same number of
blocks.  Without the flag the call is upstream's, unchanged.
"""

from vllm_overlay.core.patching import REGISTRY, Patch

MODULE = "vllm.v1.engine.core"
PATCH_ID = "PP32-04"


# A wrapper: the overlay's step, then upstream's function (``patches/latest``
# renders the step at the top of upstream's body, where it is defined).
def get_kv_cache_configs(vllm_config, kv_cache_specs, available_memory):
    from vllm_overlay.integration.v0_32.pp_kv import split_available_memory

    available_memory = split_available_memory(
        vllm_config, kv_cache_specs, available_memory
    )
    return REGISTRY.original(PATCH_ID)(vllm_config, kv_cache_specs, available_memory)


PATCHES = [
    Patch(
        id=PATCH_ID,
        module=MODULE,
        target="get_kv_cache_configs",
        new=get_kv_cache_configs,
        feature="pipeline-parallel KV budget",
        why="Upstream gives every stage the whole --kv-cache-memory-bytes and "
        "keeps the smallest stage's block count: with an uneven partition the "
        "stage with more layers sets the blocks and the budget is per stage. "
        "With the flag the budget is the pipeline's, split by layers, so every "
        "stage fits the same blocks (more than upstream for the same memory).",
        upstream="vllm-project/vllm#25164 (flag version; upstream merged the "
        "min-shrink without the flag)",
        removal="Drop if upstream sizes PP stages by their share of one budget.",
    ),
]
