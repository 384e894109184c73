"""Both KV connectors under pipeline parallelism: real vLLM 0.11.2 (CPU),
PP=2 with the uneven partitions 1,3 and 3,1 of the 4-layer tiny Llama.

The scheduler hands every stage the same host block ids, so every stage's
host pool must hold the same number of blocks (each of its own layers).
Sized from each process's own stage, a 3-layer stage got fewer blocks than
the scheduler handed out and the engine died (``IndexError: packed ids must
be in [0, 16)``); a 1-layer stage took three times its share.

One engine per case (``run_pp_connectors.py``): a pressure batch with more
blocks than the host pool holds, a batch whose blocks are stored, then the
same prompts again after a prefix cache reset (loaded back), in one batch
and one request at a time.  The reference is stock vLLM with PP=2 and the
same partition, which serves those passes from its own device prefix cache
(no reset): the same hit lengths.  One request at a time the schedule is
stock's, so logprobs are bit-identical; a batch whose requests wait for
their loads (or, with the pool, for their lookups) can be scheduled
differently, so there logprobs are compared within ``STOCK_FLOAT32_DRIFT``
(tests/e2e/tolerances.py).
"""

from __future__ import annotations

import sys

import pytest
from tolerances import STOCK_FLOAT32_DRIFT, max_abs_diff

sys.path.insert(0, str(__import__("pathlib").Path(__file__).parents[1]))
from support.redis_server import redis_server  # noqa: E402

STOCK = {"VLLM_OVERLAY_DISABLE": "1"}
LAYER_BLOCK = 128 * 2 * 2 * 32 * 4  # one 128-token block of one layer, fp32
HOST_BLOCKS = 16
CPU_BYTES = HOST_BLOCKS * 4 * LAYER_BLOCK  # 16 blocks of the whole model
COLD_BLOCKS = [4, 3, 2]  # full blocks of the prompts loaded back
PARTITIONS = ["1,3", "3,1"]
PHASES = ("pressure", "cold", "reload_batch", "reload_single")

_stock: dict[str, object] = {}


def run(config: dict, partition: str, **env: str):
    from conftest import LLMRun

    return LLMRun(
        config,
        {"VLLM_PP_LAYER_PARTITION": partition, **env},
        "run_pp_connectors.py",
    )


def stock_run(partition: str):
    if partition not in _stock:
        _stock[partition] = run({"keep_device_cache": True}, partition, **STOCK)
    return _stock[partition]


def phase(r, name: str, key: str) -> list:
    return [x[key] for x in r.result["phases"][name]]


def assert_equals_stock(r, stock, exact: tuple[str, ...]) -> None:
    """Tokens and hit lengths of every phase are stock's; logprobs of the
    phases in ``exact`` bit for bit (the same schedule), of the others
    within ``STOCK_FLOAT32_DRIFT``."""
    for name in PHASES:
        assert phase(r, name, "tokens") == phase(stock, name, "tokens"), name
        assert phase(r, name, "cached_tokens") == phase(stock, name, "cached_tokens"), (
            name
        )
        got, want = phase(r, name, "logprobs"), phase(stock, name, "logprobs")
        if name in exact:
            assert got == want, name
        else:
            assert max_abs_diff(got, want) <= STOCK_FLOAT32_DRIFT, name
    # Every full block of the reloaded prompts was served from cache.
    loaded = [n * 128 for n in COLD_BLOCKS]
    assert phase(r, "reload_batch", "cached_tokens") == loaded
    assert phase(r, "reload_single", "cached_tokens") == loaded


def by_stage(r) -> list[dict]:
    return sorted(r.result["workers"], key=lambda w: w["pp_rank"])


@pytest.mark.parametrize("partition", PARTITIONS)
def test_offloading_under_pp(partition):
    r = run({"connector": "offload", "cpu_bytes": CPU_BYTES}, partition)
    layers = [int(n) for n in partition.split(",")]
    stages = by_stage(r)
    # The same blocks everywhere: cpu_bytes is for the whole model, split
    # by layers (the scheduler's pool and every stage's).
    assert r.result["scheduler_host_blocks"] == HOST_BLOCKS
    assert [w["host_blocks"] for w in stages] == [HOST_BLOCKS, HOST_BLOCKS]
    assert [w["host_bytes"] for w in stages] == [
        HOST_BLOCKS * n * LAYER_BLOCK for n in layers
    ]
    assert sum(w["host_bytes"] for w in stages) == CPU_BYTES
    # The scheduler says how cpu_bytes was read and what each stage holds.
    log = [ln for ln in r.log.splitlines() if "vllm-overlay offloading" in ln]
    assert any(
        f"cpu_bytes={CPU_BYTES} for all 4 layers" in ln
        and f"{HOST_BLOCKS} blocks of 128 tokens on every pipeline stage" in ln
        and f"hold {[w['host_bytes'] for w in stages]} B" in ln
        for ln in log
    ), log
    # Pressure: more blocks were stored than the pool holds (it evicted).
    before = sorted(r.result["after_cold"]["workers"], key=lambda w: w["pp_rank"])
    stores = [w["totals"]["store"]["blocks"] for w in before]
    assert stores[0] == stores[1] > HOST_BLOCKS
    assert [w["totals"]["load"]["blocks"] for w in before] == [0, 0]
    # Both reload passes loaded every full block, on both stages.
    for w, n in zip(stages, layers):
        load = w["totals"]["load"]
        assert load["blocks"] == 2 * sum(COLD_BLOCKS)
        assert load["bytes"] == load["blocks"] * n * LAYER_BLOCK
    # Offloading looks up synchronously: only the batch whose requests wait
    # for their loads may be scheduled differently from stock's.
    assert_equals_stock(
        r, stock_run(partition), exact=("pressure", "cold", "reload_single")
    )


@pytest.mark.parametrize("partition", PARTITIONS)
def test_shared_pool_under_pp(partition):
    with redis_server() as server:
        r = run({"connector": "pool", "url": server.url}, partition)
    layers = [int(n) for n in partition.split(",")]
    stages = by_stage(r)
    for w, n in zip(stages, layers):
        assert w["stored_blocks"] >= 12 * 2 + sum(COLD_BLOCKS)
        assert w["loaded_blocks"] == 2 * sum(COLD_BLOCKS)
        assert w["load_failures"] == 0
        assert w["bytes_in"] >= w["loaded_blocks"] * n * LAYER_BLOCK
    # Lookups found them (the scheduler looks up every stage's keys).
    assert r.result["scheduler"]["hits"] >= 2 * sum(COLD_BLOCKS)
    # A batch waits for its pool lookups (on a background thread), so it may
    # be scheduled differently from stock's; one request at a time may not.
    assert_equals_stock(r, stock_run(partition), exact=("reload_single",))
