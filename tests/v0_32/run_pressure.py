"""Async KV loads under KV pressure on vLLM 0.32 (vLLM PR #57841's setting):
upstream's ``OffloadingConnector`` on the CPU platform (patch OF32-01),
a few device blocks, FCFS; prints JSON.

    python run_pressure.py '{"connector": true, "order": "A0,D0,A1,F0,F1"}'

Requests are token-id prompts named by kind: ``A<i>`` has a prefix in host
memory (stored by a warm pass, then the device prefix cache is emptied), so
it is admitted as an async load; ``D<i>`` shares A<i>'s host prefix, so the
connector answers "not yet" (None) while A<i>'s load is in flight and it
waits holding no blocks (#57841's step 1); ``F<i>`` has no hit and is
admitted at once, taking the blocks the loads still need.  They are
submitted together, in ``order``, and the engine is stepped by hand; no
progress (finished requests, computed and output tokens) for
``stall_steps`` steps and ``stall_s`` seconds ends the run as ``stalled``,
with every request's state.

Recorded while it runs: each time the scheduler fails to allocate for a
request whose load has finished (at the head of ``kv_holding_waiting``:
held blocks, free blocks, what runs), each time a request holding no
blocks fails to allocate while loads hold blocks (#57841's step 3), the
connector's deferrals, the requests admitted as async loads.  After it:
the tokens, the blocks loaded by the worker, and the free device blocks
once everything is done.
``{"connector": false}``: stock 0.32, same passes (the reference tokens).
``pause_at_step``: the scheduler is paused there for good (the stall bound's
own check).
"""

from __future__ import annotations

import json
import os
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "e2e"))  # result_out

from vllm_overlay.testing import cpu_defaults, tiny_engine_args  # noqa: E402
from vllm_overlay.testing.v0_32 import connector_info as worker_info  # noqa: E402
from vllm_overlay.testing.v0_32 import offload_connector  # noqa: E402

DEFAULTS = {
    "gpu_blocks": 12,  # 11 usable (block 0 is vLLM's null block)
    "order": "A0,D0,A1,F0,F1,F2",
    "a_tokens": 700,  # A<i>: 6 blocks of 128, the first `a_host_blocks` loaded
    "a_host_blocks": 3,
    "d_tokens": 600,
    "f_tokens": 400,  # F<i>: 4 blocks, no hit
    "max_tokens": 48,  # fillers stay within their 4 blocks
    "max_num_seqs": 8,
    "max_num_batched_tokens": 2048,
    "chunked": True,
    "max_model_len": 1024,
    "stall_steps": 200,
    "stall_s": 20.0,
}


def tokens(seed: int, n: int) -> list[int]:
    """Deterministic token ids (vocabulary 512; 0-2 left out)."""
    return [(seed * 977 + i * 31 + (i * i) % 13) % 509 + 3 for i in range(n)]


def prompt_ids(name: str, cfg: dict, block: int) -> list[int]:
    kind, i = name[0], int(name[1:])
    if kind == "A":
        return tokens(100 + i, cfg["a_tokens"])
    if kind == "D":  # A<i>'s host prefix, then its own tokens
        host = tokens(100 + i, cfg["a_host_blocks"] * block)
        return host + tokens(300 + i, cfg["d_tokens"] - len(host))
    if kind == "F":
        return tokens(200 + i, cfg["f_tokens"])
    raise ValueError(f"request kind {kind!r}: A, D or F")


def short(req_id: str) -> str:
    return req_id.split("-")[0]


