# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Async KV loads under KV cache pressure (scheduler and KV cache manager),
and the engine step while only async KV loads remain.

A scheduler-only connector offers every request an async load of all its
full prompt blocks but the last; the test plays the worker: a load started
in one step has landed by the next.  10 device blocks of 16 tokens (block 0
is the null block: 9 usable).
"""

import time
from concurrent.futures import Future

import numpy as np
import pytest
import torch

from vllm.config import (
    CacheConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
)
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine.core import KV_LOAD_IDLE_WAIT_S, EngineCore
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
)
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

BLOCK_SIZE = 16
NUM_BLOCKS = 10


class AsyncLoadConnector(KVConnectorBase_V1):
    """Scheduler side: every full prompt block but the last is found outside
    the device and loaded asynchronously."""

    def __init__(self, vllm_config, role, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        self.loading: set[str] = set()
        self.num_loads = 0

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        full = (request.num_tokens - 1) // BLOCK_SIZE * BLOCK_SIZE
        if full <= num_computed_tokens:
            return 0, False
        return full - num_computed_tokens, True

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        if num_external_tokens:
            self.loading.add(request.request_id)
            self.num_loads += 1

    def build_connector_meta(self, scheduler_output):
        return KVConnectorMetadata()

    def start_load_kv(self, forward_context, **kwargs):
        pass

    def wait_for_layer_load(self, layer_name):
        pass

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):
        pass

    def wait_for_save(self):
        pass


if "AsyncLoadConnector" not in KVConnectorFactory._registry:
    KVConnectorFactory.register_connector(
        "AsyncLoadConnector", __name__, AsyncLoadConnector.__name__
    )


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from transformers import LlamaConfig

    path = tmp_path_factory.mktemp("tiny-llama-config")
    LlamaConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=512,
        architectures=["LlamaForCausalLM"],
        torch_dtype="float32",
    ).save_pretrained(path)
    return str(path)


@pytest.fixture
def scheduler(model_dir) -> Scheduler:
    init_none_hash(sha256)
    cache_config = CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=True)
    cache_config.num_gpu_blocks = NUM_BLOCKS
    vllm_config = VllmConfig(
        model_config=ModelConfig(
            model=model_dir,
            dtype="float32",
            max_model_len=256,
            skip_tokenizer_init=True,
        ),
        cache_config=cache_config,
        scheduler_config=SchedulerConfig(
            max_num_seqs=8, max_num_batched_tokens=512, max_model_len=256
        ),
        kv_transfer_config=KVTransferConfig(
            kv_connector="AsyncLoadConnector", kv_role="kv_both"
        ),
    )
    kv_cache_config = KVCacheConfig(
        num_blocks=NUM_BLOCKS,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(
                ["layer.0"], FullAttentionSpec(BLOCK_SIZE, 1, 16, torch.float32)
            )
        ],
    )
    return Scheduler(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=BLOCK_SIZE,
    )


def make_request(req_id: str, num_tokens: int, seed: int, max_tokens=4) -> Request:
    return Request(
        request_id=req_id,
        prompt_token_ids=[(seed * 131 + i * 7) % 500 + 1 for i in range(num_tokens)],
        sampling_params=SamplingParams(max_tokens=max_tokens),
        pooling_params=None,
        eos_token_id=None,
        block_hasher=get_request_block_hasher(BLOCK_SIZE, sha256),
    )


def worker_step(scheduler: Scheduler, output: SchedulerOutput) -> None:
    """What a worker reports for OUTPUT: one token for every scheduled
    request (each is scheduled to the end of its prompt), and the loads
    started by the previous step as landed."""
    connector = scheduler.connector
    landed, connector.loading = connector.loading, set()
    req_ids = list(output.num_scheduled_tokens)
    scheduler.update_from_output(
        output,
        ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=[np.array([7]) for _ in req_ids],
            logprobs=None,
            prompt_logprobs_dict={},
            pooler_output=[],
            kv_connector_output=KVConnectorOutput(finished_recving=landed),
        ),
    )


def park(scheduler: Scheduler, request: Request) -> SchedulerOutput:
    scheduler.add_request(request)
    output = scheduler.schedule()
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    return output


def num_blocks_held(scheduler: Scheduler, req_id: str) -> int:
    return len(scheduler.kv_cache_manager.get_block_ids(req_id)[0])


def test_parked_load_is_promised_the_rest_of_its_prompt(scheduler):
    a = make_request("A", 40, seed=1)  # 3 blocks: 2 loaded, 1 to compute
    output = park(scheduler, a)
    assert output.total_num_scheduled_tokens == 0
    manager = scheduler.kv_cache_manager
    assert num_blocks_held(scheduler, "A") == 2
    assert manager.block_pool.get_num_free_blocks() == 7

    # B's prompt (7 blocks) fits the 7 free blocks, but not next to the
    # block promised to A: B waits without taking any block.
    b = make_request("B", 100, seed=2)
    scheduler.add_request(b)
    output = scheduler.schedule()
    assert b.status == RequestStatus.WAITING
    assert num_blocks_held(scheduler, "B") == 0
    assert manager.block_pool.get_num_free_blocks() == 7
    assert manager.parked_deficits == {"A": 1}

    # A's load lands: A computes its last 8 tokens and its promise ends.
    worker_step(scheduler, output)
    output = scheduler.schedule()
    assert output.num_scheduled_tokens == {"A": 8}
    assert "A" not in manager.parked_deficits


def test_aborted_parked_load_releases_its_blocks_and_promise(scheduler):
    park(scheduler, make_request("A", 40, seed=1))
    scheduler.finish_requests("A", RequestStatus.FINISHED_ABORTED)
    manager = scheduler.kv_cache_manager
    assert manager.parked_deficits == {}
    assert manager.block_pool.get_num_free_blocks() == NUM_BLOCKS - 1


def test_parked_load_is_not_stranded_behind_a_request_that_does_not_fit(
    scheduler,
):
    a = make_request("A", 40, seed=1)
    output = park(scheduler, a)
    big = make_request("P", 130, seed=3)  # 9 blocks: more than the 7 free
    scheduler.add_request(big)
    scheduler.waiting.remove_request(big)
    scheduler.waiting.prepend_request(big)  # where a preempted request goes
    worker_step(scheduler, output)
    output = scheduler.schedule()
    # A holds blocks and nothing runs: it is scheduled ahead of P.
    assert output.num_scheduled_tokens == {"A": 8}
    assert [r.request_id for r in scheduler.waiting] == ["P"]


def test_preempted_request_resumes_after_its_load(scheduler):
    a = make_request("A", 40, seed=1)
    output = park(scheduler, a)
    a.num_preemptions = 1  # as if preempted before this load
    worker_step(scheduler, output)
    scheduled_new, resumed = [], set()
    for _ in range(2):
        output = scheduler.schedule()
        scheduled_new += [r.req_id for r in output.scheduled_new_reqs]
        resumed |= set(output.scheduled_cached_reqs.resumed_req_ids)
        if output.total_num_scheduled_tokens:
            break
    # Scheduled as new, the worker would drop the tokens A generated before
    # it was preempted.
    assert scheduled_new == []
    assert resumed == {"A"}
    assert output.num_scheduled_tokens == {"A": 8}


def test_many_async_loads_into_a_small_cache_all_finish(scheduler):
    """Eight requests of 3 to 5 blocks, each loading all but its last
    block, into 9 usable blocks: every request finishes with its tokens and
    no step leaves the engine idle while requests wait."""
    requests = [
        make_request(f"r{i}", 40 + 16 * (i % 3), seed=10 + i, max_tokens=8)
        for i in range(8)
    ]
    for request in requests:
        scheduler.add_request(request)
    idle_steps = 0
    for _ in range(200):
        if not scheduler.has_requests():
            break
        output = scheduler.schedule()
        if not output.total_num_scheduled_tokens and not scheduler.connector.loading:
            idle_steps += 1
            assert idle_steps < 3, "stalled: " + ", ".join(
                f"{r.request_id}={r.status.name}" for r in scheduler.waiting
            )
        worker_step(scheduler, output)
    assert not scheduler.has_requests()
    assert [r.status for r in requests] == [RequestStatus.FINISHED_LENGTH_CAPPED] * 8
    assert [len(r.output_token_ids) for r in requests] == [8] * 8
    assert scheduler.connector.num_loads >= 8
    assert scheduler.kv_cache_manager.parked_deficits == {}


class EmptyExecutor:
    """Runs no model: one sampled token per scheduled request."""

    def execute_model(self, scheduler_output, non_block=False):
        req_ids = list(scheduler_output.num_scheduled_tokens)
        future: Future = Future()
        future.set_result(
            ModelRunnerOutput(
                req_ids=req_ids,
                req_id_to_index={r: i for i, r in enumerate(req_ids)},
                sampled_token_ids=[np.array([7]) for _ in req_ids],
                logprobs=None,
                prompt_logprobs_dict={},
                pooler_output=[],
            )
        )
        return future


def engine_core(scheduler: Scheduler) -> EngineCore:
    """An EngineCore around SCHEDULER whose executor runs no model."""
    engine = EngineCore.__new__(EngineCore)
    engine.scheduler = scheduler
    engine.model_executor = EmptyExecutor()
    engine.batch_queue = None
    engine.ec_producer = False
    engine.is_pooling_model = False
    return engine


def test_engine_waits_while_only_kv_loads_remain(scheduler, monkeypatch):
    park(scheduler, make_request("A", 40, seed=1))
    waits: list[float] = []
    monkeypatch.setattr(
        scheduler.connector, "wait_for_remote_kv", waits.append, raising=False
    )
    engine = engine_core(scheduler)
    for _ in range(3):
        engine.step()
    assert waits == [KV_LOAD_IDLE_WAIT_S] * 3  # on the connector, bounded

    # a connector without the hook: the step sleeps instead of spinning
    monkeypatch.delattr(scheduler.connector, "wait_for_remote_kv")
    start = time.monotonic()
    for _ in range(5):
        engine.step()
    assert time.monotonic() - start >= 5 * KV_LOAD_IDLE_WAIT_S


def test_engine_never_waits_while_a_request_can_run(scheduler, monkeypatch):
    park(scheduler, make_request("A", 40, seed=1))
    scheduler.add_request(make_request("B", 10, seed=3))  # no load: runs now
    waits: list[float] = []
    monkeypatch.setattr(
        scheduler.connector, "wait_for_remote_kv", waits.append, raising=False
    )
    engine = engine_core(scheduler)
    _, executed = engine.step()
    assert executed and waits == []
