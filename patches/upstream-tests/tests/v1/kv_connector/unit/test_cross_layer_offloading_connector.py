# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""CrossLayerOffloadingConnector: its options, the sub-block pairing, the
block mover between a device cache and a host pool, and on a real engine a
prefix evicted from the device cache reloaded from host memory."""

import numpy as np
import pytest
import torch

from tests.v1.kv_connector.unit.tiny_llama import (
    make_tiny_llama,
    prompt_token_ids,
    run_once,
    tiny_llm,
)
from vllm.config import (
    CacheConfig,
    KVTransferConfig,
    ModelConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.cross_layer_offloading_connector import (  # noqa: E501
    BlockMoverHandler,
    CrossLayerCPUOffloadingSpec,
    CrossLayerOffloadingConnector,
)
from vllm.v1.kv_cache_layout import CrossLayerKVLayout
from vllm.v1.kv_offload.block_copy import BlockTable
from vllm.v1.kv_offload.factory import OffloadingSpecFactory
from vllm.v1.kv_offload.kv_tables import cross_layer_table
from vllm.v1.kv_offload.mediums import CPULoadStoreSpec, GPULoadStoreSpec
from vllm.v1.kv_offload.worker.block_mover import BlockMover, choose_method
from vllm.v1.kv_offload.worker.sub_blocks import expand, pair_sub_blocks

# tiny_llama: 2 layers, 1 KV head of 32, float32: 512 B per token
BYTES_PER_TOKEN = 2 * 2 * 32 * 4


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


def spec_for(model, extra, block_size=16):
    config = VllmConfig(
        model_config=ModelConfig(model=model, dtype="float32", max_model_len=256),
        cache_config=CacheConfig(block_size=block_size),
        kv_transfer_config=KVTransferConfig(
            kv_connector="CrossLayerOffloadingConnector",
            kv_role="kv_both",
            kv_connector_extra_config=extra,
        ),
    )
    return CrossLayerCPUOffloadingSpec(config)


def test_registered_by_name():
    cls = KVConnectorFactory.get_connector_class_by_name(
        "CrossLayerOffloadingConnector"
    )
    assert cls is CrossLayerOffloadingConnector
    assert cls.prefer_cross_layer_blocks
    loader = OffloadingSpecFactory._registry["CrossLayerCPUOffloadingSpec"]
    assert loader() is CrossLayerCPUOffloadingSpec


def test_spec_options(model):
    spec = spec_for(model, {"num_cpu_blocks": 12, "block_size": 32})
    assert spec.num_cpu_blocks == 12
    assert spec.factor == 2
    assert spec.eviction_policy == "lru"
    assert spec.transfer_method == "auto"
    # cpu_bytes: whole offloaded blocks of 32 tokens
    spec = spec_for(
        model, {"cpu_bytes": 5 * 32 * BYTES_PER_TOKEN + 100, "block_size": 32}
    )
    assert spec.num_cpu_blocks == 5


@pytest.mark.parametrize(
    "extra, message",
    [
        ({"num_cpu_blocks": 4, "cpu_gb": 1}, "unknown kv_connector_extra_config"),
        ({"num_cpu_blocks": 4, "cpu_bytes": 1 << 20}, "exactly one"),
        ({}, "exactly one"),
        ({"num_cpu_blocks": 0}, "positive integer"),
        ({"num_cpu_blocks": 4, "block_size": 24}, "multiple of the KV cache"),
        ({"cpu_bytes": 100}, "less than one offloaded block"),
        ({"num_cpu_blocks": 4, "transfer_method": "memcpy"}, "transfer_method"),
        ({"num_cpu_blocks": 4, "eviction_policy": "fifo"}, "eviction_policy"),
    ],
)
def test_spec_rejects_bad_options(model, extra, message):
    with pytest.raises(ValueError, match=message):
        spec_for(model, extra)


def test_sub_block_pairing():
    assert expand(np.array([0, 1, 3]), 4).tolist() == [
        *range(0, 4),
        *range(4, 8),
        *range(12, 16),
    ]
    # aligned: one host block of 2 cache blocks per 2 device blocks
    src, dst = pair_sub_blocks([7, 8, 2, 3], 1, [5, 1], 2)
    assert src.tolist() == [7, 8, 2, 3]
    assert dst.tolist() == [10, 11, 2, 3]
    # a device prefix hit not aligned to the host block: the first
    # sub-block of the source is already in place on either side
    src, dst = pair_sub_blocks([5, 1], 2, [9, 4, 6], 1)
    assert (src.tolist(), dst.tolist()) == ([11, 2, 3], [9, 4, 6])
    src, dst = pair_sub_blocks([9, 4, 6], 1, [5, 1], 2)
    assert (src.tolist(), dst.tolist()) == ([9, 4, 6], [11, 2, 3])
    with pytest.raises(ValueError, match="more than one block too many"):
        pair_sub_blocks([5, 1], 2, [9], 1)


def cross_layer_cache(num_blocks, block_size=16, kernel_block_size=16):
    layout = CrossLayerKVLayout(
        dims=("blocks", "layers", "kv", "heads", "tokens", "head_size"),
        shape=(num_blocks, 2, 2, 1, kernel_block_size, 8),
        logical_dims=("kv", "blocks", "heads", "tokens", "head_size"),
        dtype=torch.float32,
        layer_names=("l0", "l1"),
        block_size=block_size,
        kernel_block_size=kernel_block_size,
    )
    buffer = layout.allocate("cpu")
    buffer.copy_(torch.randn(buffer.shape, generator=torch.Generator().manual_seed(0)))
    return buffer, layout


def test_cross_layer_table_uses_cache_blocks():
    buffer, layout = cross_layer_cache(8, block_size=32, kernel_block_size=16)
    table = cross_layer_table(buffer, layout)
    assert table.num_blocks == 4  # cache blocks of 2 kernel blocks
    assert table.runs_per_block == 1
    assert table.block_bytes == layout.cache_block_bytes == 2 * layout.block_bytes


def test_block_mover_round_trip_on_cpu():
    buffer, layout = cross_layer_cache(10)
    table = BlockTable.from_tensors([buffer], 0)
    assert choose_method(table, "auto") == "dma"
    with pytest.raises(ValueError, match="needs a CUDA device"):
        choose_method(table, "triton")
    mover = BlockMover(table, num_host_blocks=6)
    assert mover.host.shape == (6, layout.block_bytes)

    mover.submit(1, torch.tensor([2, 3, 4, 8]), torch.tensor([0, 1, 2, 5]), True)
    assert mover.poll() == [1]
    host = mover.host.view(torch.float32).view(6, *buffer.shape[1:])
    assert torch.equal(host[[0, 1, 2, 5]], buffer[[2, 3, 4, 8]])
    assert not mover.host[[3, 4]].any()

    original = buffer.clone()
    buffer.zero_()
    mover.submit(2, torch.tensor([7, 0]), torch.tensor([5, 1]), False)
    assert mover.poll() == [2]
    assert torch.equal(buffer[7], original[8])
    assert torch.equal(buffer[0], original[3])
    assert not buffer[1:7].any() and not buffer[8:].any()

    stats = mover.take_stats()
    assert (stats["store"].blocks, stats["load"].blocks) == (4, 2)
    assert stats["store"].bytes == 4 * layout.block_bytes
    # a cross-layer block is one run: consecutive blocks merge into one copy
    assert stats["store"].copy_calls == 2
    assert stats["load"].copy_calls == 2


def test_handler_moves_offloaded_blocks_of_two_cache_blocks():
    buffer, layout = cross_layer_cache(12)
    table = BlockTable.from_tensors([buffer], 0)
    handler = BlockMoverHandler(table, num_host_blocks=8, factor=2, method="auto")
    store = (GPULoadStoreSpec([4, 5, 9, 10]), CPULoadStoreSpec([3, 0]))
    assert handler.transfer_async(11, store)
    assert handler.get_finished() == [(11, True)]
    original = buffer.clone()
    buffer.zero_()
    # load host block 3 (device blocks 4 and 5) into device 1 and 2, and
    # only the second half of host block 0 (device block 10) into device 6
    handler.transfer_async(12, (CPULoadStoreSpec([3]), GPULoadStoreSpec([1, 2])))
    handler.transfer_async(13, (CPULoadStoreSpec([0]), GPULoadStoreSpec([6])))
    assert sorted(handler.get_finished()) == [(12, True), (13, True)]
    assert torch.equal(buffer[[1, 2, 6]], original[[4, 5, 10]])
    assert not buffer[[0, 3, 4, 5, 7, 8, 9, 10, 11]].any()
    totals = handler.cumulative()
    assert totals["store"]["blocks"] == 4
    assert totals["load"]["blocks"] == 3


def test_engine_reloads_an_evicted_prefix_from_host(model, monkeypatch):
    """Recompute a prompt (its blocks are stored to host memory), evict the
    device prefix cache, run it again: the prefix comes back from host
    memory, one copy per run of blocks, and gives the same tokens and
    logprobs as the recompute."""
    from vllm import SamplingParams
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    kv_transfer_config = KVTransferConfig(
        kv_connector="CrossLayerOffloadingConnector",
        kv_role="kv_both",
        kv_connector_extra_config={"num_cpu_blocks": 32},
    )
    prompt = {"prompt_token_ids": prompt_token_ids(100)}  # 6 full blocks
    params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=1)

    with tiny_llm(
        model, num_gpu_blocks=16, kv_transfer_config=kv_transfer_config
    ) as llm:
        layout = llm.collective_rpc(
            lambda worker: worker.model_runner.cross_layers_kv_layout
        )[0]
        assert layout is not None and layout.num_layers == 2
        handler = get_kv_transfer_group().connector_worker.handler
        assert handler.mover.table.runs_per_block == 1

        recomputed = run_once(llm, prompt, params)
        assert recomputed[2] == 0
        # one more step completes the stores and frees the blocks; then the
        # device prefix cache is emptied (the host pool keeps its copies)
        llm.generate(
            [{"prompt_token_ids": prompt_token_ids(3, offset=50)}],
            SamplingParams(max_tokens=1),
            use_tqdm=False,
        )
        assert handler.cumulative()["store"]["blocks"] >= 6
        assert handler.cumulative()["load"]["blocks"] == 0
        llm.reset_prefix_cache()

        reloaded = run_once(llm, prompt, params)
        loads = handler.cumulative()["load"]
    assert reloaded[2] == 96  # 6 blocks from host, the last token computed
    assert loads["blocks"] == 6
    assert loads["bytes"] == 6 * layout.block_bytes
    assert loads["copy_calls"] <= loads["blocks"]
    assert reloaded[0] == recomputed[0]
    assert reloaded[1] == recomputed[1]
