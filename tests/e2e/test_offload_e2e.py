"""Offload to host memory and reload, end to end on real vLLM 0.11.2 (CPU).

The prompts' blocks are stored to the host pool, the device prefix cache is
reset, and the same prompts run again: the blocks come back from the host
(the connector's stats say how many).

The reference is stock vLLM serving the same KV from its own device prefix
cache: the stock run skips the reset, so its second pass hits the same
number of tokens and runs the same schedule.  Tokens and logprobs must be
bit-identical to it.  A stock *recompute* is not a bit-exact reference: in
float32 on some CPUs (AVX2 without AVX-512) stock itself differs between a
prefix hit and a recompute by up to ~2e-6.
"""

from __future__ import annotations

STOCK = {"VLLM_OVERLAY_DISABLE": "1"}
BLOCK = 128  # CPU default block size


def loaded_tokens(run) -> int:
    return sum(p["cached_tokens"] for p in run.passes[1])


def assert_same_outputs(run, reference) -> None:
    """Pass 1 (cold) and pass 2 (served from cache) equal the reference's,
    bit for bit, with the same prefix-hit length per prompt."""
    for p in range(2):
        assert [x["cached_tokens"] for x in run.passes[p]] == [
            x["cached_tokens"] for x in reference.passes[p]
        ]
        assert [x["tokens"] for x in run.passes[p]] == [
            x["tokens"] for x in reference.passes[p]
        ]
        assert [x["logprobs"] for x in run.passes[p]] == [
            x["logprobs"] for x in reference.passes[p]
        ]


def test_reload_from_host_equals_stock_device_hit(offload_run):
    stock = offload_run({"keep_device_cache": True}, **STOCK)
    run = offload_run({"connector": "offload"})
    assert run.result["cross_layer"] and run.result["runs_per_block"] == 1
    totals = run.result["totals"]
    # Stores happened in the first pass; the reload came from the host.
    assert run.result["after_first"]["totals"]["store"]["blocks"] >= 6
    assert run.result["after_first"]["totals"]["load"]["blocks"] == 0
    assert totals["load"]["blocks"] * BLOCK == loaded_tokens(run) >= 6 * BLOCK
    assert totals["load"]["bytes"] == totals["load"]["blocks"] * 262144
    # Stock served the same tokens from its device prefix cache.
    assert loaded_tokens(stock) == loaded_tokens(run)
    assert_same_outputs(run, stock)


def test_seeded_sampling_after_reload_equals_stock_device_hit(offload_run):
    """Random sampling with a per-request seed: the reload path samples
    exactly stock's tokens, with stock's logprobs."""
    stock = offload_run({"keep_device_cache": True, "seeded": True}, **STOCK)
    run = offload_run({"connector": "offload", "seeded": True})
    assert run.result["totals"]["load"]["blocks"] >= 6
    greedy = offload_run({"keep_device_cache": True}, **STOCK)
    assert [x["tokens"] for x in stock.passes[1]] != [
        x["tokens"] for x in greedy.passes[1]
    ]  # really sampled
    assert_same_outputs(run, stock)


def test_corrupted_host_blocks_change_the_output(offload_run):
    """The reloaded bytes are really used: zero them and the output moves."""
    stock = offload_run({"keep_device_cache": True}, **STOCK)
    run = offload_run({"connector": "offload", "corrupt": True})
    assert run.result["totals"]["load"]["blocks"] >= 6
    assert [x["tokens"] for x in run.passes[0]] == [
        x["tokens"] for x in stock.passes[0]
    ]
    assert [x["logprobs"] for x in run.passes[1]] != [
        x["logprobs"] for x in stock.passes[1]
    ]


def test_one_copy_per_block_cross_layer_vs_two_per_layer_stock(offload_run):
    stock = offload_run({"keep_device_cache": True}, **STOCK)
    cross = offload_run({"connector": "offload"})
    # CL-06 off: CPU_ATTN has no layers dimension, so per-layer caches.
    per_layer = offload_run({"connector": "offload"}, VLLM_OVERLAY_SKIP_PATCHES="CL-06")
    assert not per_layer.result["cross_layer"]
    layers = 4
    assert per_layer.result["runs_per_block"] == 2 * layers
    for direction in ("store", "load"):
        c = cross.result["totals"][direction]
        p = per_layer.result["totals"][direction]
        assert c["blocks"] == p["blocks"] > 0
        assert p["copy_calls"] == 2 * layers * p["blocks"]
        # One copy per block at most (consecutive blocks merge into one).
        assert 1 <= c["copy_calls"] <= c["blocks"]
    assert_same_outputs(per_layer, stock)


def test_unaligned_device_hit_loads_the_rest(offload_run):
    """Offloaded blocks of 2 cache blocks; the device still holds the first
    cache block, so the load starts in the middle of an offloaded block
    (stock 0.11.2 asserts here).  Reference: stock with the whole prefix
    (4 cache blocks) on the device, the same hit length."""
    stock = offload_run({"unaligned": True, "keep_device_cache": True}, **STOCK)
    run = offload_run({"connector": "offload", "unaligned": True, "block_factor": 2})
    first_prompt = run.passes[1][0]
    assert first_prompt["prompt_tokens"] > 4 * BLOCK
    # 1 cache block from the device + 3 loaded from 2 offloaded blocks.
    assert first_prompt["cached_tokens"] == 4 * BLOCK
    assert run.result["totals"]["load"]["blocks"] == 3 + 2
    assert_same_outputs(run, stock)


def test_transfer_stats_reach_vllm_metrics_log(offload_run):
    """Default (multiprocess) vLLM with stats logging: the connector's stats
    travel worker -> scheduler -> front end and are logged."""
    run = offload_run({"connector": "offload", "multiprocess": True})
    lines = [ln for ln in run.log.splitlines() if "KV Transfer metrics:" in ln]
    stores = [ln for ln in lines if "store_blocks=" in ln]
    loads = [ln for ln in lines if "load_blocks=" in ln]
    assert stores and loads, lines
    logged = sum(int(ln.split("load_blocks=")[1].split(",")[0]) for ln in loads)
    # The front end logs at its interval; the last interval may end after
    # the run, so at least one load and never more than happened.
    assert 1 <= logged <= run.result["totals"]["load"]["blocks"]
    assert run.result["totals"]["load"]["blocks"] >= 6
    assert all("load_copy_calls=" in ln and "load_GB_per_s=" in ln for ln in loads)
