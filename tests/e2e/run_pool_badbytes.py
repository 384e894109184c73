"""One vLLM node of the bad-bytes tests (CPU build, shared pool); prints JSON.

    python run_pool_badbytes.py '{"url": "redis://127.0.0.1:6379", ...}'

Config: ``url`` (null: no pool, stock run), ``secret`` (a shared secret,
handed to the connector through ``secret_env``), ``repeat`` (run the prompts
a second time in the same engine: served from its device prefix cache),
``checks_off`` (this process accepts every value it loads unchecked: what
the node would do without the protection under test; never in production).

The result has, besides the passes and the pool counters, the keys of each
prompt's full blocks as this node computes them (``keys``) and as a reader
without the secret would (``plain_keys``), the chain hashes, and whether
loads are read straight into KV blocks (``direct``).
"""

from __future__ import annotations

import json
import os
import sys

from run_pool import prompts, worker_pool_totals

from vllm_overlay.testing import cpu_defaults, in_process_engine, tiny_engine_args
from vllm_overlay.testing.v0_11_2 import TEST_POOL_OPTIONS, pool_connector

SECRET_ENV = "VKV_E2E_BADBYTES_SECRET"


def reads_in_place(worker) -> bool:
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    return get_kv_transfer_group().connector_worker._cache_rows is not None


def block_keys(connector, outputs) -> dict:
    """Each prompt's chain hashes and keys, from the connector's own chain."""
    import types

    from vllm_overlay.core.pool.keys import pool_key

    side = connector.connector_scheduler
    name_key = connector.config.name_key
    out = {"chains": [], "keys": [], "plain_keys": []}
    for i, o in enumerate(outputs):
        request = types.SimpleNamespace(
            request_id=f"keys-{i}",
            all_token_ids=list(o.prompt_token_ids),
            num_tokens=len(o.prompt_token_ids),
            lora_request=None,
            mm_features=[],
            cache_salt=None,
            prompt_embeds=None,
        )
        chain = side._chain(request)
        side._chains.pop(request.request_id, None)
        out["chains"].append([h.hex() for h in chain])
        out["keys"].append(
            [pool_key(connector.ns, h, 0, name_key).decode() for h in chain]
        )
        out["plain_keys"].append([pool_key(connector.ns, h, 0).decode() for h in chain])
    return out


def main(config: dict) -> dict:
    cpu_defaults()
    in_process_engine()
    from vllm import LLM, SamplingParams

    if config.get("checks_off"):
        from vllm_overlay.core.pool import codec

        codec.check = lambda *args, **kwargs: None
    kv_transfer_config = None
    if config.get("url"):
        extra = dict(TEST_POOL_OPTIONS)  # as run_pool.py: a hit stays a hit
        if config.get("secret"):
            os.environ[SECRET_ENV] = config["secret"]
            extra["secret_env"] = SECRET_ENV
        kv_transfer_config = pool_connector(config["url"], "badbytes", **extra)
    llm = LLM(**tiny_engine_args(kv_transfer_config=kv_transfer_config))
    params = SamplingParams(temperature=0.0, max_tokens=12, logprobs=1)

    def run() -> tuple[list[dict], list]:
        # One request at a time, as run_pool.py: the same schedule as stock.
        from result_out import records

        outs = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts("shared")]
        return records(outs), outs

    first, outputs = run()
    result: dict = {"passes": [first]}
    if config.get("repeat"):
        result["passes"].append(run()[0])
    if kv_transfer_config is not None:
        scheduler = llm.llm_engine.engine_core.engine_core.scheduler
        connector = scheduler.connector
        result.update(block_keys(connector, outputs))
        llm.generate(["hello"], SamplingParams(max_tokens=2), use_tqdm=False)
        result["all_blocks_freed"] = scheduler.reset_prefix_cache()
        result["worker"] = llm.collective_rpc(worker_pool_totals)[0]
        result["scheduler"] = connector.pool.cumulative()
        result["namespace"] = connector.ns.hex()
        result["direct"] = llm.collective_rpc(reads_in_place)[0]
    return result


if __name__ == "__main__":
    from result_out import emit

    emit(main(json.loads(sys.argv[1])))
