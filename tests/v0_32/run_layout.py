"""One vLLM 0.32 run of the tiny Llama (CPU build), printed as JSON: two
passes over prompts of 1 to 5 blocks (cold, then from the device prefix
cache), greedy tokens with their logprobs and cached tokens, the KV cache
layout vLLM resolved and what the worker's KV tensors really are.
``{"single": true}`` adds two passes of one request at a time: each prompt
after the device prefix cache is emptied (a recompute), then again (a hit).

    python run_layout.py '{}'    # env: VLLM_KV_CACHE_LAYOUT, VLLM_OVERLAY_*
"""

from __future__ import annotations

import json
import os
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "e2e"))
from result_out import records  # noqa: E402
from run_llm import prompts  # noqa: E402

from vllm_overlay.testing import cpu_defaults, tiny_engine_args  # noqa: E402


def inspect_worker(worker) -> dict:
    """Runs in the worker: each attention layer's KV tensor."""
    runner = worker.model_runner
    layers = {}
    for name, layer in runner.compilation_config.static_forward_context.items():
        cache = getattr(layer, "kv_cache", None)
        if cache is None:
            continue
        tensor = cache[0] if isinstance(cache, (list, tuple)) else cache
        if tensor.numel():
            layers[name] = {
                "shape": list(tensor.shape),
                "stride": list(tensor.stride()),
                "storage": tensor.untyped_storage().data_ptr(),
                "offset": tensor.storage_offset(),
            }
    return {
        "layout": runner.cache_config.get_resolved_kv_cache_layout().name,
        "layers": layers,
    }


def main(config: dict) -> dict:
    cpu_defaults()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # collective_rpc fn
    from vllm import LLM, SamplingParams

    llm = LLM(**tiny_engine_args())
    params = SamplingParams(temperature=0.0, max_tokens=16, logprobs=1)
    passes = []
    for _ in range(2):  # the second pass hits the prefix cache
        passes.append(records(llm.generate(prompts(), params, use_tqdm=False)))
    if config.get("single"):  # each prompt alone: recomputed, then a hit
        single = [[], []]
        for text in prompts():
            assert llm.reset_prefix_cache()
            for again in (0, 1):
                single[again] += records(llm.generate([text], params, use_tqdm=False))
        passes += single
    return {"passes": passes, "kv": llm.collective_rpc(inspect_worker)[0]}


if __name__ == "__main__":
    from result_out import emit

    emit(main(json.loads(sys.argv[1])))
