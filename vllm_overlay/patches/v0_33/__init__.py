"""The runtime patches for vLLM 0.33.x, in the order they are applied (the
manifest), grouped by the feature each serves (``FEATURES``).

vLLM 0.33 is a GPU release: no CPU build of it exists, so this set holds
only what runs on the scheduler side, in pure Python, and was checked
against 0.33's own classes (a Python-only build of its sdist, ``.venv-0.33``;
``docs/vllm-0.33-delta.md``): the pool tier and the PP KV budget.  What is
unchanged from 0.32 is the v0_32 set's patch module itself; only the PP
budget's engine-core wrapper differs (0.33 passes a fourth argument).

``releases.json`` groups the upstream files each feature patches or relies
on: at startup a feature whose installed files are not byte-identical to
the tested ones is refused alone (``version_gate.check_installed_release``),
and its patches are not applied.
"""

from __future__ import annotations

from vllm_overlay.patches.v0_32 import patch_arg_utils
from vllm_overlay.patches.v0_33 import patch_engine_core, patch_offloading_connector

# version_gate.FEATURE_RELEASES' feature -> the patch modules it needs.
FEATURES = {
    # The shared pool as a secondary tier of upstream's tiered offloading:
    # the offloading config names the model config (PT32-01)
    # and the engine core measures the engine's weights and page layout
    # (KI32-01/02, in patch_engine_core beside PP33-04)
    "pool_tier": (patch_offloading_connector, patch_engine_core),
    # Pipeline-parallel KV budget split by layers (--enable-pp-prop-kv-cache)
    "pp_prop_kv_cache": (patch_arg_utils, patch_engine_core),
}

# Each module once (patch_engine_core serves both features; its
# FEATURE_PATCHES says which patch is whose, so a refusal skips only those).
MODULES = tuple(
    dict.fromkeys(module for modules in FEATURES.values() for module in modules)
)
