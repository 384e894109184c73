"""vllm/engine/arg_utils.py: the ``--enable-pp-prop-kv-cache`` option (0.32).

``EngineArgs.add_cli_args`` gains the flag (``vllm serve`` loads plugins
before it builds its parser, so it appears in ``--help``);
``from_cli_args`` carries it into
``additional_config["enable_pp_prop_kv_cache"]`` (EngineArgs has no field
for it, and ``additional_config`` reaches the engine core and every worker;
``LLM(additional_config=...)`` users set it directly);
``create_engine_config`` keeps an explicit ``--kv-cache-memory-bytes`` as
the budget (the CPU platform replaces it with ``VLLM_CPU_KVCACHE_SPACE``)
and validates it (budget given, partition matches the model, one block
fits on every stage) before any engine process starts;
on 0.32 it also refuses there what 0.32 would fail on only after the model
loaded or at the first request (``integration/v0_32/config_check``).

The 0.11.2 set (``patches/v0_11_2/patch_arg_utils.py``) applies the same
replacements under its own ids (``engine_args_patches``): each wrapper
finds upstream's function by itself (``REGISTRY.original_of``).  The steps
are ``integration/pp_kv``'s.
"""

from vllm_overlay.core.patching import REGISTRY, Patch

MODULE = "vllm.engine.arg_utils"


# Each wrapper calls upstream's function, then the overlay's step
# (``patches/latest`` renders the step at the end of upstream's body).
@staticmethod
def add_cli_args(parser):
    parser = REGISTRY.original_of(add_cli_args)(parser)
    from vllm_overlay.integration.pp_kv import add_cli_flag

    return add_cli_flag(parser)


@classmethod
def from_cli_args(cls, args):
    engine_args = REGISTRY.original_of(from_cli_args).__func__(cls, args)
    from vllm_overlay.integration.pp_kv import carry_cli_flag

    return carry_cli_flag(engine_args, args)


def create_engine_config(self, *args, **kwargs):
    config = REGISTRY.original_of(create_engine_config)(self, *args, **kwargs)
    # runtime only: begin (the overlay's startup checks of vLLM 0.32's
    # offloading and CPU worker, integration/v0_32/config_check: not staged)
    if _in_v0_32_set():
        from vllm_overlay.integration.v0_32.config_check import (
            ConfigRefused,
            refusal,
        )

        error = refusal(config)
        if error:
            raise ConfigRefused(error)  # one line: the key and the fix
    # runtime only: end
    from vllm_overlay.integration.pp_kv import (
        keep_explicit_budget,
        validate_pp_kv_budget,
    )

    keep_explicit_budget(self, config)
    validate_pp_kv_budget(config)
    return config


def _in_v0_32_set() -> bool:
    """The wrapper runs as PP32-03: the 0.32 set's patch, which the 0.33 set
    shares (config_check holds there too); the 0.11.2 set applies the same
    function under its own id."""
    return any(
        state.patch.id == "PP32-03" and state.status == "applied"
        for state in REGISTRY.states()
    )


def engine_args_patches(ids: tuple[str, str, str], upstream: str, removal: str):
    """The three ``EngineArgs`` patches under a patch set's ids, with its
    upstream reference and removal note."""
    why = {
        "add_cli_args": "Expose --enable-pp-prop-kv-cache on the vLLM command line.",
        "from_cli_args": "EngineArgs has no field for the flag; carry it in "
        "additional_config, which reaches the engine core and every worker.",
        "create_engine_config": "Reject a bad configuration (no byte budget, a "
        "partition that does not match the model, less than one block on a "
        "stage) in the front end, with the values named; keep an explicit "
        "--kv-cache-memory-bytes as the budget where the CPU platform "
        "replaces it with VLLM_CPU_KVCACHE_SPACE. On 0.32 also, in "
        "one line naming the key and the fix, what the engine would fail on "
        "only after the model loaded or at the first request "
        "(integration/v0_32/config_check).",
    }
    news = (add_cli_args, from_cli_args, create_engine_config)
    return [
        Patch(
            id=patch_id,
            module=MODULE,
            target=f"EngineArgs.{name}",
            new=new,
            feature="pipeline-parallel KV budget",
            upstream=upstream,
            removal=removal,
            why=why[name],
        )
        for patch_id, new, name in zip(ids, news, why)
    ]


PATCHES = engine_args_patches(
    ("PP32-01", "PP32-02", "PP32-03"),
    upstream="vllm-project/vllm#25164 (flag version; upstream merged a different "
    "fix without the flag)",
    removal="Drop with PP32-04.",
)
