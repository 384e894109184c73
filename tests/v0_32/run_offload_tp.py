"""vLLM 0.32 with upstream's ``OffloadingConnector`` on the CPU platform at
tensor parallel size 2 (two worker processes, each with its own CPU
offloading worker and its half of the KV heads), printed as JSON.

Worker 1's store copies fail on every attempt and worker 0's are held
back (``"delay_s"``) before they copy, so a store job's failure (from
worker 1) reaches the scheduler steps before its completion (from worker
0).  The prompts are computed (cold), the engine steps until every store
job completed, the faults are disarmed, the device prefix cache is
emptied, and the prompts are generated again (a batch, as before).

The result: each pass's tokens and hit lengths (``cached_tokens``), the
stores the host manager completed (``complete_store`` calls, by
``success``), the chunks it holds, the jobs whose failure and completion
reached the scheduler in different steps (``split_jobs``), and per worker
its failed and moved blocks (``workers``).

    python run_offload_tp.py '{"delay_s": 0.5}'
"""

from __future__ import annotations

import json
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "e2e"))
from result_out import records  # noqa: E402
from run_llm import prompts  # noqa: E402

from vllm_overlay.testing import (  # noqa: E402
    cpu_defaults,
    in_process_engine,
    tiny_engine_args,
)
from vllm_overlay.testing.v0_32 import offload_connector  # noqa: E402

FLUSH_DEADLINE_S = 120.0  # every store job completes well within this
WORKERS = 2  # tensor parallel size
FAILED = 1 << 20  # OF32-04's mark in a failed store's count


def arm(worker, delay_s: float, on: bool) -> dict:
    """Runs in each worker (``collective_rpc``): on rank 1 every store copy
    attempt raises, on rank 0 each store copy waits ``delay_s`` first
    (``on`` False: both as they were).  The worker's counters."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    offload = get_kv_transfer_group().connector_worker.worker
    rank = get_tensor_model_parallel_rank()
    cls = type(offload)
    move = cls.__dict__.get("_overlay_test_move", cls._move)
    cls._overlay_test_move = move

    def faulty(self, kind, ids, rows):
        if kind == "store" and rank == 1:
            raise RuntimeError("injected: worker 1's store copy failed")
        if kind == "store" and rank == 0:
            time.sleep(delay_s)
        return move(self, kind, ids, rows)

    cls._move = faulty if on else move
    return {
        "rank": rank,
        "failed": dict(offload.failed),
        "blocks": dict(offload.blocks),
    }


def generate(llm, texts: list[str]) -> list[dict]:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=16, logprobs=1)
    return records(llm.generate(texts, params, use_tqdm=False))


def watch(side) -> dict:
    """Records, per step, the store jobs reported failed and completed, and
    the host manager's ``complete_store`` calls by success."""
    seen = {"failed_step": {}, "done_step": {}, "steps": 0, "stores": []}
    counts: dict[int, int] = {}  # job -> workers that reported it so far
    update = side.update_connector_output  # the patched method (bound)

    def recording(output):
        meta = output.kv_connector_worker_meta
        step = seen["steps"] = seen["steps"] + 1
        for job_id, count in dict(getattr(meta, "completed_jobs", {})).items():
            if count >= FAILED:
                seen["failed_step"].setdefault(job_id, step)
            counts[job_id] = counts.get(job_id, 0) + count % FAILED
            if counts[job_id] == WORKERS:
                seen["done_step"][job_id] = step
        return update(output)

    side.update_connector_output = recording
    manager_cls = type(side.manager)
    complete_store = manager_cls.complete_store

    def counting(manager, keys, req_context, success=True):
        seen["stores"].append(bool(success))
        return complete_store(manager, keys, req_context, success=success)

    manager_cls.complete_store = counting
    return seen


def main(config: dict) -> dict:
    cpu_defaults()
    in_process_engine()  # the scheduler here; two worker processes
    from vllm import LLM, SamplingParams

    llm = LLM(
        **tiny_engine_args(
            kv_transfer_config=offload_connector(),
            tensor_parallel_size=WORKERS,
            distributed_executor_backend="mp",
        )
    )
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    side = scheduler.connector.connector_scheduler
    seen = watch(side)
    delay = float(config.get("delay_s", 0.5))
    out = {"armed": llm.collective_rpc(arm, args=(delay, True))}
    out["first"] = generate(llm, prompts())
    deadline = time.monotonic() + FLUSH_DEADLINE_S
    flush = SamplingParams(max_tokens=4)
    while side._jobs and time.monotonic() < deadline:
        llm.generate(["flush"], flush, use_tqdm=False)
    out["jobs_left"] = len(side._jobs)
    out["workers"] = sorted(
        llm.collective_rpc(arm, args=(0.0, False)), key=lambda w: w["rank"]
    )
    out["stores"] = {
        "ok": seen["stores"].count(True),
        "failed": seen["stores"].count(False),
    }
    out["stored_chunks"] = side.manager._num_evictable_cache_chunks
    out["split_jobs"] = sorted(
        job
        for job, step in seen["failed_step"].items()
        if seen["done_step"].get(job, step) > step
    )
    out["reset"] = llm.reset_prefix_cache()
    out["again"] = generate(llm, prompts())
    out["after"] = sorted(
        llm.collective_rpc(arm, args=(0.0, False)), key=lambda w: w["rank"]
    )
    return out


if __name__ == "__main__":
    from result_out import emit

    emit(main(json.loads(sys.argv[1])))
