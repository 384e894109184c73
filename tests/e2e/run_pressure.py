"""Many async KV loads at once into a small device KV cache; prints JSON.

    python run_pressure.py '{"connector": "offload" | "pool" | null, ...}'

Config: ``connector`` (null: stock run, one pass), ``url`` (pool),
``gpu_blocks`` (device KV blocks of 128 tokens), ``prompts`` (how many).

Pass 1 computes the prompts (their full blocks are offloaded or written to
the pool); the prefix cache is then reset, and pass 2 submits every prompt
at once: each one hits 2 blocks outside the device, far more than fit
together.  The engine is stepped by hand; if nothing progresses for
``stall_s`` seconds the run reports ``stalled`` with the scheduler's state
instead of hanging (stock 0.11.2 stalls here).  Reported: the outputs of
each pass, connector totals, and how often the overlay's scheduler patches
acted (deferred admissions, reorders, resumes after a load).
"""

from __future__ import annotations

import json
import sys
import time

from prompt_words import WORDS

from vllm_overlay.testing import cpu_defaults, in_process_engine, tiny_engine_args
from vllm_overlay.testing.v0_11_2 import offload_connector, pool_connector

PRESSURE_WORDS = [*WORDS, "eight", "ocean", "light"]


def prompt(i: int) -> str:
    words = PRESSURE_WORDS
    return " ".join(words[(j * (i + 3) + i) % len(words)] for j in range(320))


def connector_totals(worker) -> dict:
    from vllm.distributed.kv_transfer import (
        get_kv_transfer_group,
        has_kv_transfer_group,
    )

    if not has_kv_transfer_group():
        return {}
    connector = get_kv_transfer_group()
    if hasattr(connector, "pool"):
        connector.pool.drain()
        totals = connector.pool.cumulative()
    else:
        totals = connector.connector_worker.handler.cumulative()
    return {**totals, "connector_module": type(connector).__module__}


def record_schedule(scheduler) -> list[str]:
    """Record what the scheduler decides at each step, as one line: the new
    requests (with their computed tokens: a prefix hit or load), the resumed
    ones, the tokens scheduled per request, and the waiting queue after the
    step (id:status).  Both ways of a patch (the runtime overlay, the patched
    tree) must give the same lines."""
    trace: list[str] = []
    schedule = scheduler.schedule

    def recorded():
        out = schedule()
        new = [f"{r.req_id}@{r.num_computed_tokens}" for r in out.scheduled_new_reqs]
        resumed = sorted(out.scheduled_cached_reqs.resumed_req_ids)
        tokens = [f"{k}+{v}" for k, v in sorted(out.num_scheduled_tokens.items())]
        waiting = [f"{r.request_id}:{r.status.name}" for r in scheduler.waiting]
        trace.append(
            f"new={','.join(new)} resumed={','.join(resumed)} "
            f"tokens={','.join(tokens)} waiting={','.join(waiting)}"
        )
        return out

    scheduler.schedule = recorded
    return trace


def step_all(llm, prompts, params, stall_s: float) -> dict:
    """Submit every prompt at once and step until done or stalled."""
    engine = llm.llm_engine
    scheduler = engine.engine_core.engine_core.scheduler
    trace = record_schedule(scheduler)
    for i, text in enumerate(prompts):
        engine.add_request(f"p{i}", text, params)
    outputs, last_change, last_sig, steps = {}, time.monotonic(), None, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out
        steps += 1
        sig = (
            len(outputs),
            sum(
                r.num_computed_tokens + r.num_output_tokens
                for r in scheduler.requests.values()
            ),
        )
        if sig != last_sig:
            last_sig, last_change = sig, time.monotonic()
        elif time.monotonic() - last_change > stall_s:
            del scheduler.schedule
            return {
                "stalled": True,
                "steps": steps,
                "trace": trace,
                "state": {
                    "running": len(scheduler.running),
                    "waiting": [str(r.status) for r in scheduler.waiting],
                    "free_blocks": (
                        scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
                    ),
                },
            }
    del scheduler.schedule  # the class's again
    return {
        "stalled": False,
        "steps": steps,
        "trace": trace,
        "outputs": [summary(outputs[f"p{i}"]) for i in range(len(prompts))],
    }


def summary(out) -> dict:
    completion = out.outputs[0]
    return {
        "tokens": list(completion.token_ids),
        "logprobs": [
            lp[t].logprob for lp, t in zip(completion.logprobs, completion.token_ids)
        ],
    }


def main(config: dict) -> dict:
    cpu_defaults()
    in_process_engine(rpc=False)
    from vllm import LLM, SamplingParams

    kv_transfer_config = None
    if config.get("connector") == "offload":
        # vLLM's tree with patches/ applied names it CrossLayer...
        kv_transfer_config = offload_connector(
            config.get("name", "OverlayOffloadingConnector"), num_cpu_blocks=64
        )
    elif config.get("connector") == "pool":
        kv_transfer_config = pool_connector(config["url"], "pressure")
    llm = LLM(
        **tiny_engine_args(
            max_model_len=512,
            num_gpu_blocks_override=config.get("gpu_blocks", 10),
            disable_log_stats=True,
            kv_transfer_config=kv_transfer_config,
        )
    )
    # 320 prompt tokens and 80 generated: the decode crosses into a 4th
    # block, so running requests preempt each other as well.
    params = SamplingParams(temperature=0.0, max_tokens=80, ignore_eos=True, logprobs=1)
    prompts = [prompt(i) for i in range(config.get("prompts", 8))]
    stall_s = config.get("stall_s", 20.0)
    passes = [step_all(llm, prompts, params, stall_s)]
    result = {"passes": passes}
    if kv_transfer_config is None or passes[0]["stalled"]:
        return result
    llm.generate(["flush"], SamplingParams(max_tokens=1), use_tqdm=False)
    result["after_first"] = llm.collective_rpc(connector_totals)[0]
    llm.reset_prefix_cache()
    passes.append(step_all(llm, prompts, params, stall_s))
    result["totals"] = llm.collective_rpc(connector_totals)[0]
    core = llm.llm_engine.engine_core.engine_core
    manager = core.scheduler.kv_cache_manager
    result["overlay"] = {
        **manager.__dict__.get("vllm_overlay_admission", {}),
        "reordered": getattr(core.scheduler, "vllm_overlay_reordered", 0),
        "resumed_after_load": getattr(
            core.scheduler, "vllm_overlay_resumed_after_load", 0
        ),
    }
    return result


if __name__ == "__main__":
    from result_out import emit

    emit(main(json.loads(sys.argv[1])))
