"""vLLM 0.32 whose weights change in place, as an RL loop changes them,
with or without the pool tier, printed as JSON.

The change goes through the model's own ``load_weights`` (what RL
frameworks call; on CPU the linear layers run from weights packed at load
time, so the token embeddings are what changes): seeded noise added to
``model.embed_tokens.weight``.

Config:
* ``pool_url``: host memory plus the overlay's ``SharedPoolTier``
  (``TieringOffloadingSpec``); without it stock vLLM 0.32, no connector.
* ``change_at``: ``"start"`` (the engine runs the new weights from the
  first request) or ``"between"`` (a pass of the prompts under the old
  weights, its values cascaded to the pool, then the change and
  ``reset_prefix_cache(reset_connector=True)``).
* ``seed``: the noise's seed (same seed, same new weights).
* ``single``: after the ``new`` pass, each prompt alone; with the pool the
  device prefix cache is emptied before each (the blocks come from the
  pool), stock keeps it (its own device hits: the reference).

Result: the passes (``old``, ``new``, ``single``), the worker's blocks
loaded before and after the ``new`` pass, the pool's values.
"""

from __future__ import annotations

import json
import os
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "e2e"))
from result_out import emit  # noqa: E402
from run_llm import prompts  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).parent))  # before e2e's run_offload
sys.modules.pop("run_offload", None)
from run_offload import extra_config, generate  # noqa: E402

from vllm_overlay.testing import cpu_defaults, tiny_engine_args  # noqa: E402
from vllm_overlay.testing.v0_32 import connector_info  # noqa: E402

DEADLINE_S = 120.0


def perturb(model, seed: int) -> list[str]:
    """New token embeddings through ``load_weights`` (runs in the worker)."""
    import torch

    weight = model.model.embed_tokens.weight
    noise = torch.randn(weight.shape, generator=torch.Generator().manual_seed(seed))
    new = (weight.detach() + 0.05 * noise).to(weight.dtype)
    return sorted(model.load_weights([("model.embed_tokens.weight", new)]))


def pool_values(url: str) -> int:
    import redis

    with redis.Redis.from_url(url, socket_timeout=5) as client:
        return client.dbsize()


def main(config: dict) -> dict:
    cpu_defaults()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # apply_model's fn
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    url = config.get("pool_url")
    kv = None
    if url:
        kv = KVTransferConfig(
            kv_connector="OffloadingConnector",
            kv_role="kv_both",
            kv_connector_extra_config=extra_config(config),
        )
    llm = LLM(**tiny_engine_args(kv_transfer_config=kv))
    seed = config.get("seed", 1)

    def change() -> list:
        return llm.apply_model(lambda model: perturb(model, seed))

    def loaded() -> int:
        return llm.collective_rpc(connector_info)[0]["blocks"]["load"] if kv else 0

    def settle(at_least: int) -> int:
        """Step until the pool holds ``at_least`` values (the cascades of
        finished stores run as the engine steps), with a deadline."""
        deadline = time.monotonic() + DEADLINE_S
        while pool_values(url) < at_least and time.monotonic() < deadline:
            llm.generate(["flush"], SamplingParams(max_tokens=1), use_tqdm=False)
            time.sleep(0.2)
        return pool_values(url)

    out: dict = {}
    if config["change_at"] == "start":
        out["changed"] = change()
    else:
        out["old"] = generate(llm, prompts())
        out["old_values"] = settle(config.get("old_values", 1))
        out["changed"] = change()
        out["reset"] = llm.reset_prefix_cache(reset_connector=True)
    out["loads_before"] = loaded()
    out["new"] = generate(llm, prompts())
    out["loads_after"] = loaded()
    if url:
        out["values"] = settle(out.get("old_values", 0) + config.get("new_values", 1))
    if config.get("single"):
        single = []
        for text in prompts():
            if url:
                out.setdefault("resets", []).append(llm.reset_prefix_cache())
            single += generate(llm, [text])
        out["single"] = single
        out["loads_single"] = loaded()
    return out


if __name__ == "__main__":
    emit(main(json.loads(sys.argv[1])))
