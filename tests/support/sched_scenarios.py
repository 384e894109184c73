"""A real vLLM 0.11.2 Scheduler with the offloading connector, without a
worker, and the KV-pressure scenarios (KV-01..04) as per-step traces.

The host pool is filled through the connector's own manager and load
completions are reported with ModelRunnerOutputs the way the worker reports
them.  Blocks of 16 tokens, 10 device blocks (block 0 is vLLM's null block:
9 usable).  ``tests/unit/test_scheduler_patches.py`` asserts on the runtime
patches with these; ``tests/e2e/run_sched_scenarios.py`` runs every
scenario in the overlay and on vLLM's tree with patches/ applied, and the
two traces must be equal line for line.
"""

from __future__ import annotations

import collections
import time

BLOCK = 16


def build(connector: str = "OverlayOffloadingConnector", extra_config=None):
    """(scheduler factory, request factory) for CONNECTOR's registered
    name (vLLM's patched tree names the overlay's connector differently)
    and its ``kv_connector_extra_config`` (default: 32 host blocks)."""
    import torch
    from vllm.config import (
        CacheConfig,
        KVTransferConfig,
        ModelConfig,
        SchedulerConfig,
        VllmConfig,
    )
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
    )
    from vllm.v1.request import Request
    from vllm.v1.structured_output import StructuredOutputManager

    from vllm_overlay.testing import tiny_model_path

    init_none_hash(sha256)
    hasher = get_request_block_hasher(BLOCK, sha256)

    def scheduler() -> Scheduler:
        cache = CacheConfig(block_size=BLOCK, enable_prefix_caching=True)
        cache.num_gpu_blocks = 10
        config = VllmConfig(
            model_config=ModelConfig(
                model=tiny_model_path(), dtype="float32", max_model_len=256
            ),
            cache_config=cache,
            scheduler_config=SchedulerConfig(
                max_num_seqs=8, max_num_batched_tokens=512, max_model_len=256
            ),
            kv_transfer_config=KVTransferConfig(
                kv_connector=connector,
                kv_role="kv_both",
                kv_connector_extra_config=extra_config or {"num_cpu_blocks": 32},
            ),
        )
        kv_config = KVCacheConfig(
            num_blocks=10,
            kv_cache_tensors=[],
            kv_cache_groups=[
                KVCacheGroupSpec(
                    ["layer.0"],
                    FullAttentionSpec(
                        block_size=BLOCK,
                        num_kv_heads=1,
                        head_size=16,
                        dtype=torch.float32,
                    ),
                )
            ],
        )
        return Scheduler(
            vllm_config=config,
            kv_cache_config=kv_config,
            structured_output_manager=StructuredOutputManager(config),
            block_size=BLOCK,
        )

    def request(rid: str, n_tokens: int, seed: int) -> Request:
        return Request(
            rid,
            [(seed * 131 + i * 7) % 500 + 1 for i in range(n_tokens)],
            SamplingParams(max_tokens=4),
            None,
            eos_token_id=None,
            block_hasher=hasher,
        )

    return scheduler, request


def status(name: str):
    from vllm.v1.request import RequestStatus

    return RequestStatus[name]


def offload(sched, request, n_blocks: int) -> None:
    """Put the request's first blocks in the host pool, as stores do."""
    manager = sched.connector.connector_scheduler.manager
    hashes = request.block_hashes[:n_blocks]
    manager.prepare_store(hashes)
    manager.complete_store(hashes)


def report_loaded(sched, out, *req_ids: str, sending: bool = False) -> None:
    """The worker's report: loads of REQ_IDS done (``sending``: finished
    sending instead, the report that frees a finished request's blocks)."""
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

    done = {"finished_sending" if sending else "finished_recving": set(req_ids)}
    sched.update_from_output(
        out,
        ModelRunnerOutput(
            req_ids=[],
            req_id_to_index={},
            sampled_token_ids=[],
            logprobs=None,
            prompt_logprobs_dict={},
            pooler_output=[],
            kv_connector_output=KVConnectorOutput(**done),
        ),
    )


def parked_load(make):
    """A parked on an async load of 2 blocks (holds 2, needs 3 in all)."""
    scheduler, request = make
    sched = scheduler()
    a = request("A", 40, seed=1)
    offload(sched, a, 2)
    sched.add_request(a)
    out = sched.schedule()
    assert out.total_num_scheduled_tokens == 0
    assert a.status == status("WAITING_FOR_REMOTE_KVS")
    return sched, a, out


