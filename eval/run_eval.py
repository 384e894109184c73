"""Run the copy-model lm-eval tasks on one KV path; print JSON results.

    python eval/run_eval.py --path {stock,cross,offload,pool,pp} [--pool-url URL]
                            [--break-layout]

``stock`` is meant to run with ``VLLM_OVERLAY_DISABLE=1`` (the caller sets
it).  ``offload`` and ``pool`` evaluate twice in one engine, resetting the
prefix cache in between, and report the second pass: its KV comes back from
host memory or from the pool.  ``--break-layout`` aliases every layer's view
to layer 0's cache (to prove the suite catches a broken layout).

Output after ``RESULT:``: metrics, and per sample the choice loglikelihoods
(``copy_mc``) and the generation (``copy_gen``).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib

HERE = pathlib.Path(__file__).parent
TASKS = ["copy_mc", "copy_gen"]


def model_args(path: str, pool_url: str | None) -> dict:
    args = dict(pretrained=str(HERE / "model" / "copy_llama"), dtype="float32",
                max_model_len=1024, enforce_eager=True, seed=0,
                num_gpu_blocks_override=64)
    if path == "cross":
        args["kv_transfer_config"] = {
            "kv_connector": "CrossLayerProbeConnector", "kv_role": "kv_both"}
    elif path == "offload":
        args["kv_transfer_config"] = {
            "kv_connector": "OverlayOffloadingConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"num_cpu_blocks": 256}}
    elif path == "pool":
        args["kv_transfer_config"] = {
            "kv_connector": "SharedKVPoolConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"url": pool_url,
                                          "namespace": "eval"}}
    elif path == "pp":
        args.pop("num_gpu_blocks_override")
        args.update(pipeline_parallel_size=2, distributed_executor_backend="mp",
                    kv_cache_memory_bytes=64 << 20,
                    additional_config={"enable_pp_prop_kv_cache": True})
    return args


def evaluate(lm) -> dict:
    import lm_eval
    from lm_eval.tasks import TaskManager

    cwd = os.getcwd()
    os.chdir(HERE / "tasks")  # data_files are relative to the task folder
    try:
        out = lm_eval.simple_evaluate(
            model=lm, tasks=TASKS, task_manager=TaskManager(
                include_path=str(HERE / "tasks")), log_samples=True)
    finally:
        os.chdir(cwd)
    metrics = {task: {k: v for k, v in out["results"][task].items()
                      if isinstance(v, (int, float)) and "stderr" not in k}
               for task in TASKS}
    samples = {
        "copy_mc": [[r[0][0] for r in s["resps"]]
                    for s in sorted(out["samples"]["copy_mc"],
                                    key=lambda s: s["doc_id"])],
        "copy_gen": [s["resps"][0][0] for s in sorted(
            out["samples"]["copy_gen"], key=lambda s: s["doc_id"])],
    }
    return {"metrics": metrics, "samples": samples}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--path", required=True,
                        choices=["stock", "cross", "offload", "pool", "pp"])
    parser.add_argument("--pool-url")
    parser.add_argument("--break-layout", action="store_true")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if args.path != "pp":
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if args.break_layout:
        from vllm_overlay.kv_layout import CrossLayerKVLayout

        views = CrossLayerKVLayout.layer_views
        CrossLayerKVLayout.layer_views = (
            lambda self, buffer: [views(self, buffer)[0]] * self.num_layers)
    from lm_eval.models.vllm_causallms import VLLM

    lm = VLLM(**model_args(args.path, args.pool_url))
    result = evaluate(lm)
    if args.path in ("offload", "pool"):
        from vllm import SamplingParams

        # Let async stores finish, drop the device prefix cache, run again:
        # the second pass reloads the KV from host memory or the pool.
        lm.model.generate(["t00"], SamplingParams(max_tokens=1),
                          use_tqdm=False)
        if args.path == "pool":
            lm.model.collective_rpc(_drain_pool)
        lm.model.reset_prefix_cache()
        first = result
        result = evaluate(lm)
        result["first_pass_metrics"] = first["metrics"]
    print("RESULT:" + json.dumps(result))


def _drain_pool(worker) -> None:
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    get_kv_transfer_group().pool.drain()


if __name__ == "__main__":
    main()
