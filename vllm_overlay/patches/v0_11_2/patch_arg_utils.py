"""vllm/engine/arg_utils.py: the ``--enable-pp-prop-kv-cache`` option.

``EngineArgs.add_cli_args`` gains the flag (``vllm serve`` builds its parser
after loading plugins, so it appears in ``--help``); ``from_cli_args``
carries it into ``additional_config["enable_pp_prop_kv_cache"]``, where
``LLM(additional_config=...)`` users set it directly; ``create_engine_config``
validates it (budget given, partition matches the model, one block fits on
every stage) before any worker starts.
"""

from vllm_overlay.core.patching import REGISTRY, Patch
from vllm_overlay.integration import pp_kv

MODULE = "vllm.engine.arg_utils"


@staticmethod
def add_cli_args(parser):
    return pp_kv.add_cli_flag(REGISTRY.original("PP-01")(parser))


@classmethod
def from_cli_args(cls, args):
    return pp_kv.carry_cli_flag(REGISTRY.original("PP-02").__func__(cls, args), args)


def create_engine_config(self, *args, **kwargs):
    config = REGISTRY.original("PP-03")(self, *args, **kwargs)
    pp_kv.validate_pp_kv_budget(config)
    return config


_FEATURE = "pipeline-parallel KV budget"
_UPSTREAM = (
    "vllm-project/vllm#25164 (flag version; upstream later merged a "
    "different fix without the flag)"
)
_REMOVAL = (
    "Drop if upstream adopts the flag; otherwise keep while the base "
    "is 0.11.2 (upstream's min-shrink fix still leaves the budget "
    "per rank)."
)

PATCHES = [
    Patch(
        id="PP-01",
        module=MODULE,
        target="EngineArgs.add_cli_args",
        new=add_cli_args,
        feature=_FEATURE,
        upstream=_UPSTREAM,
        removal=_REMOVAL,
        why="Expose --enable-pp-prop-kv-cache on the vLLM command line.",
    ),
    Patch(
        id="PP-02",
        module=MODULE,
        target="EngineArgs.from_cli_args",
        new=from_cli_args,
        feature=_FEATURE,
        upstream=_UPSTREAM,
        removal=_REMOVAL,
        why="EngineArgs has no field for the flag; carry it in "
        "additional_config, which reaches every worker.",
    ),
    Patch(
        id="PP-03",
        module=MODULE,
        target="EngineArgs.create_engine_config",
        new=create_engine_config,
        feature=_FEATURE,
        upstream=_UPSTREAM,
        removal=_REMOVAL,
        why="Reject a bad configuration (no byte budget, a partition that "
        "does not match the model, less than one block on a stage) in the "
        "front end, with the values named.",
    ),
]
