"""vLLM 0.32 with upstream's ``OffloadingConnector`` on the CPU platform
(the overlay's worker, patch OF32-01), printed as JSON.

Passes over prompts of 1 to 5 blocks: cold; then, after the device prefix
cache is emptied (``reset_prefix_cache``), the prompts as one batch, loaded
back from host memory; then each prompt alone, the cache emptied before
each.  ``{"connector": false}``: stock vLLM 0.32 instead, whose later
passes hit its own device prefix cache (the reference: same hit lengths).
Also reported: the worker's copy calls and blocks per direction, and the
KV cache layout.

    python run_offload.py '{"connector": true}'   # env: VLLM_KV_CACHE_LAYOUT
"""

from __future__ import annotations

import json
import os
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "e2e"))
from result_out import records  # noqa: E402
from run_llm import prompts  # noqa: E402

from vllm_overlay.demo import cpu_defaults, tiny_model_path  # noqa: E402

CPU_BYTES = 64 * 2**20  # host memory for offloaded KV


def worker_info(worker) -> dict:
    from vllm.distributed.kv_transfer import (
        get_kv_transfer_group,
        has_kv_transfer_group,
    )

    info = {
        "layout": worker.model_runner.cache_config.get_resolved_kv_cache_layout().name
    }
    if not has_kv_transfer_group():
        return info
    offload = get_kv_transfer_group().connector_worker.worker
    info.update(
        worker=type(offload).__name__,
        copies=dict(offload.copies),
        blocks=dict(offload.blocks),
        runs_per_block=offload.table.runs_per_block,
        block_bytes=offload.table.block_bytes,
    )
    return info


def main(config: dict) -> dict:
    cpu_defaults()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # collective_rpc fn
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    kv = None
    if config.get("connector"):
        kv = KVTransferConfig(
            kv_connector="OffloadingConnector",
            kv_role="kv_both",
            kv_connector_extra_config={"cpu_bytes_to_use": CPU_BYTES},
        )
    llm = LLM(
        model=tiny_model_path(),
        dtype="float32",
        max_model_len=1024,
        num_gpu_blocks_override=48,
        enforce_eager=True,
        seed=0,
        kv_transfer_config=kv,
    )
    params = SamplingParams(temperature=0.0, max_tokens=16, logprobs=1)

    def run(batch: list[str] | None = None) -> list[dict]:
        return records(llm.generate(batch or prompts(), params, use_tqdm=False))

    def reset() -> bool | None:
        if kv is None:
            return None  # stock: the next pass hits the device prefix cache
        # Stores finish asynchronously; a few more steps let them complete
        # and free their blocks, so the reset really empties the cache.
        for _ in range(3):
            llm.generate(["flush"], SamplingParams(max_tokens=1), use_tqdm=False)
            if llm.reset_prefix_cache():
                return True
        return False

    first = run()
    after_first = llm.collective_rpc(worker_info)[0]
    resets = [reset()]
    batch = run()  # a batch: requests wait for their loads
    single = []  # one request at a time: stock's schedule
    for text in prompts():
        resets.append(reset())
        single += run([text])
    return {
        "passes": [first, batch, single],
        "resets": resets,
        "after_first": after_first,
        "after": llm.collective_rpc(worker_info)[0],
    }


if __name__ == "__main__":
    from result_out import emit

    emit(main(json.loads(sys.argv[1])))
