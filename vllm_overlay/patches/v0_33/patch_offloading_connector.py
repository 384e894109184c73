"""vllm/distributed/kv_transfer/kv_connector/v1/offloading_connector.py on
vLLM 0.33: the offloading config names the model config whose KV it holds.

The module is byte-identical in 0.32.0 and 0.33.0, so this is the v0_32
set's PT32-01 (``patches/v0_32/patch_offloading_connector.py``, which says
why).  Its OF32-05 is not here: it reports the failed copies of the
overlay's CPU offloading worker, a CPU-platform feature.
"""

from vllm_overlay.patches.v0_32.patch_offloading_connector import (
    MODULE,
    PATCH_ID,
)
from vllm_overlay.patches.v0_32.patch_offloading_connector import (
    PATCHES as _V0_32,
)

PATCHES = [patch for patch in _V0_32 if patch.id == PATCH_ID]
__all__ = ["MODULE", "PATCHES"]
