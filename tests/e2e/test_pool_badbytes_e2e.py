"""Bad bytes in the pool never reach vLLM's outputs nor its prefix cache,
and with a secret the pool's key names reveal nothing and an honest store
replaces a forgery.  Real vLLM 0.11.2 (CPU) nodes, one process each, and a
real redis-server.

On CPU the load thread reads each value straight into its KV block and
checks it afterwards: a refused value has already been written into a live
block.  That is correct only if vLLM never serves nor caches a block whose
load failed.  Node A computes and stores two prompts (3 and 2 full blocks);
the first block of each is then overwritten in redis with a value of the
right length (so the direct path really writes it into the block); node B,
a fresh engine, loads, refuses, recomputes.  Its outputs equal stock's cold
pass bit for bit (the refused first block makes the whole prompt
recompute), and the same prompts again, served from B's device prefix
cache, equal stock serving them from its own (same hit length), bit for
bit: the bad bytes were neither served nor cached.  A node with the checks
switched off (``checks_off``) shows the same bytes, accepted, change every
prompt's output: the test would catch a refused load reported as good.
"""

from __future__ import annotations

import random
import sys

import pytest

sys.path.insert(0, str(__import__("pathlib").Path(__file__).parents[1]))
from conftest import LLMRun  # noqa: E402
from support.redis_server import redis_server  # noqa: E402

from vllm_overlay.core.pool import codec  # noqa: E402

STOCK = {"VLLM_OVERLAY_DISABLE": "1"}
SECRET = "e2e shared secret, long enough"
H = codec.HEADER_BYTES
LAYOUT_AT = slice(32, 40)  # the header's layout tag (see codec's docstring)


def node(config: dict, **env: str) -> LLMRun:
    return LLMRun(config, env, "run_pool_badbytes.py")


@pytest.fixture(scope="module")
def stock():
    """passes[0]: cold (computed); passes[1]: the same prompts from stock's
    device prefix cache."""
    return node({"url": None, "repeat": True}, **STOCK)


def field(run, name: str, p: int = 0) -> list:
    return [x[name] for x in run.passes[p]]


def assert_refused_and_recomputed(b, stock) -> None:
    """B recomputed what it refused (stock's cold pass, bit for bit), and
    then served the prompts from its device prefix cache as stock does."""
    assert b.result["direct"]  # loads were read straight into KV blocks
    assert field(b, "tokens") == field(stock, "tokens")
    assert field(b, "logprobs") == field(stock, "logprobs")
    assert field(b, "cached_tokens", 1) == field(stock, "cached_tokens", 1)
    assert min(field(stock, "cached_tokens", 1)) > 0
    assert field(b, "tokens", 1) == field(stock, "tokens", 1)
    assert field(b, "logprobs", 1) == field(stock, "logprobs", 1)
    assert b.result["all_blocks_freed"]
    assert "Recovered from KV load failure" in b.log


def values(client, keys) -> dict:
    return {k: client.get(k) for k in keys}


def test_refused_bytes_are_never_served_nor_cached(stock):
    import redis

    with redis_server() as server:
        client = redis.Redis.from_url(server.url)
        a = node({"url": server.url})
        keys = a.result["keys"]
        assert keys == a.result["plain_keys"]  # no secret: unchanged names
        assert [len(k) for k in keys] == [3, 2]
        original = values(client, [k for ks in keys for k in ks])
        assert all(original.values()) and a.result["worker"]["stored_blocks"] == 5
        first, second = keys[0][0], keys[1][0]
        # Garbage of the right length (bad header and payload), and a good
        # header over another block's payload (checksum mismatch).
        client.set(first, random.Random(0).randbytes(len(original[first])))
        client.set(second, original[second][:H] + original[keys[0][1]][H:])
        unchecked = node({"url": server.url, "checks_off": True})
        b = node({"url": server.url, "repeat": True})
        after = values(client, original)
    # Accepted, those bytes change each prompt's output.
    assert unchecked.result["direct"]
    assert unchecked.result["worker"]["loaded_blocks"] == 5
    for got, want in zip(unchecked.passes[0], stock.passes[1]):
        assert got["logprobs"] != want["logprobs"]
    assert_refused_and_recomputed(b, stock)
    worker = b.result["worker"]
    assert b.result["scheduler"]["hits"] == 5
    assert worker["load_failures"] == 2 and worker["bad_signatures"] == 0
    assert worker["loaded_blocks"] == 3  # read, then recomputed after block 0
    # Both values were deleted and B's recomputed blocks stored again: the
    # pool holds A's values again, byte for byte.
    assert worker["stored_blocks"] == 2
    assert after == original


def forged_signature(value: bytes, payload: bytes, ns: bytes, key: bytes) -> bytes:
    """``value``'s header over ``payload``, checksum fixed, flagged signed,
    MAC kept: what a writer without the secret can produce."""
    head = bytearray(codec.encode_header(ns, key, payload, value[LAYOUT_AT]))
    head[6] |= codec.SIGNED
    head[H - 16 :] = value[H - 16 : H]
    return bytes(head) + payload


def hex_pieces(texts: list[str]) -> set[str]:
    return {t[i : i + 8] for t in texts for i in range(len(t) - 7)}


def test_signed_pool_names_reveal_nothing_and_forgeries_are_replaced(stock):
    import redis

    with redis_server() as server:
        client = redis.Redis.from_url(server.url)
        a = node({"url": server.url, "secret": SECRET})
        keys, plain = a.result["keys"], a.result["plain_keys"]
        stored = {k.decode() for k in client.scan_iter("*")}
        assert stored == {k for ks in keys for k in ks}
        # A reader without the secret computes the keys of a prompt it
        # guesses (namespace and chain hash): none of them exists, and no
        # stored key contains 8 hex digits of the namespace or a chain hash.
        assert client.exists(*[k for ks in plain for k in ks]) == 0
        pieces = hex_pieces([a.result["namespace"], *sum(a.result["chains"], [])])
        assert not any(p in k for k in stored for p in pieces)
        original = values(client, sorted(stored))
        ns = bytes.fromhex(a.result["namespace"])
        first, second = keys[0][0], keys[1][0]
        wrong = original[keys[0][1]][H:]  # another block's payload
        # Unsigned with a valid checksum; signed-looking with a wrong MAC.
        client.set(
            first, codec.encode(ns, first.encode(), wrong, original[first][LAYOUT_AT])
        )
        client.set(
            second, forged_signature(original[second], wrong, ns, second.encode())
        )
        b = node({"url": server.url, "secret": SECRET, "repeat": True})
        after = values(client, original)
        c = node({"url": server.url, "secret": SECRET})
    assert_refused_and_recomputed(b, stock)
    worker = b.result["worker"]
    assert worker["load_failures"] == 2 and worker["bad_signatures"] == 2
    assert worker["loaded_blocks"] == 3
    # Deleted, and B's honest values (A's, byte for byte) written again...
    assert worker["stored_blocks"] == 2
    assert after == original
    # ...which a third node loads: stock serving them from its device cache.
    assert c.result["scheduler"]["hits"] == 5
    assert c.result["worker"]["loaded_blocks"] == 5
    assert c.result["worker"]["load_failures"] == 0
    assert field(c, "cached_tokens") == field(stock, "cached_tokens", 1)
    assert field(c, "tokens") == field(stock, "tokens", 1)
    assert field(c, "logprobs") == field(stock, "logprobs", 1)
