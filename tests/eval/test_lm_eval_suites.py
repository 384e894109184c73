"""lm-eval suites: every KV path gives stock vLLM's results, sample by sample.

Real lm-eval 0.4.13 and real vLLM 0.11.2 (CPU) on the copy model
(eval/model/copy_llama) and its local tasks; the config with the expected
values is eval/configs/copy-llama.yaml.  Each path runs in a process of
its own, forked from one that imported vLLM.
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
from run_eval import load_config  # noqa: E402
from support.redis_server import redis_server  # noqa: E402
from support.zygote_client import runner  # noqa: E402

sys.path.insert(0, str(ROOT / "tests" / "e2e"))
from tolerances import STOCK_FLOAT32_DRIFT  # noqa: E402

CONFIG = load_config(DEFAULT_CONFIG)
# Each path's process is forked from the session's zygote (vLLM imported
# once: tests/support/run_zygote.py); OVERLAY_TESTS_FORK=0: a fresh one.
run_path = functools.partial(check_suite.run_path, runner=runner())


@pytest.fixture(scope="module")
def stock() -> dict:
    return run_path(DEFAULT_CONFIG, "stock")


def test_config_is_in_vllm_lm_eval_style():
    first = DEFAULT_CONFIG.read_text().splitlines()[0]
    assert first.startswith("# ") and "run_eval.py" in first
    assert "--path stock" in first
    for task in CONFIG["tasks"]:
        assert all("name" in m and "value" in m for m in task["metrics"])
    assert set(CONFIG["paths"]) == {"stock", "cross", "offload", "pool", "pp"}


def test_stock_reaches_the_expected_values(stock):
    assert expected_problems(CONFIG, stock) == []
    assert stock["metrics"]["copy_mc"]["acc,none"] == 1.0
    assert len(stock["samples"]["copy_mc"]) == 48
    assert all(len(choices) == 8 for choices in stock["samples"]["copy_mc"])


def test_cross_layer_equals_stock(stock):
    result = run_path(DEFAULT_CONFIG, "cross")
    assert check(CONFIG, result, stock) == []
    assert result["samples"] == stock["samples"]


def test_pp_equals_stock_within_its_batch_drift(stock):
    """PP=2 runs its stages in processes of their own, whose steps form
    their batches by timing (CI once saw 1 of 48 loglikelihoods differ in
    the last bits): the metrics and every generated text equal stock's, and
    each loglikelihood is within stock's own float32 batch drift."""
    result = run_path(DEFAULT_CONFIG, "pp")
    assert expected_problems(CONFIG, result) == []
    assert result["metrics"] == stock["metrics"]
    assert result["samples"].keys() == stock["samples"].keys()
    worst = 0.0
    for task, samples in stock["samples"].items():
        got = result["samples"][task]
        assert len(got) == len(samples)
        for mine, theirs in zip(got, samples):
            assert len(mine) == len(theirs)
            for a, b in zip(mine, theirs):
                if isinstance(b, float):
                    worst = max(worst, abs(a - b))
                else:
                    assert a == b  # generated text
    assert worst <= STOCK_FLOAT32_DRIFT, worst


def test_offload_reload_equals_stock(stock):
    result = run_path(DEFAULT_CONFIG, "offload")
    assert check(CONFIG, result, stock) == []
    assert result["samples"] == stock["samples"]
    # The scored pass really ran on KV loaded back from host memory.
    assert result["connector_totals"]["load"]["blocks"] > 0
    assert expected_problems(CONFIG, {"metrics": result["first_pass_metrics"]}) == []


def test_pool_reload_equals_stock(stock):
    with redis_server() as server:
        result = run_path(DEFAULT_CONFIG, "pool", server.url)
    assert check(CONFIG, result, stock) == []
    assert result["samples"] == stock["samples"]
    assert result["connector_totals"]["loaded_blocks"] > 0
    assert result["connector_totals"]["load_failures"] == 0


def test_broken_layout_fails_the_suite(stock):
    """Every layer reading layer 0's KV: the suite must say FAIL."""
    result = run_path(DEFAULT_CONFIG, "cross", break_layout=True)
    problems = check(CONFIG, result, stock)
    assert any("copy_gen exact_match" in p for p in problems)
    assert any("samples differ from stock" in p for p in problems)
    assert result["metrics"]["copy_gen"]["exact_match,none"] < 0.5
