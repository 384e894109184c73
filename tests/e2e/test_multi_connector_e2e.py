"""vLLM 0.11.2's MultiConnector over OverlayOffloadingConnector (host
memory, asked first) and SharedKVPoolConnector (the shared pool, asked
second), end to end: real vLLM (CPU) nodes, each its own process, and a
real redis-server.

A node serves its own recent prefixes from host memory and other nodes'
prefixes from the pool; every block a node computes or loads from the pool
goes to its host memory, every block it computes to the pool.  Outputs are
compared with stock vLLM 0.11.2 (overlay disabled, no connector): a
computed pass with stock's cold pass, a pass served from host memory or
the pool with stock serving the same prefix from its device cache (same
hit length, one request at a time: the same schedule), bit for bit.

MultiConnector does not ask for cross-layer blocks (it has no
``prefer_cross_layer_blocks``), so both connectors get stock's per-layer
caches: the layout is chosen once, for both.
"""

from __future__ import annotations

import sys

import pytest

sys.path.insert(0, str(__import__("pathlib").Path(__file__).parents[1]))
from support.redis_server import redis_server  # noqa: E402

STOCK = {"VLLM_OVERLAY_DISABLE": "1"}
BLOCK = 128
HIT = [3 * BLOCK, 2 * BLOCK]  # every full block but a prompt's last token's


@pytest.fixture(scope="module")
def stock():
    """passes[0] cold (computed), passes[1] the same prompts served from
    stock's device prefix cache, one request at a time."""
    from conftest import _memoized

    # The same run as test_shared_pool_e2e's and test_multi_connector_serve's
    # stock: made once per session.
    return _memoized("run_pool.py")(
        {"url": None, "prompts": "shared", "repeat": True}, **STOCK
    )


@pytest.fixture(scope="module")
def nodes():
    """Node A computes; node B (a new process: empty host memory) loads
    from the pool; then every pool value is corrupted and node C loads
    nothing good from the pool: it recomputes."""
    from conftest import LLMRun

    def node(url):
        return LLMRun({"url": url}, {}, "run_multi.py")

    with redis_server() as server:
        a = node(server.url)
        b = node(server.url)
        keys = server.cli("keys", "vkv:*").split()
        for key in keys:  # flip payload bytes behind the header
            server.cli("setrange", key, "1000", "garbage!")
        c = node(server.url)
    assert len(keys) == 5
    return a, b, c


def tokens(run, p=0):
    return [x["tokens"] for x in run.passes[p]]


def logprobs(run, p=0):
    return [x["logprobs"] for x in run.passes[p]]


def cached(run, p=0):
    return [x["cached_tokens"] for x in run.passes[p]]


def moved(run, p: int) -> dict:
    """Blocks each connector moved during pass ``p`` (worker totals)."""
    now = run.result["totals"][p]
    before = run.result["totals"][p - 1] if p else None

    def count(totals, tier, what):
        if totals is None:
            return 0
        if tier == "host":
            return totals["host"][what]["blocks"]
        return totals["pool"][what]

    return {
        f"{tier}_{what}": count(now, tier, w) - count(before, tier, w)
        for tier, what, w in (
            ("host", "load", "load"),
            ("host", "store", "store"),
            ("pool", "load", "loaded_blocks"),
            ("pool", "store", "stored_blocks"),
        )
    }


def assert_equals_stock_hit(run, p, stock) -> None:
    assert cached(run, p) == cached(stock, 1) == HIT
    assert tokens(run, p) == tokens(stock, 1)
    assert logprobs(run, p) == logprobs(stock, 1)


def test_one_layout_for_both_connectors(nodes):
    for run in nodes:
        assert all(not t["cross_layer"] for t in run.result["totals"])
        assert all(t["connector"] == "MultiConnector" for t in run.result["totals"])
        assert "KV connector MultiConnector does not prefer cross-layer" in run.log
        assert "offloading: 4 per-layer caches" in run.log
        assert "KV pool: 4 per-layer caches" in run.log
        assert "the KV connector in front (MultiConnector) does not ask" in run.log
        assert all(t["all_blocks_freed"] for t in run.result["totals"])


def test_own_prefixes_from_host_memory(nodes, stock):
    a = nodes[0]
    # Computed: stock's cold pass; every block stored once in each tier.
    assert cached(a, 0) == [0, 0]
    assert tokens(a, 0) == tokens(stock, 0)
    assert logprobs(a, 0) == logprobs(stock, 0)
    assert moved(a, 0) == {
        "host_load": 0,
        "host_store": 5,
        "pool_load": 0,
        "pool_store": 5,
    }
    # The repeat: host memory and the pool both hold the prefix (the pool
    # lookup found all 5 blocks); the host, asked first, serves it.
    assert a.result["scheduler_pool"]["hits"] == 5
    assert moved(a, 1) == {
        "host_load": 5,
        "host_store": 0,
        "pool_load": 0,
        "pool_store": 0,
    }
    assert_equals_stock_hit(a, 1, stock)


def test_other_nodes_prefixes_from_the_pool_then_host(nodes, stock):
    a, b = nodes[0], nodes[1]
    # New node, empty host memory: the pool serves the prefix, and every
    # loaded block is promoted to host memory (not stored to the pool again).
    assert moved(b, 0) == {
        "host_load": 0,
        "host_store": 5,
        "pool_load": 5,
        "pool_store": 0,
    }
    assert b.result["totals"][0]["pool"]["load_failures"] == 0
    assert (
        b.result["totals"][0]["pool"]["bytes_in"]
        == a.result["totals"][0]["pool"]["bytes_out"]
    )
    assert_equals_stock_hit(b, 0, stock)
    # Its repeat comes from its host memory.
    assert moved(b, 1) == {
        "host_load": 5,
        "host_store": 0,
        "pool_load": 0,
        "pool_store": 0,
    }
    assert_equals_stock_hit(b, 1, stock)


def test_pool_load_failure_recomputes(nodes, stock):
    c = nodes[2]
    pool = c.result["totals"][0]["pool"]
    assert c.result["scheduler_pool"]["hits"] >= 5
    assert pool["load_failures"] == 5 and pool["loaded_blocks"] == 0
    assert "checksum mismatch" in c.log
    assert "Recovered from KV load failure" in c.log
    # Recomputed: stock's cold pass, stored again in both tiers (the bad
    # values were deleted).
    assert tokens(c, 0) == tokens(stock, 0)
    assert logprobs(c, 0) == logprobs(stock, 0)
    assert moved(c, 0)["host_store"] == 5 and moved(c, 0)["pool_store"] == 5
    # Its repeat comes from its host memory.
    assert moved(c, 1) == {
        "host_load": 5,
        "host_store": 0,
        "pool_load": 0,
        "pool_store": 0,
    }
    assert_equals_stock_hit(c, 1, stock)
