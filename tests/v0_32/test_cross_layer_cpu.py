"""Cross-layer KV blocks on the CPU platform, vLLM 0.32 (patch CL32-01).

Upstream 0.32 allocates one KV buffer for all layers when the model's KV
cache layout is blocks-outermost (``BLHNC``), but CPU_ATTN offers only
``LBHNC``.  With the overlay, ``VLLM_KV_CACHE_LAYOUT=BLHNC`` (or a connector
asking for it) gives every layer a view of one buffer whose block stride
spans all layers: a block's KV for every layer is one contiguous run.
Tokens and logprobs equal stock 0.32 (its default layout) bit for bit,
cold and from the device prefix cache (same hit lengths).  Without the
patch, vLLM refuses the layout at startup.
"""

from __future__ import annotations

import pytest
from conftest import run

STOCK = {"VLLM_OVERLAY_DISABLE": "1"}
BLHNC = {"VLLM_KV_CACHE_LAYOUT": "BLHNC"}


@pytest.fixture(scope="module")
def stock():
    """Stock 0.32 (passes 0 and 1 here; test_stock_drift_cpu's run, the
    same arguments, made once per session: its one-request passes too)."""
    return run("run_layout.py", {"single": True}, **STOCK)


def assert_equals_stock(r, stock) -> None:
    for p in (0, 1):
        for got, want in zip(r.passes[p], stock.passes[p]):
            assert got["tokens"] == want["tokens"]
            assert got["logprobs"] == want["logprobs"]  # bit for bit
            assert got["cached_tokens"] == want["cached_tokens"]
    assert max(x["cached_tokens"] for x in stock.passes[1]) >= 4 * 128


def test_blhnc_is_one_buffer_with_blocks_outermost(stock):
    r = run("run_layout.py", **BLHNC)
    assert r.result["kv"]["layout"] == "BLHNC"
    assert "Using BLHNC KV cache layout" in r.log
    layers = list(r.result["kv"]["layers"].values())
    assert len(layers) == 4
    assert len({x["storage"] for x in layers}) == 1  # one buffer
    blocks, heads, tokens, width = layers[0]["shape"]
    page = heads * tokens * width  # one layer's block, in elements
    # Each layer's block stride spans every layer's page of that block;
    # the layers lie side by side inside it.
    assert {x["stride"][0] for x in layers} == {len(layers) * page}
    offsets = sorted(x["offset"] for x in layers)
    assert [b - a for a, b in zip(offsets, offsets[1:])] == [page] * 3
    assert_equals_stock(r, stock)


def test_default_layout_is_stock(stock):
    r = run("run_layout.py")
    assert r.result["kv"]["layout"] == stock.result["kv"]["layout"] == "LBHNC"
    assert_equals_stock(r, stock)


@pytest.mark.parametrize("env", [STOCK, {"VLLM_OVERLAY_SKIP_PATCHES": "CL32-01"}])
def test_without_the_patch_vllm_refuses_the_layout(env):
    with pytest.raises(AssertionError) as failed:
        run("run_layout.py", **env, **BLHNC)
    assert "VLLM_KV_CACHE_LAYOUT=BLHNC does not satisfy" in str(failed.value)
    assert "valid layouts: ['LBHNC']" in str(failed.value)
