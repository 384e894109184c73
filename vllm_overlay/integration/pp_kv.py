"""Pipeline-parallel KV budget (vLLM adapter of ``pp_budget``).

On with ``--enable-pp-prop-kv-cache`` (``vllm serve``) or
``additional_config={"enable_pp_prop_kv_cache": True}`` (``LLM``); then
``--kv-cache-memory-bytes`` is the budget of the whole pipeline and each
stage gets its share by layers (``VLLM_PP_LAYER_PARTITION`` or vLLM's
default split).  The layers per stage come from ``model_kv``, which also
splits the offloading connector's ``cpu_bytes`` across the stages.
"""

from __future__ import annotations

import argparse
import logging

from vllm_overlay.core.pp_budget import StageBudget, split_budget
from vllm_overlay.integration import model_kv

logger = logging.getLogger("vllm.overlay")

FLAG = "enable_pp_prop_kv_cache"
CLI_FLAG = "--enable-pp-prop-kv-cache"


def add_cli_flag(parser):
    """``EngineArgs.add_cli_args``: the option on vLLM's command line."""
    parser.add_argument(
        CLI_FLAG,
        action=argparse.BooleanOptionalAction,
        default=None,
        help="(vllm-overlay) Treat --kv-cache-memory-bytes as the KV budget "
        "of the whole pipeline and give each pipeline stage a share "
        "proportional to its layers (VLLM_PP_LAYER_PARTITION), so every "
        "stage fits the same number of blocks. Needs "
        "--kv-cache-memory-bytes.",
    )
    return parser


def carry_cli_flag(engine_args, args):
    """``EngineArgs.from_cli_args``: EngineArgs has no field for the
    option; it travels in ``additional_config``, which reaches every
    process of the engine."""
    flag = getattr(args, FLAG, None)
    if flag is not None:
        engine_args.additional_config = {
            **(engine_args.additional_config or {}),
            FLAG: flag,
        }
    return engine_args


def enabled(vllm_config) -> bool:
    value = (vllm_config.additional_config or {}).get(FLAG, False)
    if not isinstance(value, bool):
        raise ValueError(
            f"additional_config['{FLAG}'] must be true or false, got {value!r}"
        )
    return value


def layers_per_stage(vllm_config) -> list[int]:
    try:
        return model_kv.layers_per_stage(vllm_config)
    except ValueError as exc:
        import os

        total = getattr(vllm_config.model_config.hf_text_config, "num_hidden_layers", 0)
        pp = vllm_config.parallel_config.pipeline_parallel_size
        raise ValueError(
            f"{CLI_FLAG}: VLLM_PP_LAYER_PARTITION="
            f"{os.environ.get('VLLM_PP_LAYER_PARTITION')!r} does not split "
            f"the model's {total} layers over {pp} pipeline stages ({exc})"
        ) from exc


def stage_budgets(vllm_config) -> list[StageBudget]:
    total = vllm_config.cache_config.kv_cache_memory_bytes
    if not total:
        raise ValueError(
            f"{CLI_FLAG} (additional_config['{FLAG}']) needs "
            "--kv-cache-memory-bytes: the KV budget of the whole "
            "pipeline, which it splits by layers"
        )
    layers = layers_per_stage(vllm_config)
    block_size = vllm_config.cache_config.block_size
    page = block_size * model_kv.kv_bytes_per_token_per_layer(vllm_config)
    return [
        StageBudget(rank, n, share, page, block_size)
        for rank, (n, share) in enumerate(zip(layers, split_budget(total, layers)))
    ]


def keep_explicit_budget(engine_args, vllm_config) -> None:
    """Front end: with the flag, an explicit ``--kv-cache-memory-bytes`` is
    the pipeline's budget.  The CPU platform replaces it with
    ``VLLM_CPU_KVCACHE_SPACE`` when that is set (its config update, inside
    ``create_engine_config``); the explicit value is put back, and logged."""
    explicit = getattr(engine_args, "kv_cache_memory_bytes", None)
    cache_config = vllm_config.cache_config
    if (
        not enabled(vllm_config)
        or explicit is None
        or cache_config.kv_cache_memory_bytes == explicit
    ):
        return
    logger.info(
        "vllm-overlay: %s: --kv-cache-memory-bytes %d B is the pipeline's KV "
        "budget, not the %s B the platform set (VLLM_CPU_KVCACHE_SPACE)",
        CLI_FLAG,
        explicit,
        cache_config.kv_cache_memory_bytes,
    )
    cache_config.kv_cache_memory_bytes = explicit


def validate_pp_kv_budget(vllm_config) -> None:
    """Front end: reject a bad configuration before any worker starts."""
    if not enabled(vllm_config):
        return
    budgets = stage_budgets(vllm_config)
    for budget in budgets:
        budget.check()
    logger.info(
        "vllm-overlay: PP KV budget %d B split by layers %s: %s B; %s blocks per stage",
        vllm_config.cache_config.kv_cache_memory_bytes,
        [b.layers for b in budgets],
        [b.bytes for b in budgets],
        [b.blocks for b in budgets],
    )


def rank_budget(vllm_config, stock_bytes: int) -> int:
    """Worker: this stage's share when the flag is on, else ``stock_bytes``."""
    if not enabled(vllm_config):
        return stock_bytes
    from vllm.distributed.parallel_state import get_pp_group

    budget = stage_budgets(vllm_config)[get_pp_group().rank_in_group]
    budget.check()
    logger.info(
        "vllm-overlay: %s", budget.describe(vllm_config.model_config.max_model_len)
    )
    return budget.bytes
