"""vllm/engine/arg_utils.py: the ``--enable-pp-prop-kv-cache`` option (0.32).

As on 0.11.2 (``patches/v0_11_2/patch_arg_utils.py``; the helpers are
``integration/pp_kv``'s): ``EngineArgs.add_cli_args`` gains the flag
(``vllm serve`` loads plugins before it builds its parser),
``from_cli_args`` carries it into
``additional_config["enable_pp_prop_kv_cache"]`` (0.32's EngineArgs still
has no field for it, and ``additional_config`` still reaches the engine
core), ``create_engine_config`` validates it before any engine process
starts.
"""

from vllm_overlay.core.patching import REGISTRY, Patch

MODULE = "vllm.engine.arg_utils"


# Each wrapper calls upstream's function, then the overlay's step
# (``patches/latest`` renders the step at the end of upstream's body).
@staticmethod
def add_cli_args(parser):
    parser = REGISTRY.original("PP32-01")(parser)
    from vllm_overlay.integration.pp_kv import add_cli_flag

    return add_cli_flag(parser)


@classmethod
def from_cli_args(cls, args):
    engine_args = REGISTRY.original("PP32-02").__func__(cls, args)
    from vllm_overlay.integration.pp_kv import carry_cli_flag

    return carry_cli_flag(engine_args, args)


def create_engine_config(self, *args, **kwargs):
    config = REGISTRY.original("PP32-03")(self, *args, **kwargs)
    from vllm_overlay.integration.pp_kv import validate_pp_kv_budget

    validate_pp_kv_budget(config)
    return config


_FEATURE = "pipeline-parallel KV budget"
_UPSTREAM = (
    "vllm-project/vllm#25164 (flag version; upstream merged a different "
    "fix without the flag)"
)
_REMOVAL = "Drop with PP32-04."

PATCHES = [
    Patch(
        id="PP32-01",
        module=MODULE,
        target="EngineArgs.add_cli_args",
        new=add_cli_args,
        feature=_FEATURE,
        upstream=_UPSTREAM,
        removal=_REMOVAL,
        why="Expose --enable-pp-prop-kv-cache on the vLLM command line.",
    ),
    Patch(
        id="PP32-02",
        module=MODULE,
        target="EngineArgs.from_cli_args",
        new=from_cli_args,
        feature=_FEATURE,
        upstream=_UPSTREAM,
        removal=_REMOVAL,
        why="EngineArgs has no field for the flag; carry it in "
        "additional_config, which reaches the engine core.",
    ),
    Patch(
        id="PP32-03",
        module=MODULE,
        target="EngineArgs.create_engine_config",
        new=create_engine_config,
        feature=_FEATURE,
        upstream=_UPSTREAM,
        removal=_REMOVAL,
        why="Reject a bad configuration (no byte budget, a partition that "
        "does not match the model, less than one block on a stage) in the "
        "front end, with the values named, as on 0.11.2.",
    ),
]
