"""Offloading pieces: sub-block pairing, options, handler, stats."""

from __future__ import annotations

import pytest
import torch

from vllm_overlay.core.offload.mapping import expand, pair_sub_blocks
from vllm_overlay.core.ops.block_copy import BlockTable


def test_expand():
    assert expand([0, 1, 3], 4).tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 12, 13, 14, 15]


def test_unaligned_load_skips_source_sub_blocks():
    """Factor 4: 2 offloaded blocks (8 sub-blocks) into 7 device blocks,
    because the device already had the first one (0.11.2 asserted)."""
    host, device = pair_sub_blocks([5, 9], 4, list(range(10, 17)), 1)
    assert host.tolist() == [21, 22, 23, 36, 37, 38, 39]
    assert device.tolist() == list(range(10, 17))


def test_store_pairs_whole_blocks_and_skips_destination_when_needed():
    device, host = pair_sub_blocks([3, 4, 5, 6], 1, [2], 4)
    assert device.tolist() == [3, 4, 5, 6] and host.tolist() == [8, 9, 10, 11]
    device, host = pair_sub_blocks([3, 4, 5], 1, [2], 4)
    assert host.tolist() == [9, 10, 11]


def test_mismatch_of_more_than_a_block_is_an_error():
    with pytest.raises(ValueError, match="more than one block"):
        pair_sub_blocks([1, 2], 4, [0, 1, 2], 1)
    with pytest.raises(ValueError, match="more than one block"):
        pair_sub_blocks([0], 1, [1, 2], 4)


def make_spec(extra, block_size=16, with_model=False, parallel=None):
    from vllm.config import CacheConfig, KVTransferConfig, VllmConfig

    kwargs = {} if parallel is None else {"parallel_config": parallel}
    if with_model:
        from vllm.config import ModelConfig

        from vllm_overlay.testing import tiny_model_path

        kwargs["model_config"] = ModelConfig(model=tiny_model_path(), dtype="float32")
    config = VllmConfig(
        cache_config=CacheConfig(block_size=block_size),
        kv_transfer_config=KVTransferConfig(
            kv_connector="OverlayOffloadingConnector",
            kv_role="kv_both",
            kv_connector_extra_config=extra,
        ),
        **kwargs,
    )
    from vllm_overlay.connectors.offloading import OverlayCPUOffloadingSpec

    return OverlayCPUOffloadingSpec(config)


@pytest.mark.parametrize(
    "extra,message",
    [
        ({}, "exactly one of num_cpu_blocks and cpu_bytes"),
        ({"num_cpu_blocks": 4, "cpu_bytes": 10}, "exactly one"),
        ({"num_cpu_blocks": 0}, "'num_cpu_blocks'] must be a positive integer"),
        ({"num_cpu_blocks": "8"}, "must be a positive integer"),
        (
            {"num_cpu_blocks": 8, "block_size": 24},
            "multiple of the KV cache block size 16",
        ),
        ({"num_cpu_blocks": 8, "transfer_method": "fast"}, "transfer_method 'fast'"),
        ({"num_cpu_blocks": 8, "eviction_policy": "fifo"}, "lru or arc"),
        ({"num_cpu_blocks": 8, "cpu_blocks": 3}, "unknown kv_connector_extra"),
    ],
)
def test_bad_options_are_rejected(overlay, extra, message):
    with pytest.raises(ValueError, match=message):
        make_spec(extra)


def test_host_size_in_bytes(overlay):
    # tiny model: 4 layers x 2 (K, V) x 2 KV heads x 32 x 4 B = 2048 B/token
    spec = make_spec(
        {"cpu_bytes": 2048 * 32 * 10 + 5, "block_size": 32}, with_model=True
    )
    assert spec.num_cpu_blocks == 10 and spec.factor == 2
    with pytest.raises(ValueError, match="less than one offloaded block"):
        make_spec({"cpu_bytes": 100}, with_model=True)


