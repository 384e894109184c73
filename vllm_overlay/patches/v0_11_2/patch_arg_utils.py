"""vllm/engine/arg_utils.py: the ``--enable-pp-prop-kv-cache`` option.

The replacements of the 0.32 set (``patches/v0_32/patch_arg_utils.py``:
the flag on the command line, carried into ``additional_config``, validated
in ``create_engine_config``) under this set's ids.
"""

from vllm_overlay.patches.v0_32.patch_arg_utils import (
    MODULE,  # noqa: F401  (the catalogue reads it)
    engine_args_patches,
)

PATCHES = engine_args_patches(
    ("PP-01", "PP-02", "PP-03"),
    upstream="vllm-project/vllm#25164 (flag version; upstream later merged a "
    "different fix without the flag)",
    removal="Drop if upstream adopts the flag; otherwise keep while the base "
    "is 0.11.2 (upstream's min-shrink fix still leaves the budget per rank).",
)
