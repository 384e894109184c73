"""The PP KV budget on real vLLM 0.32 (CPU build); prints JSON.

    python run_pp.py '{"pp": 2, "flag": true, "kv_bytes": 16777216}'
    python run_pp.py '{"check": "config"}'

The first form runs greedy generation (logprobs=1), each prompt alone
(``single``) and then all as one batch (``records``), and reports, per worker
(collective_rpc), its pipeline rank, KV layers, blocks and KV tensor bytes.
``VLLM_PP_LAYER_PARTITION`` comes from the environment.  The second builds
only the engine config (``EngineArgs.create_engine_config``, what ``LLM``
and ``vllm serve`` do first) for bad configurations of the flag, and parses
the command line flag; it reports each outcome.

``VLLM_CPU_KVCACHE_SPACE`` (1 GiB, ``cpu_defaults``) is removed when
``kv_bytes`` is given without the flag: on 0.32 the CPU platform lets it
replace ``kv_cache_memory_bytes``.  With the flag it stays: the explicit
budget wins (PP32-03).  The engine runs
with ``compilation_config.mode=1`` (TORCHDYNAMO_DISABLE=1 makes it eager):
with ``enforce_eager`` and an explicit KV size, 0.32's ``CPUWorker`` skips
its warm-up, the stages after the first never allocate their
intermediate-tensor buffers, and the first step fails
(``assert self.intermediate_tensors is not None``), in stock vLLM too.
"""

from __future__ import annotations

import json
import os
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "e2e"))

from vllm_overlay.testing import (  # noqa: E402
    cpu_defaults,
    in_process_engine,
    tiny_model_path,
)

PROMPTS = [
    "The cache of the model",
    "One two three four five six seven",
    "key value block " * 40,
]


def worker_kv(worker) -> dict:
    from vllm.distributed.parallel_state import get_pp_group

    config = worker.model_runner.kv_cache_config
    return {
        "pp_rank": get_pp_group().rank_in_group,
        "layers": sum(len(g.layer_names) for g in config.kv_cache_groups),
        "blocks": config.num_blocks,
        "kv_bytes": sum(t.size for t in config.kv_cache_tensors),
    }


def generate(config: dict) -> dict:
    from result_out import records
    from vllm import LLM, SamplingParams

    kwargs = {}
    if config.get("kv_bytes"):
        if not config.get("flag"):  # stock: the variable would replace it
            os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
        kwargs["kv_cache_memory_bytes"] = config["kv_bytes"]
    if "flag" in config:
        kwargs["additional_config"] = {"enable_pp_prop_kv_cache": config["flag"]}
    llm = LLM(
        model=tiny_model_path(),
        dtype="float32",
        max_model_len=512,
        compilation_config={"mode": 1},
        seed=0,
        pipeline_parallel_size=config.get("pp", 2),
        distributed_executor_backend="mp",
        **kwargs,
    )
    params = SamplingParams(temperature=0.0, max_tokens=12, logprobs=1)
    # One request at a time first (cold; the schedule cannot vary), then the
    # prompts as one batch: with PP=2 over processes a batch's steps form by
    # timing, so its logprobs may differ from another run's by float32 drift.
    single = []
    for prompt in PROMPTS:
        single += records(llm.generate([prompt], params, use_tqdm=False))
    return {
        "single": single,
        "records": records(llm.generate(PROMPTS, params, use_tqdm=False)),
        "workers": sorted(llm.collective_rpc(worker_kv), key=lambda w: w["pp_rank"]),
    }


def attempt(fn) -> dict:
    try:
        value = fn()
    except BaseException as exc:  # noqa: BLE001 - the error is the result
        return {"error": type(exc).__name__, "message": str(exc)}
    return {"error": None, "value": value}


