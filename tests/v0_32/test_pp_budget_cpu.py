"""--enable-pp-prop-kv-cache on real vLLM 0.32 (CPU build), PP=2.

Tiny Llama: 4 layers, 128-token blocks, 64 KiB per block per layer.  With
the flag, --kv-cache-memory-bytes is the pipeline's budget, split by layers
(patch PP32-04 in the engine core): every stage fits the blocks
``core/pp_budget`` predicts.  Stock 0.32 gives every stage the whole budget
and keeps the smallest stage's blocks.  Tokens and logprobs equal stock
0.32 PP=2's: bit for bit one request at a time (the same schedule; no
request waits for blocks in either run), and as a batch (whose steps form by
timing across the stage processes) tokens exactly and logprobs within stock
0.32's measured float32 drift.  The flag's runs keep
``VLLM_CPU_KVCACHE_SPACE=1`` set: the explicit budget wins over it
(PP32-03; stock 0.32's CPU platform replaces it).  Bad configurations fail
at startup with 0.11.2's errors (PP32-03); the command line flag (PP32-01,
PP32-02).
"""

from __future__ import annotations

import pathlib
import sys

import pytest
from conftest import run, run_cases, shared_run

from vllm_overlay.core.pp_budget import StageBudget, split_budget

sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "e2e"))
from tolerances import STOCK_FLOAT32_DRIFT_0_32, max_abs_diff  # noqa: E402

PAGE = 128 * 2 * 2 * 32 * 4  # tokens x K/V x heads x head size x fp32
MiB = 2**20
P31 = {"VLLM_PP_LAYER_PARTITION": "3,1"}
P13 = {"VLLM_PP_LAYER_PARTITION": "1,3"}
FLAG = {"flag": True, "kv_bytes": 16 * MiB}


def predicted(total: int, layers: list[int]) -> list[int]:
    return [
        StageBudget(rank, n, share, PAGE, 128).blocks
        for rank, (n, share) in enumerate(zip(layers, split_budget(total, layers)))
    ]


@pytest.fixture(scope="module")
def stock():
    """Stock 0.32 (the overlay off), the flag's 16 MiB as 8 MiB per stage."""
    return run("run_pp.py", {"kv_bytes": 8 * MiB}, VLLM_OVERLAY_DISABLE="1", **P31)


@pytest.fixture(scope="module")
def flag31():
    """The flag's engine (test_rendered_series compares with it: once)."""
    return shared_run("run_pp.py", FLAG, **P31)


# The front end's checks: with the overlay, and without its front-end
# patches (PP32-02/03, then PP32-01); one process, a forked child each.
CHECKS = {
    name: ({"check": "config"}, env)
    for name, env in (
        ("overlay", {}),
        ("no_validation", {"VLLM_OVERLAY_SKIP_PATCHES": "PP32-02,PP32-03"}),
        ("no_flag", {"VLLM_OVERLAY_SKIP_PATCHES": "PP32-01"}),
    )
}


def config_checks() -> dict:
    """name -> its run (test_rendered_series reads "overlay": once)."""
    return run_cases("run_pp.py", CHECKS)


@pytest.fixture(scope="module")
def config():
    return config_checks()["overlay"].result


def field(run_, name: str) -> list:
    return [w[name] for w in run_.result["workers"]]


def assert_same_outputs(got, want) -> None:
    """One at a time: bit for bit; the batch: tokens, logprobs within drift."""
    assert got.result["single"] == want.result["single"]
    batch, ref = got.result["records"], want.result["records"]
    assert [r["tokens"] for r in batch] == [r["tokens"] for r in ref]
    assert [r["cached_tokens"] for r in batch] == [r["cached_tokens"] for r in ref]
    drift = max_abs_diff([r["logprobs"] for r in batch], [r["logprobs"] for r in ref])
    assert drift <= STOCK_FLOAT32_DRIFT_0_32, drift


@pytest.mark.parametrize("partition", [P31, P13], ids=["3,1", "1,3"])
def test_budget_split_by_layers_gives_equal_blocks(flag31, stock, partition):
    r = flag31 if partition is P31 else run("run_pp.py", FLAG, **partition)
    layers = [int(n) for n in partition["VLLM_PP_LAYER_PARTITION"].split(",")]
    assert field(r, "layers") == layers
    assert field(r, "blocks") == predicted(16 * MiB, layers) == [64, 64]
    # 16 MiB for the whole pipeline: 12 MiB and 4 MiB, all of it used.
    assert field(r, "kv_bytes") == [64 * n * PAGE for n in layers]
    assert sum(field(r, "kv_bytes")) == 16 * MiB
    assert r.result["patches"]["PP32-04"] == "applied"
    # Stock's greedy tokens; logprobs bit for bit one request at a time.
    assert_same_outputs(r, stock)
    lines = [ln for ln in r.log.splitlines() if "vllm-overlay: PP rank" in ln]
    for rank, n in enumerate(layers):
        stage = f"PP rank {rank}: {n} layers"
        assert any(stage in ln and "64 blocks" in ln for ln in lines)