@pytest.mark.parametrize("partition", ["1,3", "3,1"])
def test_host_pool_has_the_same_blocks_on_every_pp_stage(
    overlay, monkeypatch, partition
):
    """The scheduler hands every stage the same host block ids: the
    scheduler (rank 0's config) and each stage's worker must size the pool
    alike.  cpu_bytes is for the whole model, split by layers.  (Sized from
    each process's own stage, 1,3 gave the scheduler 128 blocks and the
    3-layer stage 42: a stage-1 IndexError, then EngineDeadError.)"""
    from vllm.config import ParallelConfig

    monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", partition)
    layers = [int(n) for n in partition.split(",")]
    block = 512 * 16  # one 16-token block of one layer
    for rank in (0, 1):
        parallel = ParallelConfig(
            pipeline_parallel_size=2, rank=rank, distributed_executor_backend="mp"
        )
        spec = make_spec({"cpu_bytes": 2**20}, with_model=True, parallel=parallel)
        assert spec.num_cpu_blocks == 2**20 // (4 * block) == 32
        assert spec.host_pool.stage_bytes == [32 * n * block for n in layers]
        assert f"stages of {layers} layers" in spec.host_pool.describe()
        with pytest.raises(ValueError, match="block of the model's 4 layers"):
            make_spec({"cpu_bytes": 3 * block}, with_model=True, parallel=parallel)
    spec = make_spec({"num_cpu_blocks": 7}, with_model=True, parallel=parallel)
    assert spec.host_pool.stage_bytes == [7 * n * block for n in layers]


def test_handler_with_kernel_blocks_smaller_than_cache_blocks(overlay):
    """Per-layer K/V-first caches in kernel blocks of 16 tokens, cache
    blocks of 32: a scheduler block id covers two kernel blocks."""
    from vllm.v1.kv_offload.mediums import CPULoadStoreSpec, GPULoadStoreSpec

    from vllm_overlay.connectors.offloading import BlockMoverHandler

    gen = torch.Generator().manual_seed(0)
    layers = [torch.randn(2, 12, 16, 2, 8, generator=gen) for _ in range(3)]
    table = BlockTable.from_tensors(layers, 1).coarsen(2)
    handler = BlockMoverHandler(table, num_host_blocks=8, factor=2, method="auto")
    assert handler.mover.method == "dma"
    before = [t.clone() for t in layers]
    # Store cache blocks 1, 4 (kernel blocks 2,3 and 8,9) to host block 3.
    assert handler.transfer_async(0, (GPULoadStoreSpec([1, 4]), CPULoadStoreSpec([3])))
    assert handler.get_finished() == [(0, True)]
    # Load host block 3 into cache blocks 0, 5.
    handler.transfer_async(1, (CPULoadStoreSpec([3]), GPULoadStoreSpec([0, 5])))
    assert handler.get_finished() == [(1, True)]
    for t, b in zip(layers, before):
        assert torch.equal(t[:, 0:2], b[:, 2:4])
        assert torch.equal(t[:, 10:12], b[:, 8:10])
        assert torch.equal(t[:, 2:10], b[:, 2:10])  # untouched
    stats = handler.take_stats()
    assert stats["store"]["blocks"] == stats["load"]["blocks"] == 2
    # Per cache block: K and V of each layer, each one run of 2 kernel blocks.
    assert stats["store"]["copy_calls"] == 2 * 2 * 3


def test_stats_aggregate_and_reduce(overlay):
    from vllm_overlay.connectors.offloading import OffloadStats

    a = OffloadStats(
        data={
            "load": {
                "jobs": 1,
                "blocks": 2,
                "bytes": 2**21,
                "copy_calls": 1,
                "seconds": 0.001,
                "gb_per_s": 2.1,
            }
        }
    )
    b = OffloadStats(
        data={
            "load": {
                "jobs": 1,
                "blocks": 1,
                "bytes": 2**20,
                "copy_calls": 1,
                "seconds": 0.002,
                "gb_per_s": 0.5,
            }
        }
    )
    out = a.aggregate(b).reduce()
    assert out["load_blocks"] == 3 and out["load_copy_calls"] == 2
    assert out["load_MiB"] == 3.0
    assert out["load_GB_per_s"] == round(3 * 2**20 / 0.003 / 1e9, 2)
    assert not a.is_empty() and OffloadStats(data={}).is_empty()
