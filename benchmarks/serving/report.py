"""The serving benchmark's summary: per configuration, over the repeats,
TTFT p50/p90, requests per second and cache hit tokens by source; TTFT
ratios paired within a repeat; the table (Markdown) and the plot."""

from __future__ import annotations

import statistics

HIT_COLUMNS = ("device", "host", "pool", "external")


def hit_total(hits: dict) -> int:
    """All hit tokens: ``external`` (0.11.2) is host + pool, counted once."""
    split = hits.get("host", 0) + hits.get("pool", 0)
    return hits.get("device", 0) + max(split, hits.get("external", 0))


def percentile(values: list[float], q: int) -> float:
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


def spread(values: list[float]) -> dict:
    return {
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
        "n": len(values),
    }


def run_numbers(run: dict) -> dict:
    """One replay: its TTFT p50/p90 (ms) and requests per second."""
    ttft = [r["ttft_s"] * 1e3 for r in run["requests"] if "ttft_s" in r]
    return {
        "ttft_p50_ms": percentile(ttft, 50),
        "ttft_p90_ms": percentile(ttft, 90),
        "rps": len(run["requests"]) / run["wall_s"],
    }


def summarize(runs: list[dict], configs: list[str]) -> list[dict]:
    by_config = {c: [r for r in runs if r["config"] == c] for c in configs}
    per_repeat = {
        c: {r["repeat"]: run_numbers(r) for r in rs} for c, rs in by_config.items()
    }
    rows = []
    for c, rs in by_config.items():
        if not rs:
            continue
        nums = list(per_repeat[c].values())
        row = {
            "config": c,
            "label": rs[0]["label"],
            "repeats": len(rs),
            "errors": sum(1 for r in rs for q in r["requests"] if "error" in q),
            "requests_per_repeat": len(rs[0]["requests"]),
        }
        for key in ("ttft_p50_ms", "ttft_p90_ms", "rps"):
            row[key] = spread([n[key] for n in nums])
        for col in (*HIT_COLUMNS, "prompt_tokens", "computed"):
            row[f"hits_{col}"] = statistics.median(r["hits"].get(col, 0) for r in rs)
        row["pool_pauses"] = statistics.median(
            (r["hits"].get("pool_tier") or {}).get("pauses", 0) for r in rs
        )
        row["hits_ideal"] = statistics.median(r["ideal_hits"] for r in rs)
        row["hits_share_of_ideal"] = statistics.median(
            hit_total(r["hits"]) / max(r["ideal_hits"], 1) for r in rs
        )
        for ref in ("a", "b"):
            pairs = [
                n["ttft_p50_ms"] / per_repeat[ref][rep]["ttft_p50_ms"]
                for rep, n in per_repeat[c].items()
                if rep in per_repeat.get(ref, {})
            ]
            row[f"p50_vs_{ref}"] = spread(pairs) if pairs else None
        rows.append(row)
    return rows


def _cell(s: dict | None, fmt: str = "{:.0f}") -> str:
    if s is None:
        return "-"
    if s["n"] == 1:
        return fmt.format(s["median"])
    return f"{fmt.format(s['median'])} [{fmt.format(s['min'])}, {fmt.format(s['max'])}]"


HEADER = [
    "config",
    "routing / KV tiers",
    "TTFT p50 ms",
    "TTFT p90 ms",
    "req/s",
    "hit tokens device",
    "host",
    "pool",
    "external (0.11.2: host+pool)",
    "hits / ideal",
    "prompt tokens",
    "prefilled",
    "p50 / (b)",
    "p50 / (a)",
    "pool pauses",
    "errors",
]


def table(rows: list[dict]) -> str:
    lines = [
        "| " + " | ".join(HEADER) + " |",
        "|" + "---|" * len(HEADER),
    ]
    for row in rows:
        cells = [
            f"({row['config']})",
            row["label"],
            _cell(row["ttft_p50_ms"]),
            _cell(row["ttft_p90_ms"]),
            _cell(row["rps"], "{:.3f}"),
            *(f"{row[f'hits_{c}']:.0f}" for c in HIT_COLUMNS),
            f"{row['hits_share_of_ideal']:.2f}",
            f"{row['hits_prompt_tokens']:.0f}",
            f"{row['hits_computed']:.0f}",
            _cell(row["p50_vs_b"], "{:.2f}"),
            _cell(row["p50_vs_a"], "{:.2f}"),
            f"{row['pool_pauses']:.0f}",
            str(row["errors"]),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def goals(rows: list[dict]) -> list[str]:
    """The issue's goals for (d), where (a), (b) and (d) were measured."""
    d = next((r for r in rows if r["config"] == "d"), None)
    if d is None or d["p50_vs_a"] is None or d["p50_vs_b"] is None:
        return []
    vs_b, vs_a = d["p50_vs_b"]["median"], d["p50_vs_a"]["median"]
    return [
        f"(d) TTFT p50 / (b): {vs_b:.2f} (goal <= 1.2: "
        f"{'met' if vs_b <= 1.2 else 'NOT met'})",
        f"(d) TTFT p50 / (a): {vs_a:.2f} (goal <= 0.5: "
        f"{'met' if vs_a <= 0.5 else 'NOT met'})",
    ]


def plot(rows: list[dict], runs: list[dict], path) -> bool:
    """TTFT per configuration (every request of every repeat: box plot) and
    hit tokens by source (stacked bars); False without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    names = [f"({r['config']})" for r in rows]
    ttfts = [
        [
            q["ttft_s"] * 1e3
            for run in runs
            if run["config"] == r["config"]
            for q in run["requests"]
            if "ttft_s" in q
        ]
        for r in rows
    ]
    left.boxplot(ttfts, showfliers=True)
    left.set_xticks(range(1, len(names) + 1), names)
    left.set_ylabel("TTFT, ms (every request, all repeats)")
    left.set_title("Time to first token")
    bottom = [0.0] * len(rows)
    for col in HIT_COLUMNS:
        values = [r[f"hits_{col}"] for r in rows]
        if col == "external":  # only where host and pool are not split
            values = [
                0 if r["hits_host"] + r["hits_pool"] else v
                for r, v in zip(rows, values)
            ]
        if any(values):
            right.bar(names, values, bottom=bottom, label=col)
            bottom = [b + v for b, v in zip(bottom, values)]
    right.bar(
        names,
        [r["hits_computed"] for r in rows],
        bottom=bottom,
        label="prefilled (no cached KV)",
        color="lightgrey",
    )
    right.set_ylabel("prompt tokens per repeat (median)")
    right.set_title("Where the prompts' KV came from (vLLM's metrics)")
    right.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
