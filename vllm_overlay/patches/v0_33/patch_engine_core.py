"""vllm/v1/engine/core.py on vLLM 0.33: the PP KV budget split by layers.

As PP32-04 (``patches/v0_32/patch_engine_core.py``, which says why), with
0.33's signature: ``get_kv_cache_configs`` moved to
``vllm.v1.core.kv_cache_planning`` (imported into this module under the
same name) and takes a fourth argument, the global KV cache groups that
``EngineCore._initialize_kv_caches`` computes first.  The block arithmetic
that the split feeds is unchanged (``docs/vllm-0.33-delta.md`` e).  The
idle wait (EC32-01/02) is not in this set: it was measured in a running
engine, and no 0.33 engine runs here.  The pool tier's KV identity
(KI32-01/02, the v0_32 module's patches) is: the methods it wraps are
unchanged in 0.33.
"""

import dataclasses

from vllm_overlay.core.patching import REGISTRY
from vllm_overlay.patches.v0_32 import patch_engine_core as v0_32

MODULE = v0_32.MODULE
PATCH_ID = "PP33-04"


def get_kv_cache_configs(
    vllm_config, kv_cache_specs, available_memory, global_kv_cache_groups
):
    from vllm_overlay.integration.v0_32.pp_kv import split_available_memory

    available_memory = split_available_memory(
        vllm_config, kv_cache_specs, available_memory
    )
    return REGISTRY.original(PATCH_ID)(
        vllm_config, kv_cache_specs, available_memory, global_kv_cache_groups
    )


# KI32-01/02 (the engine's KV identity, for the pool tier): 0.33's
# ``_initialize_kv_caches`` still returns the config the scheduler is built
# with; ``reset_prefix_cache`` and ``collective_rpc`` have 0.32's signatures.
KV_IDENTITY_IDS = ("KI32-01", "KI32-02", "KI32-03")
# This module serves two features: a refused one leaves only its own out
# (``patches.refused_patches``).
FEATURE_PATCHES = {"pool_tier": KV_IDENTITY_IDS, "pp_prop_kv_cache": (PATCH_ID,)}

PATCHES = [patch for patch in v0_32.PATCHES if patch.id in KV_IDENTITY_IDS] + [
    dataclasses.replace(
        patch,
        id=PATCH_ID,
        new=get_kv_cache_configs,
        why=patch.why + " (0.33: the same wrapper, passing on the fourth "
        "argument, global_kv_cache_groups)",
    )
    for patch in v0_32.PATCHES
    if patch.id == v0_32.PATCH_ID
]