class Probe:
    """Watches the scheduler in place (instance attributes, so the class,
    and any overlay patch of it, is untouched)."""

    def __init__(self, sched) -> None:
        from vllm.v1.request import RequestStatus

        self.sched = sched
        self.step = 0
        self.blocked_heads: list[dict] = []  # load done, could not allocate
        # A request holding no blocks could not allocate while loads held some
        self.blockless_failures: list[dict] = []
        self.deferrals: dict[str, list[int]] = {}  # steps the connector said None
        self.async_admitted: dict[str, int] = {}  # step of each async admission
        manager = sched.kv_cache_manager
        allocate = manager.allocate_slots
        waiting = (RequestStatus.WAITING, RequestStatus.PREEMPTED)

        def allocate_slots(request, *args, **kwargs):
            blocks = allocate(request, *args, **kwargs)
            if blocks is None and request.status in waiting:
                state = self.state(request)
                if request.num_computed_tokens > 0:  # its load has landed
                    self.blocked_heads.append(state)
                elif state["holders"]:  # #57841's step 3
                    self.blockless_failures.append(state)
            return blocks

        manager.allocate_slots = allocate_slots
        if sched.connector is not None:
            lookup = sched.connector.get_num_new_matched_tokens

            def matched(request, *args, **kwargs):
                hit, is_async = lookup(request, *args, **kwargs)
                if hit is None:
                    rid = short(request.request_id)
                    self.deferrals.setdefault(rid, []).append(self.step)
                return hit, is_async

            sched.connector.get_num_new_matched_tokens = matched

    def held(self, request_id: str) -> int:
        manager = self.sched.kv_cache_manager
        return sum(
            len(m.req_to_blocks.get(request_id, ()))
            for m in manager.coordinator.single_type_managers
        )

    def state(self, request) -> dict:
        sched = self.sched
        head = (
            sched.kv_holding_waiting.peek_request()
            if sched.kv_holding_waiting
            else None
        )
        return {
            "step": self.step,
            "request": short(request.request_id),
            "at_head": head is request,
            "held": self.held(request.request_id),
            "computed": request.num_computed_tokens,
            "prompt": request.num_prompt_tokens,
            "free": sched.kv_cache_manager.block_pool.get_num_free_blocks(),
            "running": [short(r.request_id) for r in sched.running],
            "running_held": sum(self.held(r.request_id) for r in sched.running),
            "holders": self.holders(),
        }

    def holders(self) -> dict[str, int]:
        """Blocks held by requests that do not run (async loads)."""
        running = {id(r) for r in self.sched.running}
        held = {
            short(r.request_id): self.held(r.request_id)
            for r in self.sched.requests.values()
            if id(r) not in running
        }
        return {rid: n for rid, n in held.items() if n}

    def after_step(self) -> None:
        from vllm.v1.request import RequestStatus

        for r in self.sched.kv_holding_waiting:
            rid = short(r.request_id)
            if (
                r.status == RequestStatus.WAITING_FOR_REMOTE_KVS
                and rid not in self.async_admitted
            ):
                self.async_admitted[rid] = self.step
        self.step += 1

    def requests(self) -> list[dict]:
        sched = self.sched
        where = {id(r): "running" for r in sched.running}
        where.update({id(r): "waiting" for r in sched.waiting})
        where.update({id(r): "kv_holding_waiting" for r in sched.kv_holding_waiting})
        return [
            {
                "request": short(r.request_id),
                "status": r.status.name,
                "queue": where.get(id(r), "none"),
                "computed": r.num_computed_tokens,
                "outputs": r.num_output_tokens,
                "held": self.held(r.request_id),
            }
            for r in sched.requests.values()
        ]


