"""``vllm serve`` of vLLM 0.32 with the overlay: the copy model served over
HTTP (OpenAI completions) on a cross-layer and on an offloading
configuration gives stock 0.32's tokens and logprobs, bit for bit.

Three real servers, one after the other, each with the engine arguments of
eval/configs/copy-llama.yaml (EngineCore in its own process, as ``vllm
serve`` runs it):

* stock: ``VLLM_OVERLAY_DISABLE=1``;
* cross-layer: ``VLLM_KV_CACHE_LAYOUT=BLHNC`` (patch CL32-01);
* offloading: ``--kv-transfer-config`` naming upstream's
  ``OffloadingConnector`` with ``cpu_bytes_to_use`` (patch OF32-01);
* two nodes sharing the pool tier (``TieringOffloadingSpec`` with the
  overlay's ``SharedPoolTier``): node B serves node A's prefixes.

Each gets the same copy prompts one request at a time, twice: cold, then
with the prompts' full blocks cached (stock and cross-layer: the device
prefix cache; offloading: host memory, after ``/reset_prefix_cache``
emptied the device cache).  One request at a time the schedule is stock's,
so tokens, logprobs and cached-token counts must equal stock's.  The
server logs must show the overlay's patch set applied and the path chosen.
"""

from __future__ import annotations

import json
import pathlib
import random
import sys
import time
import urllib.request

import pytest
import redis

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "eval"))
sys.path.insert(0, str(ROOT / "tests"))
from check_suite import DEFAULT_CONFIG  # noqa: E402
from run_eval import load_config  # noqa: E402
from support.served_vllm import (  # noqa: E402
    SERVED_NAME,
    complete,
    harness_env,
    post,
    served_model,
)

from vllm_overlay.testing.redis import redis_server  # noqa: E402

CONFIG = load_config(DEFAULT_CONFIG)
BLOCK = 128  # vLLM 0.32's block size on CPU
OFFLOAD = {
    "kv_connector": "OffloadingConnector",
    "kv_role": "kv_both",
    "kv_connector_extra_config": {
        "cpu_bytes_to_use": CONFIG["offload_cpu_bytes_to_use"]
    },
}
APPLIED = "vllm-overlay 0.1.0 applied to vLLM 0.32.0 (patch set v0_32)"
CONFIGS = {
    "stock": ([], {"VLLM_OVERLAY_DISABLE": "1"}),
    "cross": ([], {"VLLM_KV_CACHE_LAYOUT": "BLHNC"}),
    "offload": (["--kv-transfer-config", json.dumps(OFFLOAD)], {}),
}


def prompts(n: int = 4, seed: int = 11) -> list[str]:
    """Copy prompts (a random sequence, the separator, its first tokens):
    1 to 3 full blocks each."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        seq = [f"t{rng.randrange(64):02d}" for _ in range(rng.randint(200, 400))]
        out.append(" ".join(seq) + " | " + " ".join(seq[: rng.randint(5, 50)]))
    return out


def step(port: int) -> None:
    """A one-token request: the engine steps (finished stores complete)."""
    post(
        port,
        "/v1/completions",
        {"model": SERVED_NAME, "prompt": "t00", "max_tokens": 1},
    )
    time.sleep(0.5)


def reset_prefix_cache(port: int, deadline_s: float = 60.0) -> None:
    """Empty the device prefix cache once the connector's stores are done
    (the reset fails while blocks are held: one-token requests let
    stores finish)."""
    deadline = time.monotonic() + deadline_s
    while not post(port, "/reset_prefix_cache")["success"]:
        assert time.monotonic() < deadline, "the device prefix cache stayed held"
        step(port)


def serve(name: str, tmp: pathlib.Path) -> dict:
    extra, env = CONFIGS[name]
    log = tmp / f"serve-{name}.log"
    flags = ["--enable-prompt-tokens-details", *extra]
    env = harness_env(VLLM_SERVER_DEV_MODE="1", **env)  # /reset_prefix_cache
    with served_model(CONFIG, log, flags, env) as port:
        cold = [complete(port, p) for p in prompts()]
        if name == "offload":
            reset_prefix_cache(port)
        cached = [complete(port, p) for p in prompts()]
    return {"passes": [cold, cached], "log": log.read_text(errors="replace")}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve")
    return {}, tmp


def served(runs, name: str) -> dict:
    done, tmp = runs
    if name not in done:
        done[name] = serve(name, tmp)
    return done[name]


def test_stock_serves_the_copies_from_its_device_prefix_cache(runs):
    stock = served(runs, "stock")
    assert "vllm-overlay: disabled by VLLM_OVERLAY_DISABLE" in stock["log"]
    cold, cached = stock["passes"]
    assert [x["cached_tokens"] for x in cold] == [0] * len(cold)
    hits = [x["cached_tokens"] for x in cached]
    assert all(h > 0 and h % BLOCK == 0 for h in hits), hits
    assert [x["tokens"] for x in cached] == [x["tokens"] for x in cold]
    # The copy model copies: each completion continues the sequence.
    for p, x in zip(prompts(), cold):
        seq, start = p.split(" | ")
        k = len(start.split())
        assert x["text"].split() == seq.split()[k : k + len(x["text"].split())]


@pytest.mark.parametrize("name", ["cross", "offload"])
def test_served_path_equals_stock(runs, name):
    stock, run = served(runs, "stock"), served(runs, name)
    assert APPLIED in run["log"]
    if name == "cross":
        assert "Using BLHNC KV cache layout" in run["log"]
    else:
        assert "vllm-overlay CPU offloading worker" in run["log"]
    # The second pass is served from cache: the device prefix cache, or
    # (offload) host memory, since the device cache was emptied.
    assert all(x["cached_tokens"] > 0 for x in run["passes"][1])
    for p in (0, 1):
        assert run["passes"][p] == stock["passes"][p], p  # tokens, logprobs, hits


def pool_tier_config(url: str) -> dict:
    """Upstream's OffloadingConnector, TieringOffloadingSpec: host memory
    first, the overlay's pool tier second."""
    extra = dict(OFFLOAD["kv_connector_extra_config"])
    extra["spec_name"] = "TieringOffloadingSpec"
    extra["secondary_tiers"] = [
        {
            "type": "SharedPoolTier",
            "module_path": "vllm_overlay.integration.v0_32.pool_tier",
            "url": url,
        }
    ]
    return {**OFFLOAD, "kv_connector_extra_config": extra}


