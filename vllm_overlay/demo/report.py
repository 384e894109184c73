"""The demo's table and notes, from the engines' results (no vLLM here)."""

from __future__ import annotations

import statistics


def _ttft_values(entry: dict) -> list[float]:
    return [r["ttft_s"] if r["ttft_s"] else r["wall_s"] for r in entry["requests"]]


def _tokens(entry: dict | None) -> list | None:
    return None if entry is None else [r["tokens"] for r in entry["requests"]]


def copy_outcome(entry: dict, recompute: dict | None, stock: dict | None) -> dict:
    """Copy accuracy and exact copies of a pass; whether its tokens equal the
    recompute's (this engine's cold pass) and stock vLLM's (None: no stock
    run to compare with)."""
    reqs = entry["requests"]
    correct = sum(r["correct"] for r in reqs)
    wanted = sum(r["wanted"] for r in reqs)
    return {
        "accuracy": correct / wanted if wanted else 0.0,
        "exact": sum(r["exact"] for r in reqs),
        "prompts": len(reqs),
        "all_exact": all(r["exact"] for r in reqs),
        "same_tokens_as_recompute": recompute is None
        or _tokens(entry) == _tokens(recompute),
        "same_tokens_as_stock": None
        if stock is None
        else _tokens(entry) == _tokens(stock),
    }


def row(
    path: str,
    source: str,
    entry: dict,
    info: dict | None,
    recompute: dict | None,
    moved_in: tuple[int, int] | None = None,
    stock: dict | None = None,
) -> dict:
    """One line of the table: ``moved_in`` (blocks, bytes) loaded by a
    connector; ``stock``: stock vLLM's pass to compare tokens with."""
    reqs = entry["requests"]
    blocks, nbytes = moved_in if moved_in else (0, 0)
    return {
        "path": path,
        "kv_from": source,
        "cached_tokens": sum(r["cached_tokens"] for r in reqs),
        "prompt_tokens": sum(r["prompt_tokens"] for r in reqs),
        "blocks_in": blocks,
        "bytes_in": nbytes,
        "copies_per_block": (info["runs_per_block"] if moved_in and info else None),
        "ttft_ms": 1000 * statistics.median(_ttft_values(entry)),
        "ttft_best_ms": 1000 * min(_ttft_values(entry)),
        "copy": copy_outcome(entry, recompute, stock),
    }


def fmt_bytes(n: int) -> str:
    if n >= 1 << 20:
        return f"{n / 2**20:.2f} MiB"
    if n >= 1 << 10:
        return f"{n / 2**10:.0f} KiB"
    return f"{n} B"


def _yes(flag: bool | None) -> str:
    return "-" if flag is None else ("yes" if flag else "NO")


def print_table(rows: list[dict]) -> None:
    with_stock = any(r["copy"]["same_tokens_as_stock"] is not None for r in rows)
    head = [
        "path",
        "KV from",
        "tokens from cache",
        "blocks in",
        "bytes in",
        "copies/block",
        "copy (acc, exact)",
        *(["tokens = stock"] if with_stock else []),
        "TTFT ms (best)",
    ]
    body = []
    for r in rows:
        c = r["copy"]
        body.append(
            [
                r["path"],
                r["kv_from"],
                f"{r['cached_tokens']}/{r['prompt_tokens']}",
                str(r["blocks_in"]),
                fmt_bytes(r["bytes_in"]) if r["bytes_in"] else "0",
                str(r["copies_per_block"]) if r["copies_per_block"] else "-",
                f"{c['accuracy']:.3f}, {_yes(c['all_exact'])} "
                f"{c['exact']}/{c['prompts']}",
                *([_yes(c["same_tokens_as_stock"])] if with_stock else []),
                f"{r['ttft_ms']:.1f} ({r['ttft_best_ms']:.1f})",
            ]
        )
    widths = [max(len(x) for x in col) for col in zip(head, *body)]

    def line(cells: list[str]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"

    print(line(head))
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for cells in body:
        print(line(cells))


def speed_note(recompute_ms: float, reload_ms: float, prompt_tokens: str) -> str:
    """What this run measured, recompute against host reload, in words
    derived from the numbers (never a fixed claim about which is faster)."""
    measured = (
        f"* In this run the host reload took {reload_ms:.1f} ms and the "
        f"recompute {recompute_ms:.1f} ms (median time to first token)"
    )
    if reload_ms < recompute_ms:
        verdict = f": the reload was {recompute_ms / reload_ms:.2f}x faster."
    elif reload_ms > recompute_ms:
        verdict = (
            f": the recompute was {reload_ms / recompute_ms:.2f}x faster (a "
            "reload is an asynchronous load, which costs the scheduler extra "
            "steps)."
        )
    else:
        verdict = ": the same."
    return (
        measured
        + verdict
        + f" On CPU the 2-layer, 64-wide copy model prefills {prompt_tokens} "
        "tokens in milliseconds, and on a shared CPU one run's timings are "
        "noisy (the best of each row is in brackets); reloading pays off where "
        "prefill is expensive (big models, long prompts: "
        "benchmarks/bench_prefix_reuse.py). This demo shows what moves and "
        "that the copy stays exact, not speed."
    )
