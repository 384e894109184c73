"""The demo on vLLM 0.32, where the overlay adds only what upstream lacks:
cross-layer KV blocks on CPU_ATTN (``VLLM_KV_CACHE_LAYOUT=BLHNC``, patch
CL32-01) and host offloading on the CPU platform through upstream's
``OffloadingConnector`` with the overlay's worker (patch OF32-01).  Stock
vLLM 0.32 (the overlay off) runs the same prompts: every row's tokens are
compared with its own."""

from __future__ import annotations

from vllm_overlay.demo import report
from vllm_overlay.testing import v0_32

RELEASE = "0.32"
STOCK_ENV = {"VLLM_OVERLAY_DISABLE": "1"}


def _loaded(entry: dict) -> tuple[int, int]:
    return entry["moved"]["load"]["blocks"], entry["moved"]["load"]["bytes"]


def _layout(result: dict) -> str:
    info = result["info"]
    text = info.get("layout", "?")
    if "runs_per_block" in info:
        text += (
            f" (a block of every layer, {info['block_bytes']} B, is "
            f"{info['runs_per_block']} contiguous run(s); offloading worker "
            f"{info['worker']})"
        )
    return text


class Plan:
    def __init__(self, base: dict, pool: bool, stock_layout: bool) -> None:
        self.base = base
        self.stock_layout = stock_layout
        self.notes = [
            "pool reload row: not on vLLM 0.32 (SharedKVPoolConnector runs on "
            "0.11.2: bash scripts/demo.sh); PP KV budget: 0.11.2 only"
        ]
        self.main = {
            **base,
            "connector": "offload",
            "env": v0_32.layout_env(cross_layer=True),
            "passes": ["cold", "hit", "reload"],
        }
        self.needs: dict[str, str] = {}

    def children(self, stack) -> dict[str, dict]:
        """The forked engines, in the order they are measured."""
        out = {"stock": {**self.base, "env": STOCK_ENV, "passes": ["cold", "hit"]}}
        if self.stock_layout:
            out["per_layer"] = {
                **self.base,
                "connector": "offload",
                "env": v0_32.layout_env(cross_layer=False),
                "passes": ["cold", "reload"],
            }
        return out

    def rows(self, results: dict) -> list[dict]:
        main = results["main"]
        cold, hit, reload = main["passes"]
        info = main["info"]
        stock = results.get("stock")
        s_cold, s_hit = stock["passes"] if stock else (None, None)
        rows = [
            report.row("recompute (cold)", "prefill", cold, info, None, stock=s_cold),
            report.row(
                "device prefix hit", "device cache", hit, info, cold, stock=s_hit
            ),
            report.row(
                "host reload",
                "host memory",
                reload,
                info,
                cold,
                _loaded(reload),
                stock=s_hit,
            ),
        ]
        if "per_layer" in results:
            p = results["per_layer"]
            rows.append(
                report.row(
                    "host reload, per-layer layout",
                    "host memory",
                    p["passes"][1],
                    p["info"],
                    cold,
                    _loaded(p["passes"][1]),
                    stock=s_hit,
                )
            )
        if stock:
            rows.append(
                report.row(
                    "stock vLLM 0.32, device hit", "device cache", s_hit, None, s_cold
                )
            )
        return rows

    @staticmethod
    def row_ok(row: dict) -> bool:
        return row["copy"]["all_exact"] and row["copy"]["same_tokens_as_stock"] in (
            True,
            None,
        )

    def layout_lines(self, results: dict) -> list[str]:
        lines = [f"KV cache layout (offload engine): {_layout(results['main'])}"]
        if "per_layer" in results:
            lines.append(
                f"KV cache layout (per-layer engine): {_layout(results['per_layer'])}"
            )
        if "stock" in results:
            lines.append(
                "KV cache layout (stock vLLM 0.32, overlay off): "
                f"{_layout(results['stock'])}"
            )
        return lines

    def stores_line(self, results: dict) -> str:
        info = results["main"]["info"]
        st = results["main"]["passes"][0]["moved"]["store"]
        text = (
            f"stores in the cold pass (upstream's OffloadingConnector, the "
            f"overlay's CPU worker): {st['blocks']} blocks, "
            f"{report.fmt_bytes(st['bytes'])} to host, {st['copy_calls']} copy "
            f"calls ({info['runs_per_block']} run per block, consecutive blocks "
            "merged)"
        )
        if "per_layer" in results:
            p = results["per_layer"]
            p_st = p["passes"][0]["moved"]["store"]
            text += (
                f"; per-layer layout {p_st['blocks']} blocks, "
                f"{p_st['copy_calls']} copy calls ({p['info']['runs_per_block']} "
                "runs per block)"
            )
        return text