def head_that_does_not_fit(make):
    """A parked and loaded, behind P (9 blocks: more than the 7 free, put
    at the front of the queue where a preempted request goes)."""
    sched, a, out = parked_load(make)
    _, request = make
    p = request("P", 130, seed=3)
    sched.add_request(p)
    sched.waiting.remove_request(p)
    sched.waiting.prepend_request(p)
    report_loaded(sched, out, "A")
    return sched, a, p


class EmptyExecutor:
    """Runs no model: one sampled token per scheduled request, nothing
    while only a load is under way (as the worker's outputs then)."""

    def __init__(self) -> None:
        self.steps = 0

    def execute_model(self, scheduler_output, non_block=False):
        import concurrent.futures

        import numpy
        from vllm.v1.outputs import ModelRunnerOutput

        self.steps += 1
        ids = list(scheduler_output.num_scheduled_tokens)
        future = concurrent.futures.Future()
        future.set_result(
            ModelRunnerOutput(
                req_ids=ids,
                req_id_to_index={r: i for i, r in enumerate(ids)},
                sampled_token_ids=[numpy.array([7]) for _ in ids],
                logprobs=None,
                prompt_logprobs_dict={},
                pooler_output=[],
            )
        )
        return future

    def sample_tokens(self, grammar_output, non_block=False):
        raise AssertionError("nothing was scheduled: nothing to sample")


def engine_shell(sched, batch_queue: bool = False):
    from vllm.v1.engine.core import EngineCore

    engine = EngineCore.__new__(EngineCore)
    engine.scheduler = sched
    engine.model_executor = EmptyExecutor()
    engine.batch_queue = collections.deque() if batch_queue else None
    engine.batch_queue_size = 2
    engine.ec_producer = False
    engine.is_pooling_model = False
    return engine


def step_line(sched, out) -> str:
    """One scheduler step as a line: new requests (with computed tokens),
    resumed ones, tokens per request, the waiting queue (id:status) and the
    free device blocks after the step."""
    new = [f"{r.req_id}@{r.num_computed_tokens}" for r in out.scheduled_new_reqs]
    resumed = sorted(out.scheduled_cached_reqs.resumed_req_ids)
    tokens = [f"{k}+{v}" for k, v in sorted(out.num_scheduled_tokens.items())]
    waiting = [f"{r.request_id}:{r.status.name}" for r in sched.waiting]
    free = sched.kv_cache_manager.block_pool.get_num_free_blocks()
    return (
        f"new={','.join(new)} resumed={','.join(resumed)} "
        f"tokens={','.join(tokens)} waiting={','.join(waiting)} free={free}"
    )


def scenarios(make) -> dict[str, list[str]]:
    """Each KV-pressure scenario as the lines of its scheduler steps."""
    traces = {}

    # KV-01: B's load (7 blocks, 6 in the host pool) is deferred while A's
    # deficit is promised; A's load lands and A runs.
    sched, a, out = parked_load(make)
    b = make[1]("B", 100, seed=2)
    offload(sched, b, 6)
    sched.add_request(b)
    lines = [step_line(sched, sched.schedule())]
    report_loaded(sched, out, "A")
    lines += [step_line(sched, sched.schedule()) for _ in range(3)]
    traces["kv01-deficit"] = lines

    # KV-03: a head request that does not fit must not strand A.
    sched, a, p = head_that_does_not_fit(make)
    traces["kv03-head-does-not-fit"] = [
        step_line(sched, sched.schedule()) for _ in range(3)
    ]

    # KV-04: a preempted request resumes as resumed after its load.
    sched, a, out = parked_load(make)
    a.num_preemptions = 1
    report_loaded(sched, out, "A")
    traces["kv04-resume-after-load"] = [
        step_line(sched, sched.schedule()) for _ in range(3)
    ]

    # KV-02: an aborted parked request gives its blocks and promise back.
    sched, a, out = parked_load(make)
    sched.finish_requests("A", status("FINISHED_ABORTED"))
    c = make[1]("C", 140, seed=4)  # 9 blocks: only fits with none promised
    sched.add_request(c)
    traces["kv02-abort"] = [step_line(sched, sched.schedule()) for _ in range(2)]

    # EC-01: an engine whose only request waits for its load does not spin
    # (stock: thousands of empty steps in the window; waiting: <= 150)
    from vllm.v1.engine.core import EngineCore

    sched, a, out = parked_load(make)
    engine = engine_shell(sched)
    steps, deadline = 0, time.monotonic() + 0.3
    while time.monotonic() < deadline:
        EngineCore.step(engine)
        steps += 1
    traces["ec01-idle-engine"] = ["waits" if steps < 600 else f"spins ({steps} steps)"]
    return traces
