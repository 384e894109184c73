"""The PP KV budget on vLLM 0.33's own code (``.venv-0.33``, a Python-only
build of its sdist): the flag parsed by 0.33's ``EngineArgs``, the budget
validated by its ``create_engine_config``, and the blocks computed by its
``get_kv_cache_configs`` as ``EngineCore._initialize_kv_caches`` calls it
(four arguments) through the v0_33 set's PP33-04.

No 0.33 engine runs here (no kernels in this build): where an engine's
workers would answer (their KV specs, their memory), a stand-in executor
answers as 0.33's GPU worker does (``determine_available_memory`` returns
``kv_cache_memory_bytes`` when it is set; delta e), and everything from
there on is 0.33's engine core.  The tiny Llama has 4 layers; with
``VLLM_PP_LAYER_PARTITION=3,1`` stage 0 holds 3 of them.
"""

from __future__ import annotations

import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).parents[1]))
from support.engine_core_v033 import (  # noqa: E402
    Executor,
    initialize,
    page_bytes,
)

from vllm_overlay.testing import tiny_model_path  # noqa: E402

MiB = 2**20
FLAG = {"enable_pp_prop_kv_cache": True}


@pytest.fixture(autouse=True)
def overlay():
    import vllm_overlay

    assert vllm_overlay.register() == "applied"


def engine_args(monkeypatch, partition="3,1", **kwargs):
    from vllm.engine.arg_utils import EngineArgs

    monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", partition)
    return EngineArgs(
        model=tiny_model_path(),
        dtype="float32",
        max_model_len=512,
        pipeline_parallel_size=2,
        distributed_executor_backend="mp",
        **kwargs,
    )


def test_the_flag_is_parsed_by_0_33s_engine_args():
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = AsyncEngineArgs.add_cli_args(FlexibleArgumentParser())
    assert "--enable-pp-prop-kv-cache" in parser.format_help()
    args = parser.parse_args(
        ["--model", tiny_model_path(), "--enable-pp-prop-kv-cache"]
        + ["--kv-cache-memory-bytes", "8G", "--pipeline-parallel-size", "2"]
    )
    parsed = AsyncEngineArgs.from_cli_args(args)
    assert parsed.additional_config["enable_pp_prop_kv_cache"] is True
    assert parsed.kv_cache_memory_bytes == 8 * 2**30
    plain = AsyncEngineArgs.from_cli_args(
        parser.parse_args(["--model", tiny_model_path()])
    )
    assert "enable_pp_prop_kv_cache" not in (plain.additional_config or {})


def test_0_33s_create_engine_config_refuses_a_bad_budget(monkeypatch):
    with pytest.raises(ValueError, match="needs --kv-cache-memory-bytes"):
        engine_args(monkeypatch, additional_config=FLAG).create_engine_config()
    with pytest.raises(ValueError, match="'3,3' does not split the model's 4 layers"):
        engine_args(
            monkeypatch, "3,3", kv_cache_memory_bytes=16 * MiB, additional_config=FLAG
        ).create_engine_config()
    config = engine_args(
        monkeypatch, kv_cache_memory_bytes=16 * MiB, additional_config=FLAG
    ).create_engine_config()
    one_block = 3 * page_bytes(config)  # stage 0's block: 3 layers
    small = 2 * one_block  # stage 0 gets 3/4 of it: less than a block
    with pytest.raises(ValueError, match=r"stage 0 \(3 layers\) gets .* one block"):
        engine_args(
            monkeypatch, kv_cache_memory_bytes=small // 2, additional_config=FLAG
        ).create_engine_config()


def test_0_33s_engine_core_sizes_every_stage_from_its_share(monkeypatch):
    """With the flag, 0.33's engine core gives each stage its share of the
    budget by layers (3/4 and 1/4), so both fit the same blocks: the
    budget over all 4 layers' pages.  Without it, upstream's: every stage
    gets the whole budget and all keep the 3-layer stage's block count."""
    budget = 16 * MiB
    flagged = engine_args(
        monkeypatch, kv_cache_memory_bytes=budget, additional_config=FLAG
    ).create_engine_config()
    page = page_bytes(flagged)
    configs = initialize(flagged)
    assert [c.num_blocks for c in configs] == [budget // (4 * page)] * 2
    assert flagged.cache_config.num_gpu_blocks == budget // (4 * page)
    stock = engine_args(
        monkeypatch, kv_cache_memory_bytes=budget
    ).create_engine_config()
    assert [c.num_blocks for c in initialize(stock)] == [budget // (3 * page)] * 2
    # Every stage's tensors hold its layers' pages for those blocks: the
    # whole pipeline's KV memory is the budget (upstream's: 4/3 of it x 2).
    used = [sum(t.size for t in c.kv_cache_tensors) for c in configs]
    assert sum(used) <= budget
    assert used == [budget // (4 * page) * page * n for n in (3, 1)]


def test_without_pp33_04_the_flag_changes_nothing_and_0_32s_wrapper_breaks(
    monkeypatch,
):
    """The patch is what does it: upstream's function (the one PP33-04
    replaced) sizes the flagged config as stock; and 0.32's three-argument
    wrapper (PP32-04) fails 0.33's four-argument call, as every engine start
    would with the 0.32 set."""
    from vllm.v1.attention.backends.utils import resolve_kv_cache_layout
    from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups

    from vllm_overlay.core.patching import REGISTRY
    from vllm_overlay.patches.v0_32 import patch_engine_core as v0_32

    budget = 16 * MiB
    config = engine_args(
        monkeypatch, kv_cache_memory_bytes=budget, additional_config=FLAG
    ).create_engine_config()
    page = page_bytes(config)
    executor = Executor(config)
    specs = executor.specs
    # what the engine core does first (_initialize_kv_caches)
    every = [spec for worker in specs for spec in worker.values()]
    resolve_kv_cache_layout(config, executor.get_supported_kv_cache_layouts(), every)
    groups = get_global_kv_cache_groups(config, specs)
    upstream = REGISTRY.original("PP33-04")
    stock = upstream(config, specs, [budget, budget], groups)
    assert [c.num_blocks for c in stock] == [budget // (3 * page)] * 2
    with pytest.raises(TypeError):
        v0_32.get_kv_cache_configs(config, specs, [budget, budget], groups)
