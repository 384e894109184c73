"""The prefix-reuse benchmark's results, on either release: whether each
round's paths happened with the cold run's tokens (``check_round``), the
summary over rounds (median and [min, max], ratios paired within a round),
the table and the plot, and the cells the other tables share
(``median_cells``: the phases', the read's).  ``spread`` and ``loadavg``
serve the other benchmarks too."""

from __future__ import annotations

import os
import pathlib
import statistics


def loadavg() -> list[float]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


# -- checks --------------------------------------------------------------------
def check_round(
    rec: dict,
    expect_cached: int,
    n_prompt: int,
    full_blocks: int,
    loads: tuple[str, ...] = ("host_cl", "host_pl", "pool"),
) -> list[str]:
    """Did each path really happen (``loads``: the paths a connector loads),
    and are its tokens the cold run's?"""
    out = []
    r = rec["round"]
    if rec.get("round_keys", full_blocks) != full_blocks:
        out.append(
            f"round {r}: the writer stored {rec['round_keys']} blocks "
            f"(expected {full_blocks})"
        )
    cold = rec["paths"]["cold"]["tokens"]
    for key, res in rec["paths"].items():
        bad = []
        if res["prompt_tokens"] != n_prompt:
            bad.append(f"prompt {res['prompt_tokens']} tokens")
        if res["reset_ok"] is False:
            bad.append("the device prefix cache could not be reset")
        cached = res["cached_tokens"]
        moved = res["moved"]
        if key == "cold":
            if cached:
                bad.append(f"{cached} cached tokens (expected 0)")
        elif cached != expect_cached:
            bad.append(f"{cached} cached tokens (expected {expect_cached})")
        if key in loads:
            if moved.get("loaded_blocks", 0) != full_blocks:
                bad.append(
                    f"the connector loaded {moved.get('loaded_blocks', 0)} "
                    f"blocks (expected {full_blocks})"
                )
        elif moved.get("loaded_blocks"):
            bad.append(f"{moved['loaded_blocks']} blocks loaded by a connector")
        res["path_ok"] = not bad
        res["same_tokens_as_cold"] = res["tokens"] == cold
        if not res["same_tokens_as_cold"]:
            bad.append("tokens differ from the cold run's")
        out += [f"round {r}, {key}: {b}" for b in bad]
    return out


# -- report --------------------------------------------------------------------
def summarise(runs: list[dict], paths: list[tuple]) -> list[dict]:
    rows = []
    for key, label, source, engine in paths:
        res = [run["paths"][key] for run in runs]
        cold = [run["paths"]["cold"] for run in runs]
        hit = [run["paths"]["hit"] for run in runs]
        ttft = [x["ttft_s"] for x in res]
        decode = [x["decode_tok_s"] for x in res if x["decode_tok_s"]]
        cold_decode = [c["decode_tok_s"] for c in cold if c["decode_tok_s"]]
        rows.append(
            {
                "key": key,
                "path": label,
                "kv_from": source,
                "engine": engine,
                "rounds": len(res),
                "path_ok": sum(x["path_ok"] for x in res),
                "same_tokens_as_cold": sum(x["same_tokens_as_cold"] for x in res),
                "cached_tokens": sorted({x["cached_tokens"] for x in res}),
                "prompt_tokens": res[0]["prompt_tokens"],
                "loaded_blocks": sorted(
                    {x["moved"].get("loaded_blocks", 0) for x in res}
                ),
                "loaded_bytes": statistics.median(
                    x["moved"].get("loaded_bytes", 0) for x in res
                ),
                "load_copy_calls": statistics.median(
                    x["moved"].get("load_copy_calls", 0) for x in res
                ),
                "load_s": spread([x["moved"].get("load_s", 0.0) for x in res]),
                "ttft_s": spread(ttft),
                "speedup_vs_cold": spread(
                    [c["ttft_s"] / x["ttft_s"] for c, x in zip(cold, res)]
                ),
                "ttft_vs_hit": spread(
                    [x["ttft_s"] / h["ttft_s"] for h, x in zip(hit, res)]
                ),
                "decode_tok_s": spread(decode) if decode else None,
                "decode_vs_cold": spread(
                    [
                        x["decode_tok_s"] / c["decode_tok_s"]
                        for c, x in zip(cold, res)
                        if x["decode_tok_s"] and c["decode_tok_s"]
                    ]
                )
                if decode and cold_decode
                else None,
            }
        )
        if key == "pool":
            pairs = [
                (run["pool_raw_read_s"], x["moved"].get("load_s"))
                for run, x in zip(runs, res)
                if run.get("pool_raw_read_s") and x["moved"].get("load_s")
            ]
            rows[-1]["raw_read_s"] = spread([p[0] for p in pairs]) if pairs else None
            rows[-1]["read_vs_raw"] = (
                spread([raw / engine for raw, engine in pairs]) if pairs else None
            )
        for host_key in ("host_cl", "tier_host"):  # (tier_host: 0.32)
            if key in ("pool", host_key) and host_key in runs[0]["paths"]:
                host = [run["paths"][host_key]["ttft_s"] for run in runs]
                rows[-1][f"ttft_vs_{host_key}"] = spread(
                    [x["ttft_s"] / h for h, x in zip(host, res)]
                )
    return rows


