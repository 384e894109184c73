"""A KV connector under pipeline parallelism on real vLLM (CPU build);
prints JSON.

    VLLM_PP_LAYER_PARTITION=1,3 python run_pp_connectors.py '{"connector": "offload"}'

Config: ``connector`` ("offload" | "pool" | null for stock), ``url`` (the
pool), ``cpu_bytes`` (the host pool), ``keep_device_cache`` (never reset
the prefix cache: each reload phase is then served from vLLM's own device
prefix cache; with the overlay disabled this is the reference).  PP=2
(``mp`` executor, EngineCore in this process so that batches form the same
way in every run); ``VLLM_PP_LAYER_PARTITION`` comes from the environment.

Phases, one engine:

* ``pressure``: 12 prompts of ~300 tokens in one batch, two full blocks
  each: more blocks than the host pool holds (it evicts).
* ``cold``: 3 other prompts (4, 3 and 2 full blocks) in one batch; their
  blocks are stored.
* reset the device prefix cache (unless ``keep_device_cache``).
* ``reload_batch``: the ``cold`` prompts again, in one batch: loaded back.
* reset again.
* ``reload_single``: the ``cold`` prompts again, one request at a time:
  loaded back, each with the schedule of a device prefix hit.
"""

from __future__ import annotations

import json
import random
import sys

from prompt_words import WORDS

from vllm_overlay.testing import cpu_defaults, in_process_engine, tiny_engine_args
from vllm_overlay.testing.v0_11_2 import offload_connector, pool_connector

PRESSURE_WORDS = [300] * 12
COLD_WORDS = [530, 400, 270]


def prompt(n_words: int, seed: int) -> str:
    return " ".join(random.Random(seed).choices(WORDS, k=n_words))


def worker_offload(worker) -> dict:
    from vllm.distributed.kv_transfer import get_kv_transfer_group
    from vllm.distributed.parallel_state import get_pp_group

    handler = get_kv_transfer_group().connector_worker.handler
    return {
        "pp_rank": get_pp_group().rank_in_group,
        "host_blocks": handler.mover.host.shape[0] // handler.factor,
        "host_bytes": handler.mover.host_bytes,
        "block_bytes": handler.mover.table.block_bytes * handler.factor,
        "totals": handler.cumulative(),
    }


def worker_pool(worker) -> dict:
    from vllm.distributed.kv_transfer import get_kv_transfer_group
    from vllm.distributed.parallel_state import get_pp_group

    pool = get_kv_transfer_group().pool
    pool.drain()
    return {"pp_rank": get_pp_group().rank_in_group, **pool.cumulative()}


def main(config: dict) -> dict:
    cpu_defaults()
    in_process_engine()
    from vllm import LLM, SamplingParams

    connector = config.get("connector")
    kv_transfer_config = None
    if connector == "offload":
        kv_transfer_config = offload_connector(cpu_bytes=config["cpu_bytes"])
    elif connector == "pool":
        # A lookup starved of CPU on a loaded 2-core runner must not turn a
        # hit into a recompute.
        kv_transfer_config = pool_connector(
            config["url"], "pp", timeout_s=2.0, lookup_wait_s=2.0
        )
    llm = LLM(
        **tiny_engine_args(
            num_gpu_blocks_override=None,
            pipeline_parallel_size=2,
            distributed_executor_backend="mp",
            kv_transfer_config=kv_transfer_config,
        )
    )
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=1)

    def results(outs) -> list[dict]:
        from result_out import records

        return [
            {"prompt_tokens": len(o.prompt_token_ids), **r}
            for o, r in zip(outs, records(outs))
        ]

    def batch(prompts: list[str]) -> list[dict]:
        return results(llm.generate(prompts, params, use_tqdm=False))

    def settle() -> None:
        """Let stores finish (their blocks are freed a step later) and, with
        the pool, land in the server; then reset the prefix cache."""
        for _ in range(3):
            llm.generate(["flush"], SamplingParams(max_tokens=1), use_tqdm=False)
        if connector == "pool":
            llm.collective_rpc(worker_pool)
        if not config.get("keep_device_cache"):
            assert scheduler.reset_prefix_cache(), "blocks still held"

    pressure = [prompt(n, 100 + i) for i, n in enumerate(PRESSURE_WORDS)]
    cold = [prompt(n, 200 + i) for i, n in enumerate(COLD_WORDS)]
    phases = {"pressure": batch(pressure), "cold": batch(cold)}
    info = {"phase": "cold"}
    if connector == "offload":
        info["workers"] = llm.collective_rpc(worker_offload)
    settle()
    phases["reload_batch"] = batch(cold)
    settle()
    phases["reload_single"] = [batch([p])[0] for p in cold]
    result = {"phases": phases, "after_cold": info}
    if connector == "offload":
        result["workers"] = llm.collective_rpc(worker_offload)
        # The blocks the scheduler hands out, whatever the workers hold.
        manager = scheduler.connector.connector_scheduler.manager
        result["scheduler_host_blocks"] = manager.backend.num_blocks
    elif connector == "pool":
        result["workers"] = llm.collective_rpc(worker_pool)
        result["scheduler"] = scheduler.connector.pool.cumulative()
    return result


if __name__ == "__main__":
    from result_out import emit

    emit(main(json.loads(sys.argv[1])))
