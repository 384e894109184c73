"""The benchmark's ``vllm serve`` nodes: their KV transfer configurations
and starting a group of them at once (tests/support/served_vllm.py runs
each: a free loopback port, healthy within a deadline, always stopped).

Node kinds (two nodes of each kind, behind one proxy per configuration):

* ``plain``: no connector (configurations a and b share them);
* ``pool``: upstream's ``OffloadingConnector`` with ``TieringOffloadingSpec``:
  a small CPU primary tier, only the staging area the spec needs, and the
  overlay's ``SharedPoolTier`` as its secondary tier (c);
* ``hostpool``: the same with a large primary tier: host memory in front
  of the pool (d);
* ``hostpool_0112``: vLLM 0.11.2, ``MultiConnector`` of the overlay's
  ``OverlayOffloadingConnector`` (host) and ``SharedKVPoolConnector``
  (pool) (e).

``secondary="fs"`` puts upstream's ``fs`` tier (a directory both nodes
share) where the pool tier goes: a check of the tiered plumbing where the
pool tier is not installed; its hits are counted in the pool column.
"""

from __future__ import annotations

import contextlib
import json
import pathlib
import sys
import threading

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
from support.served_vllm import (  # noqa: E402
    BIN,
    SERVED_NAME,
    harness_env,
    served_model,
)

__all__ = ["SERVED_NAME", "kv_transfer_config", "node_group", "node_spec"]

POOL_TIER = {
    "type": "SharedPoolTier",
    "module_path": "vllm_overlay.integration.v0_32.pool_tier",
}


def secondary_tier(pool: dict) -> dict:
    """The secondary tier's config; each node kind has its own namespace
    (pool) or folder (fs), so no configuration sees another's blocks."""
    secondary = pool["secondary"]
    if secondary == "pool":
        return {
            **POOL_TIER,
            "url": pool["url"],
            "namespace": pool["namespace"],
            **pool.get("options", {}),
        }
    if secondary == "fs":
        return {"type": "fs", "root_dir": f"{pool['fs_dir']}/{pool['namespace']}"}
    raise ValueError(f"unknown secondary tier {secondary!r} (pool or fs)")


def kv_transfer_config(kind: str, sizes: dict, pool: dict) -> dict | None:
    """The ``--kv-transfer-config`` of a node kind (None: no connector).
    ``sizes``: host bytes per kind; ``pool``: secondary, namespace, url,
    url_0112, fs_dir, options (more pool keys: core/pool's PoolConfig)."""
    if kind == "plain":
        return None
    if kind in ("pool", "hostpool"):
        tier = secondary_tier(pool)
        return {
            "kv_connector": "OffloadingConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "spec_name": "TieringOffloadingSpec",
                "cpu_bytes_to_use": sizes[kind],
                "secondary_tiers": [tier],
            },
        }
    if kind == "hostpool_0112":
        return {
            "kv_connector": "MultiConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "connectors": [
                    {
                        "kv_connector": "OverlayOffloadingConnector",
                        "kv_role": "kv_both",
                        "kv_connector_extra_config": {"cpu_bytes": sizes[kind]},
                    },
                    {
                        "kv_connector": "SharedKVPoolConnector",
                        "kv_role": "kv_both",
                        "kv_connector_extra_config": {
                            "url": pool["url_0112"],
                            "namespace": pool["namespace"],
                            **pool.get("options", {}),
                        },
                    },
                ]
            },
        }
    raise ValueError(f"unknown node kind {kind!r}")


@contextlib.contextmanager
def node_group(specs: list[dict], log_dir: pathlib.Path, startup_s: float):
    """Start every node at once (one thread each runs its ``served_model``);
    yields ``{name: port}`` once all are healthy; stops them all on exit.
    A spec: name, model (dict for served_vllm), flags, env, bin_dir."""
    ports: dict[str, int] = {}
    errors: dict[str, BaseException] = {}
    ready = threading.Barrier(len(specs) + 1)
    stop = threading.Event()

    def run(spec):
        try:
            with served_model(
                spec["model"],
                log_dir / f"{spec['name']}.log",
                spec["flags"],
                spec["env"],
                startup_s,
                spec.get("bin_dir", BIN),
            ) as port:
                ports[spec["name"]] = port
                ready.wait()
                stop.wait()
        except BaseException as e:  # reported by the caller
            errors[spec["name"]] = e
            ready.abort()

    threads = [threading.Thread(target=run, args=(s,), daemon=True) for s in specs]
    for t in threads:
        t.start()
    try:
        try:
            ready.wait(timeout=startup_s + 60)
        except threading.BrokenBarrierError:
            raise RuntimeError(
                "nodes failed to start: "
                + "; ".join(f"{n}: {e}" for n, e in errors.items())[-8000:]
            ) from None
        yield ports
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=120)


def node_spec(
    name: str,
    model: dict,
    kv_config: dict | None,
    *,
    threads: int,
    bin_dir: pathlib.Path = BIN,
) -> dict:
    flags = ["--enable-prompt-tokens-details"]
    if kv_config is not None:
        flags += ["--kv-transfer-config", json.dumps(kv_config)]
    env = harness_env(
        PYTHONPATH=str(ROOT),
        OMP_NUM_THREADS=str(threads),
        TORCHDYNAMO_DISABLE="1",
        VLLM_SERVER_DEV_MODE="1",  # /reset_prefix_cache between runs
        VLLM_CPU_KVCACHE_SPACE=None,  # it would override kv_cache_memory_bytes
    )
    return {
        "name": name,
        "model": model,
        "flags": flags,
        "env": env,
        "bin_dir": bin_dir,
    }
