"""The PP KV budget split in the engine core (vLLM 0.32 and later).

``EngineCore._initialize_kv_caches`` gathers every worker's KV specs and
the KV memory each one reports (``determine_available_memory``: on CPU and
GPU, ``kv_cache_memory_bytes`` when it is set, per worker), then
``get_kv_cache_configs`` sizes each worker and shrinks every stage to the
smallest stage's block count.  With ``--enable-pp-prop-kv-cache`` the
memory each worker gets is its stage's share of the budget by layers
(``pp_kv.stage_budgets``, the split the flag defines), so every stage fits
the same number of blocks and the shrink leaves nothing unused.

A worker's stage comes from the layers in its KV specs (vLLM's layer
names, ``extract_layer_index``), not from its position in the list: the
order of the executor's workers is not the pipeline's on every executor.
"""

from __future__ import annotations

import logging

from vllm_overlay.integration import pp_kv

logger = logging.getLogger("vllm.overlay")


def _layer_index(name: str) -> int | None:
    from vllm.model_executor.models.utils import extract_layer_index

    try:
        return extract_layer_index(name)
    except (AssertionError, ValueError):
        return None


def worker_stage(layer_names, budgets: list) -> int:
    """The pipeline stage that holds these KV layers (one worker's)."""
    bounds, start = [], 0
    for budget in budgets:
        bounds.append((start, start + budget.layers))
        start += budget.layers
    stages = {
        rank
        for index in map(_layer_index, layer_names)
        if index is not None
        for rank, (lo, hi) in enumerate(bounds)
        if lo <= index < hi
    }
    if len(stages) != 1:
        raise ValueError(
            f"{pp_kv.CLI_FLAG}: cannot tell which pipeline stage holds the KV "
            f"layers {sorted(layer_names)[:4]}... (stages of "
            f"{[b.layers for b in budgets]} layers; found {sorted(stages)})"
        )
    return stages.pop()


def split_available_memory(
    vllm_config, kv_cache_specs: list[dict], available_memory: list[int]
) -> list[int]:
    """Each worker's KV memory: its stage's share of the budget when the
    flag is on (less what the worker itself kept back from the budget, such
    as the GPU worker's multimodal reservation); else unchanged."""
    if not pp_kv.enabled(vllm_config):
        return available_memory
    total = vllm_config.cache_config.kv_cache_memory_bytes
    budgets = pp_kv.stage_budgets(vllm_config)
    split, described = [], set()
    for specs, reported in zip(kv_cache_specs, available_memory):
        if not specs:  # no KV on this worker: nothing to size
            split.append(reported)
            continue
        budget = budgets[worker_stage(specs, budgets)]
        budget.check()
        split.append(budget.bytes - max(0, total - reported))
        if budget.rank not in described:
            described.add(budget.rank)
            logger.info(
                "vllm-overlay: %s",
                budget.describe(vllm_config.model_config.max_model_len),
            )
    logger.info(
        "vllm-overlay: PP KV budget split in the engine core: workers "
        "reported %s B, sized with %s B",
        list(available_memory),
        split,
    )
    return split