def step_all(llm, cfg: dict, block: int) -> dict:
    """Submit every request of ``order`` at once; step until done or
    stalled (never longer than the stall bound past the last progress).
    ``pause_at_step``: pause the scheduler there (``PAUSED_ALL``: nothing
    is scheduled again), which the stall bound must catch."""
    from vllm import SamplingParams
    from vllm.v1.core.sched.interface import PauseState

    engine = llm.llm_engine
    sched = engine.engine_core.engine_core.scheduler
    probe = Probe(sched)
    params = SamplingParams(
        temperature=0.0, max_tokens=cfg["max_tokens"], ignore_eos=True
    )
    names = cfg["order"].split(",")
    for name in names:
        engine.add_request(
            name, {"prompt_token_ids": prompt_ids(name, cfg, block)}, params
        )
    outputs: dict[str, list[int]] = {}
    last_sig, last_change, still = None, time.monotonic(), 0
    stalled = False
    while engine.has_unfinished_requests():
        if probe.step == cfg.get("pause_at_step"):
            sched.set_pause_state(PauseState.PAUSED_ALL)
        for out in engine.step():
            if out.finished:
                outputs[short(out.request_id)] = list(out.outputs[0].token_ids)
        probe.after_step()
        sig = (
            len(outputs),
            sum(
                r.num_computed_tokens + r.num_output_tokens
                for r in sched.requests.values()
            ),
        )
        if sig != last_sig:
            last_sig, last_change, still = sig, time.monotonic(), 0
            continue
        still += 1
        if (
            still >= cfg["stall_steps"]
            and time.monotonic() - last_change > cfg["stall_s"]
        ):
            stalled = True
            break
    report = {
        "stalled": stalled,
        "steps": probe.step,
        "still_steps": still,
        "blocked_heads": probe.blocked_heads,
        "blockless_failures": probe.blockless_failures,
        "deferrals": probe.deferrals,
        "async_admitted": probe.async_admitted,
    }
    if stalled:  # every request's state, as the deadlock left it
        report["requests"] = probe.requests()
        report["free"] = sched.kv_cache_manager.block_pool.get_num_free_blocks()
    else:
        report["tokens"] = {name: outputs[name] for name in names}
    return report


def flush(llm) -> None:
    """A few one-token steps, so stores finish and free their blocks."""
    from vllm import SamplingParams

    for _ in range(3):
        llm.generate(
            [{"prompt_token_ids": [5, 6, 7]}],
            SamplingParams(max_tokens=1),
            use_tqdm=False,
        )


def main(config: dict) -> dict:
    cfg = {**DEFAULTS, **config}
    cpu_defaults()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # collective_rpc fn
    from vllm import LLM, SamplingParams

    llm = LLM(
        **tiny_engine_args(
            max_model_len=cfg["max_model_len"],
            num_gpu_blocks_override=cfg["gpu_blocks"],
            max_num_seqs=cfg["max_num_seqs"],
            max_num_batched_tokens=cfg["max_num_batched_tokens"],
            enable_chunked_prefill=cfg["chunked"],
            disable_log_stats=True,
            kv_transfer_config=offload_connector() if cfg.get("connector") else None,
        )
    )
    core = llm.llm_engine.engine_core.engine_core
    block = core.vllm_config.cache_config.block_size
    pool = core.scheduler.kv_cache_manager.block_pool
    # Warm pass: the A<i> prefixes to host memory (stock: computed only).
    warm = sorted({n for n in cfg["order"].split(",") if n[0] == "A"})
    llm.generate(
        [
            {
                "prompt_token_ids": prompt_ids(n, cfg, block)[
                    : cfg["a_host_blocks"] * block
                ]
            }
            for n in warm
        ],
        SamplingParams(max_tokens=1),
        use_tqdm=False,
    )
    flush(llm)
    emptied = llm.reset_prefix_cache()
    result = {"block_size": block, "reset": emptied, "config": cfg}
    result["pressure"] = step_all(llm, cfg, block)
    if result["pressure"]["stalled"]:
        return result
    flush(llm)
    result["free_after"] = pool.get_num_free_blocks()
    result["usable_blocks"] = pool.num_gpu_blocks - 1  # the null block
    result["unfinished"] = core.scheduler.get_num_unfinished_requests()
    result["worker"] = llm.collective_rpc(worker_info)[0]
    return result


if __name__ == "__main__":
    from result_out import emit

    emit(main(json.loads(sys.argv[1])))
