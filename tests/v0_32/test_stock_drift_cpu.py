"""Stock vLLM 0.32's own float32 drift between a device prefix-cache hit and
a recompute of the same prompts, and between two schedules of the same
hits (the premise of tests/e2e/tolerances.py, measured again on 0.32 on
whatever machine runs the suite).

The tiny Llama, overlay disabled: a batch of prompts of 1 to 5 blocks,
recomputed, then served from the device prefix cache (128 to 512 tokens of
each multi-block prompt); and each prompt alone, after the cache is emptied
(a recompute), then again (a hit).  Tokens must be equal; logprobs within
``STOCK_FLOAT32_DRIFT_0_32``.  The printed figures are this machine's drift.
"""

from __future__ import annotations

import pathlib
import sys

import pytest
from conftest import run

sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "e2e"))
from tolerances import STOCK_FLOAT32_DRIFT_0_32, max_abs_diff  # noqa: E402

BLOCK = 128  # vLLM 0.32's block size on CPU


@pytest.fixture(scope="module")
def stock():
    """Stock 0.32 (test_cross_layer_cpu's reference too: once per session)."""
    return run("run_layout.py", {"single": True}, VLLM_OVERLAY_DISABLE="1")


def field(r, p: int, name: str) -> list:
    return [x[name] for x in r.passes[p]]


def drift(r, recompute: int, hit: int) -> float:
    """Over the prompts the hit pass served more of from the device cache."""
    served = [
        i
        for i, (h, c) in enumerate(zip(r.passes[hit], r.passes[recompute]))
        if h["cached_tokens"] > c["cached_tokens"]
    ]
    assert served
    return max_abs_diff(
        [r.passes[hit][i]["logprobs"] for i in served],
        [r.passes[recompute][i]["logprobs"] for i in served],
    )


@pytest.mark.parametrize(
    "name, recompute, hit", [("batched", 0, 1), ("one request", 2, 3)]
)
def test_stock_drift_is_within_the_stated_tolerance(stock, name, recompute, hit):
    hits = field(stock, hit, "cached_tokens")
    assert hits[2:] == [BLOCK, 2 * BLOCK, 4 * BLOCK]  # 1, 2 and 4 full blocks
    assert all(
        h > c for h, c in zip(hits[2:], field(stock, recompute, "cached_tokens")[2:])
    )
    if name == "one request":
        assert field(stock, recompute, "cached_tokens") == [0] * 5
    assert field(stock, hit, "tokens") == field(stock, recompute, "tokens")
    measured = drift(stock, recompute, hit)
    print(f"stock vLLM 0.32 float32 drift, hit vs recompute, {name}: {measured:.3g}")
    assert measured <= STOCK_FLOAT32_DRIFT_0_32


def test_stock_schedule_drift_is_within_the_stated_tolerance(stock):
    """The same prompts and hit lengths, batched vs one request at a time:
    what a batch whose requests wait for async loads may see."""
    assert field(stock, 1, "cached_tokens") == field(stock, 3, "cached_tokens")
    assert field(stock, 1, "tokens") == field(stock, 3, "tokens")
    measured = max_abs_diff(field(stock, 1, "logprobs"), field(stock, 3, "logprobs"))
    print(f"stock vLLM 0.32 float32 drift, batched vs one request: {measured:.3g}")
    assert measured <= STOCK_FLOAT32_DRIFT_0_32