def wait_for_values(url: str, port: int, count: int, deadline_s: float = 60.0):
    """Until the pool holds ``count`` values (one-token requests step the
    engine, so finished stores cascade to the pool)."""
    client = redis.Redis.from_url(url)
    deadline = time.monotonic() + deadline_s
    while client.dbsize() < count:
        assert time.monotonic() < deadline, f"{client.dbsize()} of {count} values"
        post(
            port,
            "/v1/completions",
            {"model": SERVED_NAME, "prompt": "t00", "max_tokens": 1},
        )
        time.sleep(0.5)


def metric(text: str, name: str, **labels: str) -> float:
    """The sum of a Prometheus sample ``name`` over the series with ``labels``."""
    total = 0.0
    for line in text.splitlines():
        head, _, value = line.rpartition(" ")
        if head.split("{")[0] == name and all(
            f'{k}="{v}"' in head for k, v in labels.items()
        ):
            total += float(value)
    return total


def test_two_served_nodes_share_the_pool_tier(runs, tmp_path):
    """Node A serves the copy prompts (its blocks cascade from host memory
    to the pool); node B, a second ``vllm serve`` on the same pool while A
    runs, serves them from the pool: stock's tokens, logprobs and hit
    lengths (stock's hits: its device prefix cache), reported by vLLM's own
    metrics as hits from the external tier, and the tier's counters."""
    stock = served(runs, "stock")
    blocks = sum(x["cached_tokens"] for x in stock["passes"][1]) // BLOCK
    with redis_server() as url:
        flags = [
            "--enable-prompt-tokens-details",
            "--kv-transfer-config",
            json.dumps(pool_tier_config(url)),
        ]
        env = harness_env(VLLM_SERVER_DEV_MODE="1")
        with served_model(CONFIG, tmp_path / "node-a.log", flags, env) as a:
            cold = [complete(a, p) for p in prompts()]
            wait_for_values(url, a, blocks)
            with served_model(CONFIG, tmp_path / "node-b.log", flags, env) as b:
                loaded = [complete(b, p) for p in prompts()]
                with urllib.request.urlopen(f"http://127.0.0.1:{b}/metrics") as r:
                    metrics = r.read().decode()
    assert cold == stock["passes"][0]
    assert loaded == stock["passes"][1]  # tokens, logprobs, cached tokens
    hits = sum(x["cached_tokens"] for x in loaded)
    by_source = "vllm:prompt_tokens_cached_by_source_total"
    assert metric(metrics, by_source, source="external_unspecified") == hits
    assert metric(metrics, by_source, source="host") == 0
    assert metric(metrics, "vllm:kv_offload_pool_loaded_blocks_total") == blocks
    log = (tmp_path / "node-b.log").read_text(errors="replace")
    assert "vllm-overlay KV pool tier: redis://" in log
