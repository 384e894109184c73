"""vLLM 0.32's half of ``bench_prefix_reuse.py``, run in that release's
interpreter (``.venv-0.32``): its paths, its engines (forked children, as
on 0.11.2), what each engine reports, the checks and the extra tables.  The
driver and the rounds are in ``bench_prefix_reuse.py``, the summary and
the main table in ``prefix_reuse_report.py``.

The paths:

* ``cold recompute`` / ``device hit``: stock vLLM 0.32 (overlay disabled,
  no KV connector), its device prefix cache reset first / not
* ``host reload, cross-layer`` / ``per-layer``: upstream's
  ``OffloadingConnector`` with ``CPUOffloadingSpec``, on the CPU platform
  through the overlay's worker (OF32-01), the KV cache layout picked by
  ``VLLM_KV_CACHE_LAYOUT`` (``BLHNC``: one copy per block; ``LBHNC``: one
  per layer)
* ``host tier reload``: ``TieringOffloadingSpec`` with the overlay's
  ``SharedPoolTier`` behind it; the engine that computed the prompt (the
  pool writer) reloads it from its own host (primary) tier
* ``pool reload, 2nd engine``: the same configuration in a second engine
  that never saw the prompt: the tier finds it in the pool, promotes it
  into the host tier, and the connector loads it from there

Each path is checked by vLLM's own attribution of the hit: the
scheduler's connector hit stats split by ``CacheHitSource`` (``host`` for
the host paths, ``external_unspecified`` for the pool, whose tier reports
its hits as external), by the worker's blocks loaded, and for the pool by
the tier's pool counters (``tier.pool.cumulative()``: the scheduler, and so
the tier, live in the runner's process with
``VLLM_ENABLE_V1_MULTIPROCESSING=0``).

Per-phase attribution of each reload (``Phases``): timestamps taken in the
engine's process by wrapping the tier's and the worker's methods on their
instances (nothing in vLLM or the tier changes), against the request's
arrival (front end, moved to this clock) and its engine-core
``first_token_ts``.
"""

from __future__ import annotations

import time

import prefix_reuse_engine
from prefix_reuse_phases import Phases, print_phases
from prefix_reuse_report import check_round as check_paths

RELEASE = "0.32"
STEM = "prefix_reuse_v032"  # of the results' file names

# (key, label in the table, where the KV comes from, engine)
PATHS = [
    ("cold", "cold recompute", "prefill (no cached KV)", "stock"),
    ("hit", "device hit (stock prefix cache)", "device cache", "stock"),
    ("host_cl", "host reload, cross-layer (BLHNC)", "host memory", "offload_cl"),
    ("host_pl", "host reload, per-layer (LBHNC)", "host memory", "offload_pl"),
    ("tier_host", "host tier reload (tiering)", "host tier", "pool_writer"),
    ("pool", "pool reload, 2nd engine", "the pool -> host tier", "pool_reader"),
]
LOADS = ("host_cl", "host_pl", "tier_host", "pool")
SOURCES = {  # CacheHitSource values vLLM must report for each reload
    "host_cl": "host",
    "host_pl": "host",
    "tier_host": "host",
    "pool": "external_unspecified",
}
ENGINES = {
    "stock": {"connector": None, "env": {"VLLM_OVERLAY_DISABLE": "1"}},
    "offload_cl": {
        "connector": "offload",
        "layout": "cross-layer",
        "env": {"VLLM_KV_CACHE_LAYOUT": "BLHNC"},
    },
    "offload_pl": {
        "connector": "offload",
        "layout": "per-layer",
        "env": {"VLLM_KV_CACHE_LAYOUT": "LBHNC"},
    },
    "pool_writer": {
        "connector": "tier",
        "layout": "cross-layer",
        "env": {"VLLM_KV_CACHE_LAYOUT": "BLHNC"},
    },
    "pool_reader": {
        "connector": "tier",
        "layout": "cross-layer",
        "env": {"VLLM_KV_CACHE_LAYOUT": "BLHNC"},
    },
}
PREPARE = ("offload_cl", "offload_pl", "pool_writer")
# The tier's stores cascade from the host tier as the engine steps: the
# driver steps the writer while it waits for the round's values.
STEP_WHILE_WAITING = True
# Warm-up: the reader's first run is a prompt the writer stored (a pool load).
WARM_FROM = {"pool_reader": "pool_writer"}


def _connector_kv(spec: dict):
    from vllm_overlay.testing.v0_32 import offload_connector

    if spec["connector"] == "offload":
        return offload_connector(cpu_bytes=spec["host_bytes"])
    if spec["connector"] == "tier":
        tier = {
            "type": "SharedPoolTier",
            "module_path": "vllm_overlay.integration.v0_32.pool_tier",
            "url": spec["url"],
            "namespace": "prefix-reuse",
            "timeout_s": 10.0,
            "connect_timeout_s": 2.0,
            "max_inflight_bytes": spec["pool_inflight_bytes"],
        }
        return offload_connector(
            cpu_bytes=spec["host_bytes"],
            spec_name="TieringOffloadingSpec",
            secondary_tiers=[tier],
        )
    return None


