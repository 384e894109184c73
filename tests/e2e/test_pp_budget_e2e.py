"""--enable-pp-prop-kv-cache on real vLLM 0.11.2 (CPU), PP=2, partition 3,1.

Tiny model: 4 layers, 128-token blocks, 64 KiB per block per layer.
"""

from __future__ import annotations

PAGE = 128 * 2 * 2 * 32 * 4  # tokens x K/V x heads x head size x fp32
MiB = 2**20
PARTITION = {"VLLM_PP_LAYER_PARTITION": "3,1"}


def by_rank(run) -> list[dict]:
    return sorted(run.result["workers"], key=lambda w: w["pp_rank"])


def test_budget_split_by_layers_gives_equal_blocks(pp_run):
    reference = pp_run({"pp": 1})
    run = pp_run({"pp": 2, "flag": True, "kv_bytes": 16 * MiB}, **PARTITION)
    ranks = by_rank(run)
    assert [w["layers"] for w in ranks] == [3, 1]
    # 16 MiB for the whole pipeline: 12 MiB and 4 MiB, 64 blocks each.
    assert [w["budget"] for w in ranks] == [12 * MiB, 4 * MiB]
    assert [w["blocks"] for w in ranks] == [64, 64]
    assert [w["kv_bytes"] for w in ranks] == [64 * 3 * PAGE, 64 * 1 * PAGE]
    assert run.result["tokens"] == reference.result["tokens"]
    lines = [ln for ln in run.log.splitlines() if "vllm-overlay: PP rank" in ln]
    assert any("PP rank 0: 3 layers" in ln and "64 blocks" in ln for ln in lines)
    assert any("PP rank 1: 1 layers" in ln and "64 blocks" in ln for ln in lines)


def test_without_the_flag_the_same_blocks_need_more_memory(pp_run):
    flag = pp_run({"pp": 2, "flag": True, "kv_bytes": 16 * MiB}, **PARTITION)
    # Stock semantics: every rank gets the budget; the 3-layer rank limits
    # the block count, so 64 blocks need 12 MiB on every rank.
    stock = pp_run({"pp": 2, "kv_bytes": 12 * MiB}, **PARTITION)
    assert [w["blocks"] for w in by_rank(stock)] == [64, 64]
    assert [w["budget"] for w in by_rank(stock)] == [12 * MiB, 12 * MiB]
    flag_total = sum(w["budget"] for w in by_rank(flag))
    stock_total = sum(w["budget"] for w in by_rank(stock))
    assert flag_total == 16 * MiB < stock_total == 24 * MiB
    # With the flag's total given to every rank, rank 1's memory buys
    # nothing: both ranks still get only what the 3-layer rank fits.
    same = pp_run({"pp": 2, "kv_bytes": 16 * MiB}, **PARTITION)
    assert [w["blocks"] for w in by_rank(same)] == [85, 85]
    assert stock.result["tokens"] == flag.result["tokens"] == same.result["tokens"]


def test_cpu_worker_respects_kv_cache_memory_bytes(pp_run):
    run = pp_run({"pp": 1, "kv_bytes": 8 * MiB})
    (worker,) = run.result["workers"]
    assert worker["budget"] == 8 * MiB
    assert worker["blocks"] == 8 * MiB // (4 * PAGE) == 32
