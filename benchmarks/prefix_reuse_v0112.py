"""vLLM 0.11.2's half of ``bench_prefix_reuse.py``, run in that release's
interpreter (``.venv``): its paths (the overlay's connectors: host
offloading with cross-layer or per-layer blocks, the shared pool read by a
second engine), its engines (forked children), what each engine reports
and the layout check.  The driver, the rounds, the summary and the main
table are in ``bench_prefix_reuse.py`` and ``prefix_reuse_report.py``."""

from __future__ import annotations

import prefix_reuse_engine
from prefix_reuse_report import check_round  # noqa: F401  (the driver's)

RELEASE = "0.11.2"
STEM = "prefix_reuse"  # of the results' file names

# (key, label in the table, where the KV comes from, engine)
PATHS = [
    ("cold", "cold recompute", "prefill (no cached KV)", "stock"),
    ("hit", "device hit (stock prefix cache)", "device cache", "stock"),
    ("host_cl", "host reload, cross-layer", "host memory", "offload_cl"),
    ("host_pl", "host reload, per-layer (CL-09 off)", "host memory", "offload_pl"),
    ("pool", "pool reload, 2nd engine", "the pool", "pool_reader"),
]
ENGINES = {
    "stock": {"connector": None, "env": {"VLLM_OVERLAY_DISABLE": "1"}},
    "offload_cl": {"connector": "offload", "layout": "cross-layer"},
    "offload_pl": {
        "connector": "offload",
        "layout": "per-layer",
        "env": {"VLLM_OVERLAY_SKIP_PATCHES": "CL-09"},
    },
    "pool_writer": {"connector": "pool", "layout": "cross-layer"},
    "pool_reader": {"connector": "pool", "layout": "cross-layer"},
}
# The connector engines that compute each round's prompt first (storing it).
PREPARE = ("offload_cl", "offload_pl", "pool_writer")
STEP_WHILE_WAITING = False  # the writer's store thread sends on its own
WARM_FROM: dict[str, str] = {}  # engine -> the engine whose warm prompt it runs


# -- engine side (a forked child) ---------------------------------------------
class EngineServer(prefix_reuse_engine.EngineServer):
    """A 0.11.2 engine: the overlay's connectors, their counters from the
    worker (in-process), the KV layout from the overlay's log lines."""

    def before_engine(self):
        from vllm_overlay.testing.observe import LayoutLines
        from vllm_overlay.testing.v0_11_2 import offload_connector, pool_connector

        self.layout_lines = LayoutLines().attach()
        spec = self.spec
        if spec["connector"] == "offload":
            return offload_connector(cpu_bytes=spec["host_bytes"])
        if spec["connector"] == "pool":
            return pool_connector(
                spec["url"],
                "prefix-reuse",
                timeout_s=10.0,
                connect_timeout_s=2.0,
                max_inflight_bytes=spec["pool_inflight_bytes"],
            )
        return None

    def _info(self) -> dict:
        if self.spec["connector"] is None:
            return {}
        from vllm_overlay.testing.v0_11_2 import connector_info

        return self.llm.collective_rpc(connector_info)[0]

    def _counters(self) -> dict:
        totals = self._info().get("totals") or {}
        if self.spec["connector"] == "offload":
            load, store = totals.get("load", {}), totals.get("store", {})
            return {
                "loaded_blocks": load.get("blocks", 0),
                "loaded_bytes": load.get("bytes", 0),
                "load_copy_calls": load.get("copy_calls", 0),
                "load_s": load.get("seconds", 0.0),
                "stored_blocks": store.get("blocks", 0),
            }
        if self.spec["connector"] == "pool":
            return {
                "loaded_blocks": totals.get("loaded_blocks", 0),
                "loaded_bytes": totals.get("bytes_in", 0),
                "load_s": totals.get("io_seconds_in", 0.0),
                "stored_blocks": totals.get("stored_blocks", 0)
                + totals.get("skipped_existing", 0),
                "load_failures": totals.get("load_failures", 0),
                "errors": totals.get("errors", 0),
            }
        return {}

    def _reset_prefix_cache(self) -> bool:
        # LLM.reset_prefix_cache returns None in 0.11.2; the scheduler's
        # call says whether it could.
        return self.scheduler.reset_prefix_cache()

    def describe(self) -> dict:
        import resource

        info = self._info()
        info.pop("totals", None)
        return {
            "layout_lines": list(self.layout_lines.lines),
            "block_size": self.block_size,
            "num_blocks": self.llm.llm_engine.vllm_config.cache_config.num_gpu_blocks,
            "engine_s": self.engine_s,
            "max_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            **info,
        }


def check_layouts(info: dict) -> list[str]:
    return prefix_reuse_engine.check_layouts(
        ENGINES, info, lambda one: one.get("layout_lines")
    )