def _range(s: dict | None, fmt: str, scale: float = 1.0) -> str:
    if s is None:
        return "-"
    m, lo, hi = (scale * s[k] for k in ("median", "min", "max"))
    return f"{m:{fmt}} [{lo:{fmt}}, {hi:{fmt}}]"


def print_table(rows: list[dict], meta: dict, info: dict, runs: list[dict]) -> None:
    print(
        f"Prefix reuse on CPU: {meta['layers']}-layer Llama-shaped model "
        f"(hidden {meta['hidden']}, {meta['kv_heads']} KV heads x "
        f"{meta['head_dim']}, float32, random weights), one prompt of "
        f"{meta['prompt_tokens']} tokens ({meta['cacheable_tokens']} in full "
        f"{meta['block_size']}-token blocks = "
        f"{meta['cacheable_tokens'] * meta['kv_bytes_per_token'] / 2**20:.2f} MiB "
        f"of KV), {meta['max_tokens']} tokens generated greedily; "
        f"{meta['rounds']} interleaved round(s), a new prompt each, order rotated; "
        f"{meta['threads_per_engine']} OpenMP thread(s) per engine, "
        f"{meta['cpus']} CPUs, load average {meta['loadavg_start']} at the start, "
        f"{meta['loadavg_end']} at the end."
    )
    print()
    head = [
        "path",
        "KV comes from",
        "path happened (rounds)",
        "tokens from cache / prompt",
        "KV loaded per request (connector counters: blocks, MiB, copies; "
        "transfer ms median)",
        "TTFT ms: median [min, max]",
        "TTFT speed-up vs cold (x): median [min, max]",
        "TTFT / device hit TTFT (x): median [min, max]",
        "decode tok/s: median [min, max]",
        "decode tok/s / cold's (x): median",
        "same tokens as cold (rounds)",
    ]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for row in rows:
        cached = "/".join(str(c) for c in row["cached_tokens"])
        blocks = "/".join(str(b) for b in row["loaded_blocks"])
        loaded = "-"
        if any(row["loaded_blocks"]):
            loaded = f"{blocks} blocks, {row['loaded_bytes'] / 2**20:.1f} MiB"
            copies = row["load_copy_calls"]
            if copies:
                loaded += f", {copies:.0f} cop{'y' if copies == 1 else 'ies'}"
            ms = 1e3 * row["load_s"]["median"]
            loaded += f"; {ms:.{1 if ms < 10 else 0}f} ms"
        dec_ratio = (
            f"{row['decode_vs_cold']['median']:.2f}" if row["decode_vs_cold"] else "-"
        )
        cells = [
            row["path"],
            row["kv_from"],
            f"{row['path_ok']}/{row['rounds']}",
            f"{cached} / {row['prompt_tokens']}",
            loaded,
            _range(row["ttft_s"], ".0f", 1e3),
            _range(row["speedup_vs_cold"], ".2f"),
            _range(row["ttft_vs_hit"], ".2f"),
            _range(row["decode_tok_s"], ".1f"),
            dec_ratio,
            f"{row['same_tokens_as_cold']}/{row['rounds']}",
        ]
        print("| " + " | ".join(cells) + " |")
    print()
    print(
        "TTFT: vLLM's RequestOutput.metrics.first_token_latency (arrival to the "
        "step that returned the first token); decode tok/s: (num_generation_tokens"
        " - 1) / (last_token_ts - first_token_ts).  Ratios are per round (paired)."
    )
    for name, i in info.items():
        if i.get("layout_lines"):
            layout = i["layout_lines"][-1].replace("vllm-overlay: ", "")
        elif name == "stock":
            layout = "stock vLLM (overlay disabled, no KV connector)"
        else:
            layout = "per-layer KV tensors (stock allocation: no layout line)"
        extra = ""
        if i.get("runs_per_block"):
            runs_ = i["runs_per_block"]
            extra = f"; {runs_} cop{'y' if runs_ == 1 else 'ies'} per block"
            if i.get("method"):
                extra += f" ({i['method']})"
        print(
            f"engine {name}: {layout}{extra}; built in {i['engine_s']:.1f} s, "
            f"max RSS {i['max_rss_mib']:.0f} MiB"
        )
    for row in rows:
        if row["key"] == "pool" and row.get("read_vs_raw"):
            print(
                "pool read inside the engine (its load thread: GETs sent to "
                "the last value read and checked) against a raw recv_into "
                "reader of the same keys on the same server right after it "
                f"(rate ratio, paired): {_range(row['read_vs_raw'], '.2f')}x; "
                f"pool reload TTFT / host reload (cross-layer) TTFT: "
                f"{_range(row.get('ttft_vs_host_cl'), '.2f')}x"
                + (
                    "; pool reload TTFT / the host tier's reload TTFT (same "
                    f"tiering config): {_range(row['ttft_vs_tier_host'], '.2f')}x"
                    if row.get("ttft_vs_tier_host")
                    else ""
                )
            )
    prep: dict[str, list[float]] = {}
    for run in runs:
        for name, res in run["prepare"].items():
            prep.setdefault(name, []).append(res["ttft_s"])
    if prep:
        print(
            "cold prefill with the connector storing (the prepare runs, TTFT ms "
            "median): "
            + ", ".join(
                f"{n} {1e3 * statistics.median(v):.0f}" for n, v in prep.items()
            )
        )


