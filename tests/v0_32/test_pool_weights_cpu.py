"""Weights that change under a running engine (issue 39, 2): after an
in-place update and a prefix-cache reset, the pool never serves KV of the
old weights, and engines with the same new weights share again.

Real engines (vLLM 0.32 CPU, the tiny Llama), a real Valkey; the update
goes through the model's ``load_weights``, as RL frameworks do
(``run_weights.py``).  The references are stock 0.32's own runs with the
same new weights.

* Engine A computes the prompts under the old weights (cascaded to the
  pool), its weights change, ``reset_prefix_cache(reset_connector=True)``,
  then the prompts again: stock's tokens and logprobs for the new weights,
  and not one block loaded: its pool values are under the old weights'
  namespace, its new ones under another.  Without KI32-02 it loads the old
  KV and generates other tokens (the issue's run; checked).
* Engine B starts with the same new weights: it loads A's new values from
  the pool, stock's tokens and logprobs (stock's from its own device
  prefix cache).  (Other weights loading nothing is A after its update:
  the old weights' values are in the pool, and it loads none of them.)
"""

from __future__ import annotations

import pytest
from conftest import run

from vllm_overlay.testing.redis import redis_server

pytestmark = pytest.mark.v0_32_b  # tox -e v0_32_b (tox.ini)

VALUES = 4  # the prompts' distinct full blocks (one chunk each)
HITS = [0, 0, 128, 256, 512]  # stock's device hits, one prompt at a time


@pytest.fixture(scope="module")
def pool_url():
    with redis_server(kind="valkey") as url:
        yield url


@pytest.fixture(scope="module")
def stock_new():
    """Stock 0.32 with the new weights from the start (no connector)."""
    return run(
        "run_weights.py",
        {"change_at": "start", "seed": 1, "single": True},
        VLLM_OVERLAY_DISABLE="1",
    )


@pytest.fixture(scope="module")
def updated(pool_url):
    return run(
        "run_weights.py",
        {
            "pool_url": pool_url,
            "change_at": "between",
            "seed": 1,
            "old_values": VALUES,
            "new_values": VALUES,
        },
    )


def tokens(r, name: str) -> list:
    return [x["tokens"] for x in r.result[name]]


def logprobs(r, name: str) -> list:
    return [x["logprobs"] for x in r.result[name]]


def test_after_a_weight_change_no_old_kv_is_loaded(updated, stock_new):
    r = updated.result
    assert r["changed"] == [["model.embed_tokens.weight"]]
    assert r["reset"] is True
    # The update matters: the old weights generate other tokens.
    assert tokens(updated, "old") != tokens(stock_new, "new")
    assert tokens(updated, "new") == tokens(stock_new, "new")
    assert logprobs(updated, "new") == logprobs(stock_new, "new")
    assert r["loads_after"] == r["loads_before"]  # not one block loaded
    # The old values stay (other nodes may still run the old weights);
    # the new weights' values are beside them, in another namespace.
    assert r["old_values"] == VALUES and r["values"] == 2 * VALUES
    assert "the engine's weights changed" in updated.log
    # Measured at start-up by the workers: the CPU backend's own KV write
    # was probed (not named by its parts).
    assert "KV identity (start-up)" in updated.log
    assert "page layout CPU_ATTN:" in updated.log
    assert "could not be probed" not in updated.log


def test_an_engine_with_the_same_new_weights_loads_from_the_pool(
    updated, stock_new, pool_url
):
    assert updated.result["values"] == 2 * VALUES
    same = run(
        "run_weights.py",
        {"pool_url": pool_url, "change_at": "start", "seed": 1, "single": True},
    )
    assert tokens(same, "new") == tokens(stock_new, "new")
    assert same.result["loads_after"] > 0  # its first pass came from the pool
    assert all(same.result["resets"])
    assert field_of(same, "single", "cached_tokens") == HITS
    assert field_of(stock_new, "single", "cached_tokens") == HITS
    assert tokens(same, "single") == tokens(stock_new, "single")
    assert logprobs(same, "single") == logprobs(stock_new, "single")


def field_of(r, name: str, key: str) -> list:
    return [x[key] for x in r.result[name]]