def test_more_blocks_than_stock_for_the_same_memory(flag31, stock):
    # Stock: the budget is per stage, the 3-layer stage sets the blocks:
    # 8 MiB per stage (16 MiB in all) fits 42 blocks, 10.5 MiB used.
    assert field(stock, "blocks") == [8 * MiB // (3 * PAGE)] * 2 == [42, 42]
    assert sum(field(stock, "kv_bytes")) == 42 * 4 * PAGE
    assert field(flag31, "blocks") == [64, 64]
    assert stock.result["outcome"].startswith("disabled")


def test_without_the_engine_core_patch_the_flag_gives_stocks_blocks(flag31):
    r = run("run_pp.py", FLAG, VLLM_OVERLAY_SKIP_PATCHES="PP32-04", **P31)
    assert r.result["patches"]["PP32-04"] == "skipped"
    # Upstream: 16 MiB on each stage; the 3-layer stage fits 85 blocks and
    # the 1-layer stage shrinks to them: 21.25 MiB for 85 blocks.
    assert field(r, "blocks") == [16 * MiB // (3 * PAGE)] * 2 == [85, 85]
    assert field(r, "kv_bytes") == [85 * 3 * PAGE, 85 * PAGE]
    assert "vllm-overlay: PP rank" not in r.log
    assert_same_outputs(r, flag31)


@pytest.mark.parametrize(
    "case, message",
    [
        (
            "no_budget",
            "--enable-pp-prop-kv-cache (additional_config["
            "'enable_pp_prop_kv_cache']) needs --kv-cache-memory-bytes",
        ),
        (
            "bad_partition",
            "--enable-pp-prop-kv-cache: VLLM_PP_LAYER_PARTITION='3,3' does "
            "not split the model's 4 layers over 2 pipeline stages",
        ),
        (
            # 128-token blocks, 512 B per token and layer; shares are
            # proportional, so the first stage is short as well.
            "too_small",
            "pipeline stage 0 (3 layers) gets 98304 B of KV cache, less than "
            "one block for its layers (196608 B)",
        ),
        (
            "not_bool",
            "additional_config['enable_pp_prop_kv_cache'] must be true or "
            "false, got 'yes'",
        ),
    ],
)
def test_bad_configurations_fail_at_startup(config, case, message):
    assert config[case]["error"] == "ValueError"
    assert message in config[case]["message"]


def test_a_good_configuration_and_the_command_line(config):
    assert config["good"] == {"error": None, "value": True}
    flag = config["cli_flag"]["value"]
    assert flag["in_help"]
    assert flag["additional_config"] == {"enable_pp_prop_kv_cache": True}
    assert flag["kv_cache_memory_bytes"] == 8 * 2**30
    no_flag = config["cli_no_flag"]["value"]["additional_config"]
    assert no_flag == {"enable_pp_prop_kv_cache": False}
    assert (
        "enable_pp_prop_kv_cache"
        not in config["cli_plain"]["value"]["additional_config"]
    )


def test_engine_core_split_by_stage_of_each_workers_layers(config):
    split = config["split"]["value"]
    # Workers out of pipeline order; the first kept 1 MiB back from the
    # budget (as the GPU worker does for multimodal buffers); the last has
    # no KV layers and keeps what it reported.
    assert split["split"] == [4 * MiB - MiB, 12 * MiB, 16 * MiB]
    assert (
        "cannot tell which pipeline stage holds the KV layers"
        in (split["unknown_layers"])
    )
    assert split["off"] == [16 * MiB - MiB, 16 * MiB, 16 * MiB]


def test_without_the_front_end_patches():
    carried = config_checks()["no_validation"].result
    # No validation: the bad configurations get past the front end.
    for case in ("no_budget", "too_small"):
        assert carried[case] == {"error": None, "value": True}
    # The flag parses (PP32-01) but does not reach additional_config.
    assert carried["cli_flag"]["value"]["additional_config"] == {}
    unknown = config_checks()["no_flag"]
    assert unknown.result["cli_flag"]["error"] in ("SystemExit", "ArgumentError")
    assert "unrecognized arguments: --enable-pp-prop-kv-cache" in unknown.log
