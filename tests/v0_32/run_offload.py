"""vLLM 0.32 with upstream's ``OffloadingConnector`` on the CPU platform
(the overlay's worker, patch OF32-01), printed as JSON.

Passes over prompts of 1 to 5 blocks: cold; then, after the device prefix
cache is emptied (``reset_prefix_cache``), the prompts as one batch, loaded
back from host memory; then each prompt alone, the cache emptied before
each.  ``{"connector": false}``: stock vLLM 0.32 instead, whose later
passes hit its own device prefix cache (the reference: same hit lengths).
Also reported: the worker's copy calls and blocks per direction, and the
KV cache layout.

``"fs_dir": DIR``: ``TieringOffloadingSpec`` instead of the default
``CPUOffloadingSpec``: the CPU primary tier plus upstream's ``fs`` secondary
tier in DIR (patch OF32-02); the runner then waits (with a deadline) until
DIR holds ``"fs_files"`` block files and reports how many it holds.
``"pool_url": URL``: the same with the overlay's ``SharedPoolTier`` (the
Redis/Valkey pool) as the secondary tier; the runner waits until the pool
holds ``"pool_values"`` values and reports how many it holds.
``"passes"``: which passes to run (default all three, in order).
With a tiering spec the result names the primary tier's shared-memory file
(``region_file``) and whether it still had a name at the end, while the
engine ran (``region_named``).  ``"exit": "abrupt"``: the process ends with
``os._exit`` once the result is written, as a killed engine would: no
shutdown, no finalizer.
``"fail_loads": N``: the worker's first N host-to-device copies raise
(the engine runs in this process), with ``kv_load_failure_policy``
``"recompute"`` (``"load_failure_policy"`` overrides it); the result
counts the failed copies (``failed_loads``).
``"model": "mla"``: the tiny DeepSeek (MLA, the ``CPU_MLA`` backend)
instead of the tiny Llama; it runs without a device prefix cache.

    python run_offload.py '{"connector": true}'   # env: VLLM_KV_CACHE_LAYOUT
    python run_offload.py '{"connector": true, "fs_dir": "/tmp/kv"}'
"""

from __future__ import annotations

import json
import os
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "e2e"))
from result_out import records  # noqa: E402
from run_llm import prompts  # noqa: E402

from vllm_overlay.testing import (  # noqa: E402
    cpu_defaults,
    tiny_engine_args,
    tiny_mla_engine_args,
)
from vllm_overlay.testing.v0_32 import CPU_BYTES  # noqa: E402
from vllm_overlay.testing.v0_32 import connector_info as worker_info  # noqa: E402

TIER_DEADLINE_S = 120.0  # a secondary tier's writes land well within this


def extra_config(config: dict) -> dict:
    """Upstream's kv_connector_extra_config keys."""
    extra = {"cpu_bytes_to_use": CPU_BYTES}
    if config.get("fs_dir"):
        extra["spec_name"] = "TieringOffloadingSpec"
        extra["secondary_tiers"] = [
            {
                "type": "fs",
                "root_dir": config["fs_dir"],
                "n_read_threads": 2,
                "n_write_threads": 2,
            }
        ]
    if config.get("pool_url"):
        extra["spec_name"] = "TieringOffloadingSpec"
        extra["secondary_tiers"] = [
            {
                "type": "SharedPoolTier",
                "module_path": "vllm_overlay.integration.v0_32.pool_tier",
                "url": config["pool_url"],
                **config.get("pool_options", {}),
            }
        ]
    return extra


def tier_values(config: dict) -> tuple[str, int] | None:
    """(the result's name, how many values the secondary tier holds)."""
    if config.get("fs_dir"):
        return "fs_files", sum(1 for _ in pathlib.Path(config["fs_dir"]).rglob("*.bin"))
    if "pool_values" in config:  # (a run may be given a pool it cannot reach)
        import redis

        with redis.Redis.from_url(config["pool_url"], socket_timeout=5) as client:
            return "pool_values", client.dbsize()
    return None


def fail_loads(count: int, failed: dict) -> None:
    """The worker's first COUNT loads raise (in-process engine only)."""
    from vllm_overlay.integration.v0_32.offload_worker import (
        CPUPlatformOffloadingWorker as Worker,
    )

    move = Worker._move

    def failing(self, kind, ids, rows):
        if kind == "load" and failed["n"] < count:
            failed["n"] += 1
            raise RuntimeError("injected: a host-to-device copy failed")
        return move(self, kind, ids, rows)

    Worker._move = failing


def main(config: dict) -> dict:
    cpu_defaults()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # collective_rpc fn
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    kv = None
    if config.get("connector"):
        policy = {}
        if config.get("fail_loads"):
            fail_loads(config["fail_loads"], out_failed := {"n": 0})
            policy["kv_load_failure_policy"] = config.get(
                "load_failure_policy", "recompute"
            )
        kv = KVTransferConfig(
            kv_connector="OffloadingConnector",
            kv_role="kv_both",
            kv_connector_extra_config=extra_config(config),
            **policy,
        )
    if config.get("model") == "mla":
        # CPU_MLA: on CPUs with AMX tiles vLLM 0.32 would pick AMX_MLA,
        # which keeps the device prefix cache on.
        args = tiny_mla_engine_args(kv_transfer_config=kv, attention_backend="CPU_MLA")
    else:
        args = tiny_engine_args(kv_transfer_config=kv)
    llm = LLM(**args)
    params = SamplingParams(temperature=0.0, max_tokens=16, logprobs=1)

    def run(batch: list[str] | None = None) -> list[dict]:
        return records(llm.generate(batch or prompts(), params, use_tqdm=False))

    def reset() -> bool | None:
        if kv is None:
            return None  # stock: the next pass hits the device prefix cache
        # Stores finish asynchronously; a few more steps let them complete
        # and free their blocks, so the reset really empties the cache.
        for _ in range(3):
            llm.generate(["flush"], SamplingParams(max_tokens=1), use_tqdm=False)
            if llm.reset_prefix_cache():
                return True
        return False

    todo = config.get("passes", ["first", "batch", "single"])
    out = {"passes": [], "resets": []}
    if "first" in todo:
        out["passes"].append(run())
        out["after_first"] = llm.collective_rpc(worker_info)[0]
    if "batch" in todo:
        out["resets"].append(reset())
        out["passes"].append(run())  # a batch: requests wait for their loads
    if "single" in todo:
        single = []  # one request at a time: stock's schedule
        for text in prompts():
            out["resets"].append(reset())
            single += run([text])
        out["passes"].append(single)
    out["after"] = llm.collective_rpc(worker_info)[0]
    if config.get("fail_loads"):
        out["failed_loads"] = out_failed["n"]
    if tier_values(config) is not None:
        deadline = time.monotonic() + TIER_DEADLINE_S
        while True:
            name, values = tier_values(config)
            if values >= config.get(name, 0) or time.monotonic() > deadline:
                break
            reset()  # steps the engine: finished stores cascade to the tier
            time.sleep(0.2)
        out[name] = values
    if kv is not None and "spec_name" in kv.kv_connector_extra_config:
        engine_id = llm.llm_engine.vllm_config.kv_transfer_config.engine_id
        region = pathlib.Path(f"/dev/shm/vllm_offload_{engine_id}.mmap")
        out["region_file"] = str(region)
        out["region_named"] = region.exists()
    return out


if __name__ == "__main__":
    from result_out import emit

    config = json.loads(sys.argv[1])
    emit(main(config))
    if config.get("exit") == "abrupt":
        os._exit(0)
