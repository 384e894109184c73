"""The PP KV budget: the split, and the option's validation."""

from __future__ import annotations

import pytest

from vllm_overlay.core.pp_budget import StageBudget, split_budget

GiB = 2**30


@pytest.mark.parametrize(
    "layers,expected",
    [
        ([56, 8], [7 * GiB, 1 * GiB]),
        ([48, 16], [6 * GiB, 2 * GiB]),
        ([16, 16, 16, 16], [2 * GiB] * 4),
        ([64], [8 * GiB]),  # PP=1: unchanged
    ],
)
def test_split_by_layers(layers, expected):
    assert split_budget(8 * GiB, layers) == expected


def test_uneven_remainders_add_up_and_are_deterministic():
    assert split_budget(10, [1, 1, 1]) == [4, 3, 3]
    shares = split_budget(8 * GiB + 7, [30, 21, 13])
    assert sum(shares) == 8 * GiB + 7
    exact = [(8 * GiB + 7) * n / 64 for n in (30, 21, 13)]
    assert all(abs(s - e) < 1 for s, e in zip(shares, exact))
    assert shares == split_budget(8 * GiB + 7, [30, 21, 13])


def test_bad_splits():
    with pytest.raises(ValueError, match="at least one layer"):
        split_budget(GiB, [4, 0])
    with pytest.raises(ValueError, match="must be > 0 bytes"):
        split_budget(0, [4, 4])


def test_stage_blocks_and_too_small_budget():
    stage = StageBudget(
        rank=1, layers=8, bytes=7 * 2**20, page_bytes_per_layer=2**16, block_size=16
    )
    assert stage.blocks == 14
    assert "PP rank 1: 8 layers" in stage.describe(1024)
    small = StageBudget(
        rank=1, layers=8, bytes=2**18, page_bytes_per_layer=2**16, block_size=16
    )
    with pytest.raises(
        ValueError,
        match=r"stage 1 \(8 layers\) gets 262144 "
        r"B .* less than one block .*524288 B",
    ):
        small.check()


def engine_config(monkeypatch, partition=None, **kwargs):
    from vllm.engine.arg_utils import EngineArgs

    from vllm_overlay.testing import tiny_model_path

    if partition:
        monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", partition)
    return EngineArgs(
        model=tiny_model_path(),
        dtype="float32",
        max_model_len=512,
        pipeline_parallel_size=2,
        distributed_executor_backend="mp",
        **kwargs,
    ).create_engine_config()


FLAG = {"additional_config": {"enable_pp_prop_kv_cache": True}}


@pytest.mark.patch_test("PP-03")
def test_flag_needs_a_byte_budget(overlay, monkeypatch):
    with pytest.raises(ValueError, match="needs --kv-cache-memory-bytes"):
        engine_config(monkeypatch, **FLAG)


@pytest.mark.patch_test("PP-03")
def test_partition_must_match_the_model(overlay, monkeypatch):
    with pytest.raises(
        ValueError,
        match="VLLM_PP_LAYER_PARTITION='3,3' does "
        "not split the model's 4 layers over 2",
    ):
        engine_config(monkeypatch, "3,3", kv_cache_memory_bytes=2**24, **FLAG)


@pytest.mark.patch_test("PP-03")
def test_budget_too_small_for_a_block(overlay, monkeypatch):
    # 128-token blocks, 2 KV heads x 32 x 2 (K,V) x 4 B = 512 B/token/layer.
    # Shares are proportional, so the first stage is short as well.
    with pytest.raises(
        ValueError,
        match=r"stage 0 \(3 layers\) gets 98304 B"
        r".*one block .*\(196608 B\)",
    ):
        engine_config(monkeypatch, "3,1", kv_cache_memory_bytes=2**17, **FLAG)


def test_flag_must_be_a_bool(overlay, monkeypatch):
    with pytest.raises(ValueError, match="must be true or false"):
        engine_config(
            monkeypatch,
            "3,1",
            kv_cache_memory_bytes=2**24,
            additional_config={"enable_pp_prop_kv_cache": "yes"},
        )


@pytest.mark.patch_test("PP-01", "PP-02")
def test_command_line_flag_reaches_additional_config(overlay):
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from vllm_overlay.testing import tiny_model_path

    parser = AsyncEngineArgs.add_cli_args(FlexibleArgumentParser())
    assert "--enable-pp-prop-kv-cache" in parser.format_help()
    args = parser.parse_args(
        [
            "--model",
            tiny_model_path(),
            "--enable-pp-prop-kv-cache",
            "--kv-cache-memory-bytes",
            "8G",
        ]
    )
    engine_args = AsyncEngineArgs.from_cli_args(args)
    assert engine_args.additional_config["enable_pp_prop_kv_cache"] is True
    assert engine_args.kv_cache_memory_bytes == 8 * 2**30
    plain = AsyncEngineArgs.from_cli_args(
        parser.parse_args(["--model", tiny_model_path()])
    )
    assert "enable_pp_prop_kv_cache" not in (plain.additional_config or {})


@pytest.mark.patch_test("PP-04")
def test_gpu_worker_returns_its_stage_share(overlay, monkeypatch):
    """PP-04 on the GPU Worker (the CPU e2e tests exercise CPUWorker): the
    stock method's answer (the whole budget) becomes this stage's share."""
    import types

    from vllm.distributed import parallel_state
    from vllm.v1.worker.gpu_worker import Worker

    from vllm_overlay.core.patching import REGISTRY

    config = engine_config(monkeypatch, "3,1", kv_cache_memory_bytes=16 * 2**20, **FLAG)
    monkeypatch.setattr(
        REGISTRY.state("PP-04"),
        "original",
        lambda self: self.vllm_config.cache_config.kv_cache_memory_bytes,
    )
    monkeypatch.setattr(
        parallel_state, "get_pp_group", lambda: types.SimpleNamespace(rank_in_group=1)
    )
    worker = types.SimpleNamespace(vllm_config=config)
    assert Worker.determine_available_memory(worker) == 4 * 2**20
    assert worker.vllm_overlay_kv_budget == 4 * 2**20
    config.additional_config["enable_pp_prop_kv_cache"] = False
    assert Worker.determine_available_memory(worker) == 16 * 2**20


@pytest.mark.patch_test("PP-05")
def test_cpu_worker_budget_is_kv_cache_memory_bytes(overlay):
    """PP-05: stock CPUWorker returns VLLM_CPU_KVCACHE_SPACE whatever
    --kv-cache-memory-bytes says; an explicit budget now wins."""
    import types

    from vllm.v1.worker.cpu_worker import CPUWorker

    cache = types.SimpleNamespace(
        kv_cache_memory_bytes=8 * 2**20, cpu_kvcache_space_bytes=4 * GiB
    )
    worker = types.SimpleNamespace(
        cache_config=cache, vllm_config=types.SimpleNamespace(additional_config={})
    )
    assert CPUWorker.determine_available_memory(worker) == 8 * 2**20
    cache.kv_cache_memory_bytes = None
    assert CPUWorker.determine_available_memory(worker) == 4 * GiB
