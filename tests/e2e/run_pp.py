"""Pipeline-parallel KV budget on real vLLM (CPU build); prints JSON.

    python run_pp.py '{"pp": 2, "flag": true, "kv_bytes": 8388608}'

Runs greedy generation and reports, per worker (collective_rpc), its
pipeline rank, layers, the bytes and blocks of its KV cache.
``VLLM_PP_LAYER_PARTITION`` comes from the environment.
"""

from __future__ import annotations

import json
import sys

from vllm_overlay.testing import cpu_defaults, in_process_engine, tiny_engine_args


def worker_kv(worker) -> dict:
    from vllm.distributed.parallel_state import get_pp_group

    caches = worker.model_runner.kv_caches
    storages = {
        t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in caches
    }
    return {
        "pp_rank": get_pp_group().rank_in_group,
        "layers": len(caches),
        "kv_bytes": sum(storages.values()),
        "blocks": worker.model_runner.kv_cache_config.num_blocks,
        "budget": getattr(worker, "vllm_overlay_kv_budget", None),
    }


def main(config: dict) -> dict:
    cpu_defaults()
    in_process_engine()  # the engine core here; PP's workers are processes
    from vllm import LLM, SamplingParams

    kwargs = {}
    if config.get("pp", 1) > 1:
        kwargs.update(
            pipeline_parallel_size=config["pp"], distributed_executor_backend="mp"
        )
    if config.get("kv_bytes"):
        kwargs["kv_cache_memory_bytes"] = config["kv_bytes"]
    if "flag" in config:
        kwargs["additional_config"] = {"enable_pp_prop_kv_cache": config["flag"]}
    if "flag_field" in config:  # the patches/pp-kv-budget engine argument
        kwargs["enable_pp_prop_kv_cache"] = config["flag_field"]
    llm = LLM(
        **tiny_engine_args(max_model_len=512, num_gpu_blocks_override=None, **kwargs)
    )
    prompts = [
        "The cache of the model",
        "One two three four five six seven",
        "key value block " * 40,
    ]
    outs = llm.generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=12), use_tqdm=False
    )
    return {
        "tokens": [list(o.outputs[0].token_ids) for o in outs],
        "workers": llm.collective_rpc(worker_kv),
    }


if __name__ == "__main__":
    from result_out import emit

    emit(main(json.loads(sys.argv[1])))
