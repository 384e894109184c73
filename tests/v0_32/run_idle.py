"""vLLM 0.32, upstream's ``OffloadingConnector`` on CPU: how the engine
steps while its only request waits for a host reload (patches EC32-01/02).

The tiny Llama computes one prompt (stored to host memory), the device
prefix cache is emptied, and the prompt runs again: its blocks come back
from host memory as an async load.  Each load in the worker is held for
``hold_s`` first (a wrapper on this process's CPU offloading worker; the
engine is in-process), so the engine has a known time with nothing to run.
Reported: the tokens of both runs, the second's cached tokens, the
scheduler's steps and the engine's idle waits during the second run, and
the seconds the loads were held.

``"fs_dir": DIR`` (a directory a first engine filled, run_offload.py):
``TieringOffloadingSpec`` with upstream's ``fs`` tier in DIR instead, and
a fresh engine whose host memory is empty: the prompt's blocks are
promoted from the fs tier into host memory, then loaded.  Each of the
tier's promotions is held for ``hold_s`` (its finished jobs are handed to
the scheduler no sooner), so the request waits ``WAITING``: the connector
cannot say yet how many tokens it holds.  Only that run is reported.

    python run_idle.py '{"hold_s": 0.3}'   # env: VLLM_OVERLAY_SKIP_PATCHES
    python run_idle.py '{"hold_s": 0.3, "fs_dir": "/tmp/kv"}'
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


def hold_loads(worker, hold_s: float) -> bool:
    """Runs in the worker (``collective_rpc``): each load first sleeps."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    offload = get_kv_transfer_group().connector_worker.worker
    move = offload._move

    def held(kind, ids, rows):
        if kind == "load":
            time.sleep(hold_s)
        return move(kind, ids, rows)

    offload._move = held
    return True


def hold_promotions(engine, hold_s: float) -> None:
    """The secondary tier's finished jobs reach the scheduler ``hold_s``
    after the tier was given its first load, no sooner."""
    manager = engine.scheduler.connector.connector_scheduler.manager
    (tier,) = manager.secondary_tiers
    submit, finished = tier.submit_load, tier.get_finished_jobs
    since = []

    def submitted(job):
        since.append(time.monotonic())
        return submit(job)

    def held():
        if since and time.monotonic() < since[0] + hold_s:
            return []
        return finished()

    tier.submit_load, tier.get_finished_jobs = submitted, held


def main(config: dict) -> dict:
    cpu_defaults()
    in_process_engine()  # the engine core and worker here; collective_rpc fn
    from vllm import LLM, SamplingParams

    extra = {}
    if config.get("fs_dir"):
        import importlib.util

        # (this folder's run_offload.py; tests/e2e has one of that name too)
        path = pathlib.Path(__file__).with_name("run_offload.py")
        spec = importlib.util.spec_from_file_location("run_offload_v0_32", path)
        run_offload = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(run_offload)
        extra = run_offload.extra_config({"fs_dir": config["fs_dir"]})
        extra.pop("cpu_bytes_to_use")
    llm = LLM(**tiny_engine_args(kv_transfer_config=offload_connector(**extra)))
    engine = llm.llm_engine.engine_core.engine_core
    params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=1)
    prompt = prompts()[-1]
    if config.get("fs_dir"):
        first, reset = None, None
        hold_promotions(engine, config["hold_s"])
    else:
        first = records(llm.generate([prompt], params, use_tqdm=False))
        reset = False
        for _ in range(3):  # stores finish as the engine steps
            llm.generate(["flush"], SamplingParams(max_tokens=1), use_tqdm=False)
            if llm.reset_prefix_cache():
                reset = True
                break
        llm.collective_rpc(hold_loads, args=(config["hold_s"],))
    steps = [0]
    schedule = engine.scheduler.schedule

    def counted(*args, **kwargs):
        steps[0] += 1
        return schedule(*args, **kwargs)

    engine.scheduler.schedule = counted
    engine.kv_idle_waits = 0
    start = time.monotonic()
    again = records(llm.generate([prompt], params, use_tqdm=False))
    return {
        "reset": reset,
        "first": first,
        "again": again,
        "steps": steps[0],
        "idle_waits": engine.kv_idle_waits,
        "seconds": time.monotonic() - start,
    }


if __name__ == "__main__":
    from result_out import emit

    emit(main(json.loads(sys.argv[1])))