class EngineServer(prefix_reuse_engine.EngineServer):
    """A 0.32 engine: upstream's OffloadingConnector (the host tier, and the
    pool tier behind it), vLLM's hits by source, the tier's and the CPU
    worker's counters, and each run's per-phase timestamps."""

    def before_engine(self):
        if self.spec.get("idle_wait_ms"):  # EC32's bound (a diagnostic)
            from vllm_overlay.core import idle_wait

            idle_wait.IDLE_WAIT_S = self.spec["idle_wait_ms"] / 1e3
        return _connector_kv(self.spec)

    def after_engine(self) -> None:
        from vllm.v1.metrics.stats import PrefixCacheStats

        self.tier = self.worker = self.phases = None
        if self.scheduler.connector is not None:
            # The scheduler records the connector's hits by source only
            # with log_stats; with it off make_stats never takes them, so
            # this object keeps every request's.
            if self.scheduler.connector_prefix_cache_stats is None:
                self.scheduler.connector_prefix_cache_stats = PrefixCacheStats()
            manager = self.scheduler.connector.connector_scheduler.manager
            tiers = getattr(manager, "secondary_tiers", None) or []
            self.tier = tiers[0] if tiers else None
            self.worker = self.llm.collective_rpc(_offload_worker)[0]
            self.phases = Phases(self.tier, self.worker, self.scheduler)

    def _counters(self) -> dict:
        if self.scheduler.connector is None:
            return {}
        stats = self.scheduler.connector_prefix_cache_stats
        out = {
            "loaded_blocks": self.worker.blocks.get("load", 0),
            "load_copy_calls": self.worker.copies.get("load", 0),
            "stored_blocks": self.worker.blocks.get("store", 0),
            "connector_hits": stats.hits,
            **{f"hits_{k.value}": v for k, v in stats.hits_by_source.items()},
        }
        out["loaded_bytes"] = out["loaded_blocks"] * self.worker.table.block_bytes
        if self.tier is not None:
            pool = self.tier.pool.cumulative()
            out.update(
                pool_loaded_blocks=pool["loaded_blocks"],
                pool_bytes_in=pool["bytes_in"],
                pool_io_s_in=pool["io_seconds_in"],
                pool_stored_blocks=pool["stored_blocks"] + pool["skipped_existing"],
                pool_load_failures=pool["load_failures"],
                pool_errors=pool["errors"],
            )
        return out

    def before_run(self) -> None:
        if self.phases is not None:
            self.phases.reset()

    def after_run(self, res: dict, m) -> None:
        if self.phases is None:
            return
        p, moved = self.phases, res["moved"]
        # arrival_time is wall clock (front end, this process): moved to
        # the engine core's monotonic clock.
        arrival = m.arrival_time - (time.time() - time.monotonic())
        events = {**p.t, "arrival": arrival, "first_token": m.first_token_ts}
        res["events"] = {k: v - arrival for k, v in events.items()}
        res["h2d_copy_s"] = p.h2d_s
        res["steps"] = p.steps
        # the main table's "transfer ms": the pool's read, else the copy
        moved["load_s"] = moved.get("pool_io_s_in") or p.h2d_s
        if moved.get("pool_bytes_in"):
            moved["loaded_bytes"] = moved["pool_bytes_in"]

    def describe(self) -> dict:
        import resource

        from vllm_overlay.testing.v0_32 import connector_info

        info = self.llm.collective_rpc(connector_info)[0]
        for key in ("copies", "blocks"):
            info.pop(key, None)
        return {
            "layout_lines": [f"KV cache layout {info.get('layout')}"],
            "cross_layer": info.get("runs_per_block") == 1
            if "runs_per_block" in info
            else None,
            "block_size": self.block_size,
            "num_blocks": self.llm.llm_engine.vllm_config.cache_config.num_gpu_blocks,
            "engine_s": self.engine_s,
            "max_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "tier": type(self.tier).__name__ if self.tier is not None else None,
            **info,
        }


def _offload_worker(worker):
    """Runs in the worker (collective_rpc, in this process): the overlay's
    CPU offloading worker itself."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    return get_kv_transfer_group().connector_worker.worker


# -- checks --------------------------------------------------------------------
def check_round(
    rec: dict, expect_cached: int, n_prompt: int, full_blocks: int
) -> list[str]:
    """The shared checks (hit lengths, blocks loaded, tokens), then where
    vLLM says each reload's hit came from, and the pool's own counters."""
    out = check_paths(rec, expect_cached, n_prompt, full_blocks, loads=LOADS)
    r = rec["round"]
    for key, res in rec["paths"].items():
        moved = res["moved"]
        bad = []
        sources = {k[5:]: v for k, v in moved.items() if k.startswith("hits_") and v}
        res["hits_by_source"] = sources
        want = {SOURCES[key]: expect_cached} if key in SOURCES else {}
        if sources != want:
            bad.append(f"hits by source {sources} (expected {want})")
        pool = moved.get("pool_loaded_blocks", 0)
        if key == "pool" and pool != full_blocks:
            bad.append(f"the tier loaded {pool} blocks (expected {full_blocks})")
        elif key != "pool" and pool:
            bad.append(f"the tier loaded {pool} blocks from the pool")
        if moved.get("pool_load_failures") or moved.get("pool_errors"):
            bad.append(f"pool failures {moved}")
        if bad:
            res["path_ok"] = False
        out += [f"round {r}, {key}: {b}" for b in bad]
    return out


def check_layouts(info: dict) -> list[str]:
    return prefix_reuse_engine.check_layouts(
        ENGINES,
        info,
        lambda one: (
            f"{one.get('layout')} ({one.get('runs_per_block')} copies per block)"
        ),
    )


def print_extra(rows: list[dict], runs: list[dict]) -> None:
    print_phases(PATHS, LOADS, runs)
