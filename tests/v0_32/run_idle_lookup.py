"""vLLM 0.32 with the pool tier (``TieringOffloadingSpec``: the CPU primary
tier and ``SharedPoolTier`` on a real server): an idle engine whose only
request waits for the tier's lookup wakes when the answer comes.

A fresh engine (empty host memory, empty pool) gets one prompt while the
pool server is stopped (SIGSTOP) for ``hold_s``: the tier answers RETRY,
the request stays ``WAITING`` and the engine waits in its idle wait
(EC32-01, ``core/idle_wait`` with 0.32's gate).  The idle wait is made
``idle_wait_s`` long here (``core/idle_wait.IDLE_WAIT_S``), so a wake-up is told
apart from the wait's end: the answer comes ``hold_s`` after the request,
long before.  Reported: the tokens, the engine's idle waits and wakes
during the request, and its seconds.

    python run_idle_lookup.py '{"pool_url": URL, "server_pid": PID,
                                "hold_s": 0.5, "idle_wait_s": 10.0}'
"""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import signal
import sys
import threading
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


def pool_tier_config(config: dict) -> dict:
    """This folder's run_offload.py's tiering config, the pool tier in it
    (tests/e2e has a run_offload.py too)."""
    path = pathlib.Path(__file__).with_name("run_offload.py")
    spec = importlib.util.spec_from_file_location("run_offload_v0_32", path)
    run_offload = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(run_offload)
    extra = run_offload.extra_config(
        {
            "pool_url": config["pool_url"],
            # The stopped server's lookup is waited for, not given up.
            "pool_options": {"lookup_wait_s": 30.0, "timeout_s": 30.0},
        }
    )
    extra.pop("cpu_bytes_to_use")  # offload_connector sets it
    return extra


def main(config: dict) -> dict:
    cpu_defaults()
    in_process_engine()
    from vllm import LLM, SamplingParams

    from vllm_overlay.core import idle_wait
    from vllm_overlay.integration.v0_32.idle_wait import TRANSFER_DONE

    llm = LLM(
        **tiny_engine_args(
            kv_transfer_config=offload_connector(**pool_tier_config(config))
        )
    )
    engine = llm.llm_engine.engine_core.engine_core
    params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=1)
    idle_wait.IDLE_WAIT_S = config["idle_wait_s"]
    engine.kv_idle_waits = engine.kv_idle_wakes = 0
    pid = config["server_pid"]
    os.kill(pid, signal.SIGSTOP)
    resume = threading.Timer(config["hold_s"], os.kill, (pid, signal.SIGCONT))
    TRANSFER_DONE.clear()
    start = time.monotonic()
    resume.start()
    try:
        again = records(llm.generate([prompts()[-1]], params, use_tqdm=False))
    finally:
        resume.join()
    return {
        "tokens": again[0]["tokens"],
        "idle_waits": engine.kv_idle_waits,
        "idle_wakes": engine.kv_idle_wakes,
        "seconds": time.monotonic() - start,
    }


if __name__ == "__main__":
    from result_out import emit

    emit(main(json.loads(sys.argv[1])))