def check_config() -> dict:
    from vllm.engine.arg_utils import EngineArgs
    from vllm.plugins import load_general_plugins
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    load_general_plugins()  # as vllm serve does before building its parser
    os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
    flag = {"enable_pp_prop_kv_cache": True}

    def engine_config(partition, **kwargs):
        def build():
            if partition:
                os.environ["VLLM_PP_LAYER_PARTITION"] = partition
            else:
                os.environ.pop("VLLM_PP_LAYER_PARTITION", None)
            config = EngineArgs(
                model=tiny_model_path(),
                dtype="float32",
                max_model_len=512,
                pipeline_parallel_size=2,
                distributed_executor_backend="mp",
                **kwargs,
            ).create_engine_config()
            return config.additional_config.get("enable_pp_prop_kv_cache")

        return attempt(build)

    result = {
        "no_budget": engine_config(None, additional_config=flag),
        "bad_partition": engine_config(
            "3,3", kv_cache_memory_bytes=2**24, additional_config=flag
        ),
        "too_small": engine_config(
            "3,1", kv_cache_memory_bytes=2**17, additional_config=flag
        ),
        "not_bool": engine_config(
            "3,1",
            kv_cache_memory_bytes=2**24,
            additional_config={"enable_pp_prop_kv_cache": "yes"},
        ),
        "good": engine_config(
            "3,1", kv_cache_memory_bytes=2**24, additional_config=flag
        ),
    }

    def cli(*argv):
        def parse():
            parser = EngineArgs.add_cli_args(
                FlexibleArgumentParser(exit_on_error=False)
            )
            args = parser.parse_args(["--model", tiny_model_path(), *argv])
            engine_args = EngineArgs.from_cli_args(args)
            return {
                "additional_config": engine_args.additional_config,
                "kv_cache_memory_bytes": engine_args.kv_cache_memory_bytes,
                "in_help": "--enable-pp-prop-kv-cache" in parser.format_help(),
            }

        return attempt(parse)

    result["split"] = attempt(engine_core_split)
    result["cli_flag"] = cli(
        "--enable-pp-prop-kv-cache", "--kv-cache-memory-bytes", "8G"
    )
    result["cli_no_flag"] = cli("--no-enable-pp-prop-kv-cache")
    result["cli_plain"] = cli()
    return result


def engine_core_split() -> dict:
    """What the engine core's hook (integration/v0_32/pp_kv) gives each
    worker, for real 0.32 KV specs: workers listed out of pipeline order,
    one reporting less than the budget (the GPU worker keeps back its
    multimodal reservation), one without KV layers."""
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from vllm_overlay.integration.v0_32 import pp_kv

    os.environ["VLLM_PP_LAYER_PARTITION"] = "3,1"
    from vllm.engine.arg_utils import EngineArgs

    config = EngineArgs(
        model=tiny_model_path(),
        dtype="float32",
        max_model_len=512,
        pipeline_parallel_size=2,
        distributed_executor_backend="mp",
        kv_cache_memory_bytes=2**24,
        additional_config={"enable_pp_prop_kv_cache": True},
    ).create_engine_config()
    spec = FullAttentionSpec(
        block_size=128, num_kv_heads=2, head_size=32, dtype=torch.float32
    )

    def specs(*layers):
        return {f"model.layers.{i}.self_attn.attn": spec for i in layers}

    workers = [specs(3), specs(0, 1, 2), {}]
    reported = [2**24 - 2**20, 2**24, 2**24]
    out = {"split": pp_kv.split_available_memory(config, workers, reported)}
    try:
        pp_kv.split_available_memory(config, [{"lm_head.attn": spec}], [2**24])
    except ValueError as exc:
        out["unknown_layers"] = str(exc)
    config.additional_config["enable_pp_prop_kv_cache"] = False
    out["off"] = pp_kv.split_available_memory(config, workers, reported)
    return out


def main(config: dict) -> dict:
    cpu_defaults()
    in_process_engine()  # the engine core here (collective_rpc(fn) allowed)
    result = check_config() if config.get("check") == "config" else generate(config)
    import vllm_overlay
    from vllm_overlay.core.patching import REGISTRY

    result["outcome"] = vllm_overlay.register()
    result["patches"] = {s.patch.id: s.status for s in REGISTRY.states()}
    return result


if __name__ == "__main__":
    from result_out import emit

    emit(main(json.loads(sys.argv[1])))
