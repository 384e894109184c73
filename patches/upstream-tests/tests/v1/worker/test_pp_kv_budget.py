# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""--enable-pp-prop-kv-cache: the KV cache budget of the whole pipeline
split across stages by their number of layers."""

from types import SimpleNamespace

import pytest

from vllm.config import CacheConfig
from vllm.engine.arg_utils import EngineArgs
from vllm.utils.argparse_utils import FlexibleArgumentParser
from vllm.v1.worker import pp_kv_budget
from vllm.v1.worker.cpu_worker import CPUWorker
from vllm.v1.worker.pp_kv_budget import StageBudget, split_budget, stage_budgets

NUM_LAYERS = 4
# one block of one layer: 16 tokens x (K and V) x 1 KV head x 32 x 4 B
PAGE_BYTES = 16 * 2 * 1 * 32 * 4


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from transformers import LlamaConfig

    path = tmp_path_factory.mktemp("tiny-llama-config")
    LlamaConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=NUM_LAYERS,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        max_position_embeddings=512,
        architectures=["LlamaForCausalLM"],
        torch_dtype="float32",
    ).save_pretrained(path)
    return str(path)


def engine_config(model, **kwargs):
    return EngineArgs(
        model=model,
        skip_tokenizer_init=True,
        dtype="float32",
        max_model_len=256,
        block_size=16,
        distributed_executor_backend="mp",
        **kwargs,
    ).create_engine_config()


@pytest.mark.parametrize(
    "total, layers, shares",
    [
        (1000, [3, 1], [750, 250]),
        (10, [1, 1, 1], [4, 3, 3]),  # largest remainder, then lowest rank
        (64 << 20, [56, 8], [58720256, 8388608]),
        (7, [5], [7]),
        (101, [2, 3, 5], [20, 30, 51]),
    ],
)
def test_split_budget(total, layers, shares):
    got = split_budget(total, layers)
    assert got == shares
    assert sum(got) == total


@pytest.mark.parametrize(
    "total, layers, message",
    [
        (0, [2, 2], "must be > 0 bytes"),
        (100, [], "at least one layer"),
        (100, [3, 0], "at least one layer"),
    ],
)
def test_split_budget_rejects(total, layers, message):
    with pytest.raises(ValueError, match=message):
        split_budget(total, layers)


def test_stage_budget_blocks():
    stage = StageBudget(
        rank=1,
        layers=3,
        bytes=10 * 3 * 4096 + 5,
        page_bytes_per_layer=4096,
        block_size=16,
    )
    assert stage.blocks == 10
    stage.check()
    assert "PP rank 1: 3 layers" in stage.describe(max_model_len=64)
    assert "10 blocks = 160 tokens" in stage.describe(max_model_len=64)
    with pytest.raises(ValueError, match="less than one block"):
        StageBudget(1, 3, 3 * 4096 - 1, 4096, 16).check()


def test_engine_argument_and_cli_flag(model):
    assert CacheConfig().enable_pp_prop_kv_cache is False
    config = engine_config(model, kv_cache_memory_bytes=1 << 20)
    assert config.cache_config.enable_pp_prop_kv_cache is False

    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    args = parser.parse_args(["--model", model, "--enable-pp-prop-kv-cache"])
    assert EngineArgs.from_cli_args(args).enable_pp_prop_kv_cache is True
    args = parser.parse_args(["--model", model])
    assert EngineArgs.from_cli_args(args).enable_pp_prop_kv_cache is False


def test_stages_get_the_same_number_of_blocks(model, monkeypatch):
    monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", "3,1")
    total = 64 * NUM_LAYERS * PAGE_BYTES  # 64 blocks for every layer
    config = engine_config(
        model,
        pipeline_parallel_size=2,
        kv_cache_memory_bytes=total,
        enable_pp_prop_kv_cache=True,
    )
    assert config.cache_config.enable_pp_prop_kv_cache is True
    budgets = stage_budgets(config)
    assert [b.layers for b in budgets] == [3, 1]
    assert [b.bytes for b in budgets] == [total * 3 // 4, total // 4]
    assert [b.blocks for b in budgets] == [64, 64]

    # each worker takes its stage's share (the CPU worker: instead of
    # VLLM_CPU_KVCACHE_SPACE); without the flag, the whole budget
    for rank, budget in enumerate(budgets):
        monkeypatch.setattr(
            "vllm.distributed.parallel_state.get_pp_group",
            lambda rank=rank: SimpleNamespace(rank_in_group=rank),
        )
        worker = SimpleNamespace(cache_config=config.cache_config, vllm_config=config)
        assert CPUWorker.determine_available_memory(worker) == budget.bytes
    config.cache_config.enable_pp_prop_kv_cache = False
    assert pp_kv_budget.rank_kv_cache_budget(config, total) == total
    worker = SimpleNamespace(cache_config=config.cache_config, vllm_config=config)
    assert CPUWorker.determine_available_memory(worker) == total


@pytest.mark.parametrize(
    "kwargs, partition, message",
    [
        ({}, "3,1", "needs --kv-cache-memory-bytes"),
        ({"kv_cache_memory_bytes": 2 * PAGE_BYTES}, "3,1", "less than one block"),
        ({"kv_cache_memory_bytes": 1 << 20}, "2,1", "does not split the model"),
    ],
)
def test_bad_configurations_fail_before_any_worker_starts(
    model, monkeypatch, kwargs, partition, message
):
    monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", partition)
    with pytest.raises(ValueError, match=message):
        engine_config(
            model, pipeline_parallel_size=2, enable_pp_prop_kv_cache=True, **kwargs
        )
