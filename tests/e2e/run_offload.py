"""Offload-and-reload scenario on real vLLM (CPU build); prints JSON.

    python run_offload.py '{"connector": "offload", ...}'

Config: ``connector`` ("offload" | null for stock), ``block_factor``
(offloaded block = N cache blocks), ``corrupt`` (zero the host pool before
the reload), ``unaligned`` (before the reload, compute the first cache block
again so the device prefix hit is not aligned to the offloaded block),
``method`` (transfer_method), ``seeded`` (sample with temperature 1 and
a per-request seed instead of greedy), ``multiprocess`` (EngineCore in its own
process, with vLLM's stat logging on), ``keep_device_cache`` (skip the
reset: the second pass is served from vLLM's own device prefix cache; with
the overlay disabled this is the bit-exact reference for a reload, since it
has the same hit length and the same schedule).

Steps: generate the prompts; flush; reset the prefix cache (device KV is
gone, the host pool keeps the offloaded blocks); optionally corrupt or
prepare an unaligned hit; generate the same prompts again.
"""

from __future__ import annotations

import json
import os
import sys

from prompt_words import WORDS
from result_out import records

from vllm_overlay.testing import cpu_defaults, tiny_engine_args
from vllm_overlay.testing.v0_11_2 import offload_connector


def prompt(n_words: int, shift: int) -> str:
    return " ".join(WORDS[(i * 7 + shift) % len(WORDS)] for i in range(n_words))


def handler_info(worker, corrupt: bool = False) -> dict:
    from vllm.distributed.kv_transfer import (
        get_kv_transfer_group,
        has_kv_transfer_group,
    )

    if not has_kv_transfer_group():
        return {}
    handler = get_kv_transfer_group().connector_worker.handler
    if corrupt:
        handler.mover.host.zero_()
    return {
        "totals": handler.cumulative(),
        "runs_per_block": handler.mover.table.runs_per_block,
        "method": handler.mover.method,
        "cross_layer": worker.model_runner.cross_layers_kv_cache is not None,
    }


def main(config: dict) -> dict:
    cpu_defaults()
    multiprocess = config.get("multiprocess", False)
    if multiprocess:  # vLLM's default; its stat logger needs it
        os.environ.setdefault("VLLM_LOG_STATS_INTERVAL", "0.01")
    else:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    from vllm import LLM, SamplingParams

    kv_transfer_config = None
    if config.get("connector") == "offload":
        extra = {
            "num_cpu_blocks": 16,
            "block_size": 128 * config.get("block_factor", 1),
        }
        if "method" in config:
            extra["transfer_method"] = config["method"]
        kv_transfer_config = offload_connector(**extra)
    llm = LLM(
        **tiny_engine_args(
            dtype=config.get("dtype", "float32"),
            disable_log_stats=not multiprocess,
            kv_transfer_config=kv_transfer_config,
        )
    )
    if config.get("seeded"):  # random sampling, reproducible per request
        params = SamplingParams(
            temperature=1.0, top_p=0.9, seed=1234, max_tokens=16, logprobs=1
        )
    else:
        params = SamplingParams(temperature=0.0, max_tokens=16, logprobs=1)
    prompts = [prompt(620, 0), prompt(330, 3)]

    def run() -> list[dict]:
        outs = llm.generate(prompts, params, use_tqdm=False)
        return records(outs)

    first = run()
    # Stores finish asynchronously; one more step lets them complete and
    # frees the blocks, so the reset really empties the device cache.
    llm.generate(["flush"], SamplingParams(max_tokens=1), use_tqdm=False)
    if not config.get("keep_device_cache"):
        llm.reset_prefix_cache()
    after_first = llm.collective_rpc(
        handler_info, args=(config.get("corrupt", False),)
    )[0]
    if config.get("unaligned"):
        # Recompute (and cache on the device) only the first cache block.
        tokenizer = llm.get_tokenizer()
        ids = tokenizer(prompts[0])["input_ids"][:130]
        llm.generate(
            {"prompt_token_ids": ids}, SamplingParams(max_tokens=1), use_tqdm=False
        )
    second = run()
    info = llm.collective_rpc(handler_info)[0]
    return {"passes": [first, second], "after_first": after_first, **info}


if __name__ == "__main__":
    from result_out import emit

    emit(main(json.loads(sys.argv[1])))
