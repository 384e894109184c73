"""One vLLM 0.11.2 "node" with MultiConnector(OverlayOffloadingConnector,
SharedKVPoolConnector): host memory first, the shared pool second; prints
JSON.

    python run_multi.py '{"url": "redis://127.0.0.1:6379"}'

Config: ``url`` (the pool), ``namespace``, ``pool_options`` (more pool
options), ``num_cpu_blocks`` (host pool size, default 16).

Steps: the prompts of run_pool.py one at a time (pass 0: computed, or
loaded from the pool when another node stored them); a short request so
every store lands; a prefix cache reset (the device KV is gone, host memory
and the pool keep the blocks); the same prompts again (pass 1: served from
host memory).  After each pass, each connector's worker-side totals.
"""

from __future__ import annotations

import json
import sys

from result_out import records
from run_pool import prompts

from vllm_overlay.testing import cpu_defaults, in_process_engine, tiny_engine_args
from vllm_overlay.testing.v0_11_2 import TEST_POOL_OPTIONS, multi_connector


def connector_totals(worker) -> dict:
    """Runs in the worker: each connector's totals (pool drained first)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    multi = get_kv_transfer_group()
    offload, pool = multi._connectors
    pool.pool.drain()
    return {
        "connector": type(multi).__name__,
        "cross_layer": worker.model_runner.cross_layers_kv_cache is not None,
        "host": offload.connector_worker.handler.cumulative(),
        "pool": pool.pool.cumulative(),
    }


def main(config: dict) -> dict:
    cpu_defaults()
    in_process_engine()
    from vllm import LLM, SamplingParams

    pool_options = {
        "url": config["url"],
        "namespace": config.get("namespace", "test"),
        **TEST_POOL_OPTIONS,
        **config.get("pool_options", {}),
    }
    kv_transfer_config = multi_connector(
        {"num_cpu_blocks": config.get("num_cpu_blocks", 16)}, pool_options
    )
    llm = LLM(**tiny_engine_args(kv_transfer_config=kv_transfer_config))
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    params = SamplingParams(temperature=0.0, max_tokens=12, logprobs=1)

    def run() -> list[dict]:
        # One request at a time: the schedule of stock's reference
        # (run_pool.py), so outputs must match it bit for bit.
        outs = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts("shared")]
        return records(outs)

    def settle() -> dict:
        # A short request (no full block) runs the steps that finish the
        # stores and free the blocks; then every block must be free.
        llm.generate(["hello"], SamplingParams(max_tokens=2), use_tqdm=False)
        freed = scheduler.reset_prefix_cache()
        return {"all_blocks_freed": freed, **llm.collective_rpc(connector_totals)[0]}

    passes, totals = [], []
    for _ in range(2):
        passes.append(run())
        totals.append(settle())
    pool = scheduler.connector._connectors[1]
    return {
        "passes": passes,
        "totals": totals,
        "scheduler_pool": pool.pool.cumulative(),
        "namespace": pool.ns.hex(),
    }


if __name__ == "__main__":
    from result_out import emit

    emit(main(json.loads(sys.argv[1])))
