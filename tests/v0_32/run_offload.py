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
``"fail_loads": N``: the worker's first N host-to-device copy attempts
raise (the engine runs in this process; the worker redoes a transfer
that raised up to ``TRANSFER_RETRIES`` times); ``"fail_load_jobs": N``:
every attempt of its first N load jobs raises.  ``"load_failure_policy"``
sets ``kv_load_failure_policy`` (default: unset, upstream's ``"fail"``).
The result counts the failed attempts (``failed_loads``) and the worker's
redone attempts and given-up jobs (``retries``, ``failed``).
``"engine_id"``: the KV transfer config's engine id (it names the host
tier's shared-memory file).
``"fault_phases": true``: after the passes, in the same engine, two more
phases (``lost_load`` and ``lost_stores``: see ``lost_load`` and
``lost_stores`` below).
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


class Faults:
    """Makes the worker's next copy attempts of a direction raise, before
    they move a byte (in-process engine only): ``armed[kind]`` attempts
    left to fail, ``failed[kind]`` attempts failed so far."""

    def __init__(self) -> None:
        from vllm_overlay.integration.v0_32.offload_worker import (
            TRANSFER_RETRIES,
            CPUPlatformOffloadingWorker,
        )

        self.tries = 1 + TRANSFER_RETRIES  # attempts of one job
        self.armed = {"store": 0, "load": 0}
        self.failed = {"store": 0, "load": 0}
        move = CPUPlatformOffloadingWorker._move
        faults = self

        def failing(worker, kind, ids, rows):
            if faults.armed[kind] > 0:
                faults.armed[kind] -= 1
                faults.failed[kind] += 1
                raise RuntimeError(f"injected: a {kind} copy failed")
            return move(worker, kind, ids, rows)

        CPUPlatformOffloadingWorker._move = failing


def engine_state(llm) -> dict:
    """The in-process engine's offloading state: the worker's counters and
    pending jobs, the connector's jobs on both sides, the host manager's
    chunks."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    connector_worker = get_kv_transfer_group().connector_worker
    worker = connector_worker.worker
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    side = scheduler.connector.connector_scheduler
    manager = side.manager
    return {
        "retries": dict(worker.retries),
        "failed": dict(worker.failed),
        "blocks": dict(worker.blocks),
        "worker_pending": len(worker._pending),
        "load_jobs": len(connector_worker._load_jobs),
        "scheduler_jobs": len(side._jobs),
        "stored_chunks": manager._num_evictable_cache_chunks,
        "write_pending_chunks": manager._num_write_pending_chunks,
    }


def generate(llm, texts: list[str]) -> list[dict]:
    """records() of greedy requests, with each one's finish reason."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=16, logprobs=1)
    outs = llm.generate(texts, params, use_tqdm=False)
    rows = records(outs)
    for row, o in zip(rows, outs):
        row["finish_reason"] = o.outputs[0].finish_reason
    return rows


def lost_load(llm, faults: Faults, reset) -> dict:
    """Every attempt of one load job fails (after the passes, so the host
    holds every prompt's blocks): its request gets no KV from it.  Then
    the prompts again, as a batch: loaded from host memory as before."""
    out = {"reset_before": reset()}
    before = dict(faults.failed)
    faults.armed["load"] = faults.tries
    failed = generate(llm, [prompts()[-1]])
    out.update(request=failed, armed_left=faults.armed["load"])
    out["failed_attempts"] = faults.failed["load"] - before["load"]
    faults.armed["load"] = 0
    out["reset"] = reset()
    out["then"] = generate(llm, prompts())
    out["state"] = engine_state(llm)
    return out


def lost_stores(llm, faults: Faults, reset) -> dict:
    """Host memory emptied (``reset_connector``), then every store attempt
    fails: the prompts (computed, as cold), then, the device cache emptied,
    again (nothing to load: computed again)."""
    out = {"cleared": False}
    for _ in range(3):  # stores finish asynchronously (reset())
        generate(llm, ["flush"])
        if llm.reset_prefix_cache(reset_connector=True):
            out["cleared"] = True
            break
    out["cleared_state"] = engine_state(llm)
    before = dict(faults.failed)
    faults.armed["store"] = 10**9  # every attempt, until disarmed
    out["first"] = generate(llm, prompts())
    out["reset"] = reset()
    out["again"] = generate(llm, prompts())
    for _ in range(3):  # the last stores complete (as failed)
        generate(llm, ["flush"])
    out["failed_attempts"] = faults.failed["store"] - before["store"]
    faults.armed["store"] = 0
    out["state"] = engine_state(llm)
    return out


def main(config: dict) -> dict:
    cpu_defaults()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # collective_rpc fn
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    kv = faults = None
    if config.get("connector"):
        policy = {}
        if "load_failure_policy" in config:
            policy["kv_load_failure_policy"] = config["load_failure_policy"]
        if config.get("fail_loads") or config.get("fault_phases"):
            faults = Faults()
            faults.armed["load"] = config.get("fail_loads", 0)
        if config.get("fail_load_jobs"):
            faults = faults or Faults()
            faults.armed["load"] += config["fail_load_jobs"] * faults.tries
        if "engine_id" in config:  # names the host tier's shared-memory file
            policy["engine_id"] = config["engine_id"]
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

    def run(batch: list[str] | None = None) -> list[dict]:
        return generate(llm, batch or prompts())

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
    if faults is not None:
        out["failed_loads"] = faults.failed["load"]
        out["tries"] = faults.tries  # attempts of one job
        out["state"] = engine_state(llm)
    if config.get("fault_phases"):
        out["lost_load"] = lost_load(llm, faults, reset)
        out["lost_stores"] = lost_stores(llm, faults, reset)
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
    if config.get("exit") == "abrupt":
        # Out while ``llm`` is referenced: once main returned, a garbage
        # collection could shut the engine down before the exit.
        from result_out import emit

        emit(out)
        os._exit(0)
    return out


if __name__ == "__main__":
    from result_out import emit

    emit(main(json.loads(sys.argv[1])))
