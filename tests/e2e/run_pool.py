"""One vLLM "node" using the shared KV pool (CPU build); prints JSON.

    python run_pool.py '{"url": "redis://127.0.0.1:6379", ...}'

Config: ``url`` (null: no pool, stock run), ``namespace``, ``cluster``,
``prompts`` ("shared" | "other"), ``copy_from_namespace_of`` (a key prefix
``vkv:<ns>:``: before generating, copy those values under this node's own
namespace, as a misconfigured or malicious writer would), ``kill_pid`` (kill
this process, the pool server, after the first pass, then run a second pass
with other prompts), ``restart`` ([port, dir, kind]: start that kind of
pool server again there and run a third pass), ``repeat`` (run the prompts a second time
in the same engine: that pass is served from vLLM's own device prefix
cache; with no pool this is stock's bit-exact reference for a pool load,
the same hit length and, one request at a time, the same schedule).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from prompt_words import WORDS
from result_out import records

from vllm_overlay.testing import cpu_defaults, in_process_engine, tiny_engine_args
from vllm_overlay.testing.redis import server_command
from vllm_overlay.testing.v0_11_2 import TEST_POOL_OPTIONS, pool_connector


def prompts(kind: str) -> list[str]:
    shift = {"shared": 0, "other": 5, "third": 9}[kind]
    return [
        " ".join(WORDS[(i * 7 + shift + j) % len(WORDS)] for i in range(n))
        for j, n in enumerate((400, 290))
    ]


def worker_pool_totals(worker) -> dict:
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    connector = get_kv_transfer_group()
    connector.pool.drain()
    return connector.pool.cumulative()


def main(config: dict) -> dict:
    cpu_defaults()
    in_process_engine()
    from vllm import LLM, SamplingParams

    kv_transfer_config = None
    if config.get("url"):
        extra = dict(TEST_POOL_OPTIONS)
        if config.get("cluster"):
            extra["cluster"] = True
        kv_transfer_config = pool_connector(
            config["url"], config.get("namespace", "test"), **extra
        )
    llm = LLM(**tiny_engine_args(kv_transfer_config=kv_transfer_config))
    scheduler_connector = None
    if kv_transfer_config is not None:
        scheduler_connector = llm.llm_engine.engine_core.engine_core.scheduler.connector
    if config.get("copy_from_namespace_of"):
        copy_namespace(scheduler_connector, config["copy_from_namespace_of"])
    params = SamplingParams(temperature=0.0, max_tokens=12, logprobs=1)

    def run(kind: str) -> list[dict]:
        # One request at a time: a node that loads blocks lets a request
        # wait, which changes batch composition, and vLLM's numerics are
        # not batch-invariant; alone, outputs must match stock bit for bit.
        outs = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts(kind)]
        return records(outs)

    passes = [run(config.get("prompts", "shared"))]
    if config.get("repeat"):
        passes.append(run(config.get("prompts", "shared")))
    if config.get("kill_pid"):
        os.kill(config["kill_pid"], 9)
        time.sleep(0.2)
        passes.append(run("other"))
    if config.get("restart"):
        port, workdir, kind = config["restart"]
        subprocess.Popen(  # outlives this run: the test shuts it down
            server_command(port, workdir, kind),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # not in the run's session (run_zygote.py)
        )
        time.sleep(1.0)  # server up, back-off (<= 0.5 s) expired
        passes.append(run("third"))
    result = {"passes": passes}
    if scheduler_connector is not None:
        # Every block must be back once the requests are done: a request
        # whose stores the worker dropped must still be reported finished
        # sending.  A last short request (no full block: nothing to store)
        # runs the steps that report them; then a prefix cache reset
        # succeeds only if no block is held.
        llm.generate(["hello"], SamplingParams(max_tokens=2), use_tqdm=False)
        scheduler = llm.llm_engine.engine_core.engine_core.scheduler
        result["all_blocks_freed"] = scheduler.reset_prefix_cache()
        result["worker"] = llm.collective_rpc(worker_pool_totals)[0]
        result["scheduler"] = scheduler_connector.pool.cumulative()
        result["namespace"] = scheduler_connector.ns.hex()
    return result


def copy_namespace(connector, source_prefix: str) -> None:
    """Copy every value under ``source_prefix`` to this node's namespace."""
    import redis

    client = redis.Redis.from_url(connector.config.redis_url)
    mine = f"vkv:{connector.ns.hex()}:"
    for key in client.scan_iter(match=source_prefix + "*"):
        rest = key.decode()[len(source_prefix) :]
        client.set(mine + rest, client.get(key))


if __name__ == "__main__":
    from result_out import emit

    emit(main(json.loads(sys.argv[1])))