def plot(rows: list[dict], meta: dict, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [r["path"].replace(", ", ",\n").replace(" (", "\n(") for r in rows]
    fig, (ax1, ax2) = plt.subplots(
        1, 2, figsize=(13, 5.2), gridspec_kw={"width_ratios": [3, 2]}
    )
    colours = ["#888888", "#4c72b0", "#55a868", "#c44e52", "#dd8452", "#8172b2"]
    ttft = [1e3 * r["ttft_s"]["median"] for r in rows]
    lo = [t - 1e3 * r["ttft_s"]["min"] for t, r in zip(ttft, rows)]
    hi = [1e3 * r["ttft_s"]["max"] - t for t, r in zip(ttft, rows)]
    x = range(len(rows))
    ax1.bar(x, ttft, yerr=[lo, hi], capsize=5, color=colours[: len(rows)])
    top = max(1e3 * r["ttft_s"]["max"] for r in rows)
    if max(ttft) / max(min(ttft), 1e-9) > 20:
        ax1.set_yscale("log")
        ax1.set_ylim(top=top * 3)  # room for the labels
    else:
        ax1.set_ylim(top=top * 1.3)
    for i, (t, r) in enumerate(zip(ttft, rows)):
        speed = r["speedup_vs_cold"]["median"]
        note = f"{t:.0f} ms" + (f"\n{speed:.1f}x faster" if r["key"] != "cold" else "")
        ax1.annotate(
            note,
            (i, 1e3 * r["ttft_s"]["max"]),
            xytext=(0, 4),
            textcoords="offset points",
            ha="center",
            va="bottom",
            fontsize=8,
        )
    ax1.set_xticks(list(x), labels, fontsize=8)
    ax1.set_ylabel("time to first token, ms (median; whiskers min-max)")
    ax1.set_title(
        f"TTFT, {meta['prompt_tokens']}-token prompt, "
        f"{meta['layers']}-layer model ({meta['rounds']} rounds)",
        fontsize=10,
    )
    dec = [r["decode_tok_s"]["median"] if r["decode_tok_s"] else 0 for r in rows]
    dlo = [d - (r["decode_tok_s"] or {"min": d})["min"] for d, r in zip(dec, rows)]
    dhi = [(r["decode_tok_s"] or {"max": d})["max"] - d for d, r in zip(dec, rows)]
    ax2.bar(x, dec, yerr=[dlo, dhi], capsize=5, color=colours[: len(rows)])
    ax2.set_xticks(list(x), labels, fontsize=7)
    ax2.set_ylabel("decode tokens/s (median; whiskers min-max)")
    ax2.set_title(f"decode throughput ({meta['max_tokens']} tokens)", fontsize=10)
    fig.text(
        0.01,
        0.01,
        'TTFT and decode from vLLM\'s request metrics; "x faster" = median over '
        "rounds of the round's cold TTFT / the path's TTFT (paired).  1-min load "
        f"average {(meta['loadavg_start'] or ['?'])[0]} at the start, "
        f"{(meta['loadavg_end'] or ['?'])[0]} at the end.",
        fontsize=7,
    )
    fig.suptitle(
        f"Prefix reuse on CPU (vLLM {meta.get('vllm', '0.11.2')} + vllm-overlay; "
        f"{meta['threads_per_engine']} thread/engine, {meta['cpus']} shared CPUs)",
        fontsize=11,
    )
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def median_cells(keys: list, runs: list[dict], value, fmt: str) -> list[str]:
    """A table row's cells: per path key, the median over the rounds that
    ran it of ``value(the run's result)`` (None: not measured), or "-"."""
    cells = []
    for key in keys:
        seen = [value(run["paths"][key]) for run in runs if key in run["paths"]]
        seen = [x for x in seen if x is not None]
        cells.append(f"{statistics.median(seen):{fmt}}" if seen else "-")
    return cells
