"""Run one lm-eval config on one KV path; print its results as JSON.

    python eval/run_eval.py --config eval/configs/copy-llama.yaml \\
        --path {stock,cross,offload,pool,pp} [--pool-url URL] [--break-layout]

``stock`` is meant to run with ``VLLM_OVERLAY_DISABLE=1`` (the caller sets
it; ``eval/check_suite.py`` does).  ``offload`` and ``pool`` evaluate twice in
one engine, resetting the device prefix cache in between, and report the
second pass: its KV comes back from host memory or from the pool.  ``pp``
runs PP=2 with the proportional KV budget.  ``--break-layout`` aliases every
layer's view of the cross-layer buffer to layer 0 (proves the suite catches
a broken layout).

Output after ``RESULT:`` (and in ``--out FILE``): metrics per task, and per
task and sample (by doc id) each response: a loglikelihood for
loglikelihood-type tasks, the text for generate_until.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
PATHS = ("stock", "cross", "offload", "pool", "pp")


def load_config(path: str | os.PathLike) -> dict:
    import yaml

    with open(path) as f:
        return yaml.safe_load(f)


def model_args(config: dict, path: str, pool_url: str | None) -> dict:
    model = config["model_name"]
    if (ROOT / model).exists():
        model = str(ROOT / model)
    args = {"pretrained": model, **config.get("model_args", {})}
    if path == "cross":
        args["kv_transfer_config"] = {
            "kv_connector": "CrossLayerProbeConnector",
            "kv_role": "kv_both",
        }
    elif path == "offload":
        args["kv_transfer_config"] = {
            "kv_connector": "OverlayOffloadingConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "num_cpu_blocks": config.get("offload_num_cpu_blocks", 1024)
            },
        }
    elif path == "pool":
        if not pool_url:
            raise SystemExit("--path pool needs --pool-url")
        args["kv_transfer_config"] = {
            "kv_connector": "SharedKVPoolConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"url": pool_url, "namespace": "eval"},
        }
    elif path == "pp":
        args.pop("num_gpu_blocks_override", None)
        args.update(
            pipeline_parallel_size=2,
            distributed_executor_backend="mp",
            kv_cache_memory_bytes=config["pp_kv_cache_memory_bytes"],
            additional_config={"enable_pp_prop_kv_cache": True},
        )
    return args


def evaluate(lm, config: dict) -> dict:
    import lm_eval
    from lm_eval.tasks import TaskManager

    tasks = [t["name"] for t in config["tasks"]]
    include = config.get("include_path")
    manager = (
        TaskManager(include_path=str(ROOT / include)) if include else TaskManager()
    )
    cwd = os.getcwd()
    if include:  # local tasks name their data files relative to their folder
        os.chdir(ROOT / include)
    try:
        out = lm_eval.simple_evaluate(
            model=lm,
            tasks=tasks,
            task_manager=manager,
            log_samples=True,
            num_fewshot=config.get("num_fewshot"),
            limit=config.get("limit"),
        )
    finally:
        os.chdir(cwd)
    metrics = {
        task: {
            k: v
            for k, v in out["results"][task].items()
            if isinstance(v, (int, float)) and "stderr" not in k
        }
        for task in tasks
    }
    samples = {
        task: [
            [_response(r) for r in s["resps"]]
            for s in sorted(out["samples"][task], key=lambda s: s["doc_id"])
        ]
        for task in tasks
    }
    return {"metrics": metrics, "samples": samples}


def _response(resp):
    value = resp[0]
    if isinstance(value, (list, tuple)):  # (loglikelihood, is_greedy)
        return value[0]
    return value


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--config", default=str(ROOT / "eval" / "configs" / "copy-llama.yaml")
    )
    parser.add_argument("--path", required=True, choices=PATHS)
    parser.add_argument("--pool-url")
    parser.add_argument("--break-layout", action="store_true")
    parser.add_argument(
        "--out",
        help="also write the JSON result here "
        "(worker processes share stdout in the pp path)",
    )
    args = parser.parse_args()
    config = load_config(args.config)
    if args.path not in config["paths"]:
        raise SystemExit(f"path {args.path!r} is not in {args.config}")
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
    import torch

    from vllm_overlay.testing import cpu_defaults

    if not torch.cuda.is_available():
        cpu_defaults()
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    if args.path != "pp":  # in-process engine: deterministic on CPU
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    elif config.get("pp_layer_partition"):
        os.environ["VLLM_PP_LAYER_PARTITION"] = config["pp_layer_partition"]
    if args.break_layout:
        from vllm_overlay.core.kv_layout import CrossLayerKVLayout

        views = CrossLayerKVLayout.layer_views
        CrossLayerKVLayout.layer_views = (
            lambda self, buffer: [views(self, buffer)[0]] * self.num_layers
        )
    from lm_eval.models.vllm_causallms import VLLM

    lm = VLLM(**model_args(config, args.path, args.pool_url))
    result = evaluate(lm, config)
    if args.path in ("offload", "pool"):
        from vllm import SamplingParams

        # Let async stores finish, drop the device prefix cache, run again:
        # the second pass reloads the KV from host memory or the pool.
        lm.model.generate(["flush"], SamplingParams(max_tokens=1), use_tqdm=False)
        if args.path == "pool":
            lm.model.collective_rpc(_drain_pool)
        lm.model.reset_prefix_cache()
        first = result
        result = evaluate(lm, config)
        result["first_pass_metrics"] = first["metrics"]
        result["connector_totals"] = lm.model.collective_rpc(_totals)[0]
    text = json.dumps(result)
    if args.out:
        pathlib.Path(args.out).write_text(text)
    print("RESULT:" + text)


def _drain_pool(worker) -> None:
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    get_kv_transfer_group().pool.drain()


def _totals(worker) -> dict:
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    connector = get_kv_transfer_group()
    if hasattr(connector, "pool"):
        connector.pool.drain()
        return connector.pool.cumulative()
    return connector.connector_worker.handler.cumulative()


if __name__ == "__main__":
    main()
