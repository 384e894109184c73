"""The end of a chaos episode: the nodes' final reports, the stock
reference tokens, and the list of what went wrong (``problems``)."""

from __future__ import annotations

import statistics
import time

from support.chaos_faults import VALUES
from support.chaos_run import ERROR_COUNTERS, Episode, pool_totals

# Threads each pool node must still have at the end: the scheduler's pool
# looks up, the worker's stores and loads (the health thread exists only
# after a fault that closed the whole pool).
REQUIRED_THREADS = ("lookup", "store", "load")
# A request loads its prefix once: a failed load is never retried by the
# same request (transient failures are retried by the next request); a
# request preempted and resumed may load once more.
MAX_LOADS_PER_REQUEST = 2
FINISH_TIMEOUT_S = 60.0
STOCK_TIMEOUT_S = 300.0
TIE_MARGIN = 1e-4  # 10x stock's own drift between a recompute and a hit


def finish(episode: Episode) -> dict:
    """Final reports of the pool nodes (after every request is done)."""
    return {node.name: node.finish(FINISH_TIMEOUT_S) for node in episode.nodes}


def stock_tokens(stock, episodes: list[Episode]) -> dict[str, dict]:
    """Every prompt the episodes sent, computed by the stock node."""
    return stock_results(stock, [s for ep in episodes for s in ep.sent.values()])


def stock_results(stock, sent: list) -> dict[str, dict]:
    """The requests ``sent`` (``chaos_run.Sent``), computed by the stock
    node as it is now."""
    for s in sent:
        stock.send(
            op="submit",
            id=s.req.id,
            prompt=s.req.prompt,
            max_tokens=s.req.max_tokens,
        )
    deadline = time.monotonic() + STOCK_TIMEOUT_S
    out = {}
    for s in sent:
        result = stock.wait_done(s.req.id, max(0.0, deadline - time.monotonic()))
        if result is None:
            raise TimeoutError(
                f"stock node: {s.req.id} not done within {STOCK_TIMEOUT_S:.0f} s\n"
                + stock.log_tail()
            )
        out[s.req.id] = result
    return out


def compared_tokens(stock_result: dict) -> int:
    """How many leading tokens must equal stock's: all of them, up to the
    first near tie (stock's greedy token and the runner-up within
    ``TIE_MARGIN``), where the token itself, and so all after it, may
    differ with stock's own float32 drift between a recompute and a cache
    hit (docs/testing.md, "What correct means here": up to 1e-5)."""
    margins = stock_result.get("margins") or []
    return next(
        (i for i, m in enumerate(margins) if m is not None and m <= TIE_MARGIN),
        len(stock_result["tokens"]),
    )


def equals_stock(result: dict, stock_result: dict) -> bool:
    n = compared_tokens(stock_result)
    return result["tokens"][:n] == stock_result["tokens"][:n]


def problems(episodes: list[Episode], finals: dict, stock: dict | None) -> list[str]:
    """Everything that breaks the chaos test's promises."""
    out: list[str] = []
    for ep in episodes:
        out += ep.failures
        for fault in ep.faults:
            if not fault["resumed"]:
                out.append(
                    f"fault {fault['kind']} at {fault['began_at']} s: the pool "
                    f"did not serve again within {ep.recovery_s:.0f} s "
                    f"(probes {fault['probes']})"
                )
            if fault["kind"] in VALUES:
                out += _refused(fault)
        if stock is not None:
            for req_id, sent in ep.sent.items():
                if sent.result and not equals_stock(sent.result, stock[req_id]):
                    out.append(
                        f"request {req_id} ({sent.req.kind}, node "
                        f"{ep.nodes[sent.req.node].name}, cached "
                        f"{sent.result['cached_tokens']}): tokens "
                        f"{sent.result['tokens']} != stock's "
                        f"{stock[req_id]['tokens']} (stock's smallest top-2 "
                        f"margin {stock[req_id]['margin']})"
                    )
    for name, final in finals.items():
        out += _final_problems(name, final)
    return out


def _refused(fault: dict) -> list[str]:
    where = f"fault {fault['kind']} at {fault['began_at']} s"
    if not fault["prefix_values"]:
        return [f"{where}: node {fault['src']} stored no value of the fresh prefix"]
    out = []
    if fault["load_failures"] < 1:
        out.append(
            f"{where}: node {fault['dst']} loaded the overwritten values "
            f"without refusing one (cached {fault['victim_cached_tokens']})"
        )
    if fault["kind"] == "corrupt_unsigned" and fault["bad_signatures"] < 1:
        out.append(f"{where}: no refusal for a missing signature")
    return out


def _final_problems(name: str, final: dict) -> list[str]:
    out = []
    where = f"node {name} at the end"
    if final["unfinished"]:
        out.append(f"{where}: requests never finished: {final['unfinished']}")
    if final["free_blocks"] != final["total_blocks"]:
        out.append(
            f"{where}: {final['total_blocks'] - final['free_blocks']} KV "
            f"block(s) never freed (scheduler requests "
            f"{final['scheduler_requests']}, connector {final['connector_requests']})"
        )
    if final["scheduler_requests"]:
        out.append(f"{where}: scheduler still holds {final['scheduler_requests']}")
    threads = final["threads"]
    for role in final["totals"]:  # each pool's threads
        dead = [t for t, alive in threads.get(role, {}).items() if not alive]
        if dead:
            out.append(f"{where}: {role} pool thread(s) dead: {dead}")
    alive = threads.get("process", [])
    for suffix in REQUIRED_THREADS:
        if not any(t.endswith("-" + suffix) for t in alive):
            out.append(f"{where}: no live pool {suffix} thread (live: {alive})")
    for role, totals in final["totals"].items():
        if totals.get("internal_errors"):
            out.append(
                f"{where}: the {role} pool counted {totals['internal_errors']} "
                "internal error(s) (a job that raised: see the node log)"
            )
    if final["connector_requests"]:
        out.append(f"{where}: the connector still tracks {final['connector_requests']}")
    looping = {
        r: n for r, n in final["loads_per_request"].items() if n > MAX_LOADS_PER_REQUEST
    }
    if looping:
        out.append(
            f"{where}: request(s) loaded their prefix again and again (a "
            f"failed load retried by the same request): loads {looping}"
        )
    for err in final["thread_errors"]:
        out.append(f"{where}: thread {err['thread']} raised:\n{err['error']}")
    for err in final.get("errors", ()):  # what a node command found wrong
        out.append(f"node {name}: {err}")
    return out


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, max(0, round(q / 100 * len(values)) - 1))]


def summary(episodes: list[Episode], finals: dict) -> dict:
    """Requests served, faults by kind, error counters, TTFT percentiles."""
    ttft = [
        s.result["ttft"]
        for ep in episodes
        for s in ep.sent.values()
        if s.result and s.result["ttft"] is not None
    ]
    faults: dict[str, int] = {}
    for ep in episodes:
        for f in ep.faults:
            faults[f["kind"]] = faults.get(f["kind"], 0) + 1
    errors = {k: 0 for k in ERROR_COUNTERS}
    refusals: dict[str, int] = {}
    for final in finals.values():
        totals = pool_totals(final["totals"])
        for k in ERROR_COUNTERS:
            errors[k] += totals.get(k, 0)
        for reason, n in final["refusals"].items():
            refusals[reason] = refusals.get(reason, 0) + n
    served = sum(1 for ep in episodes for s in ep.sent.values() if s.result)
    loaded = sum(
        pool_totals(f["totals"]).get("loaded_blocks", 0) for f in finals.values()
    )
    return {
        "requests_sent": sum(len(ep.sent) for ep in episodes),
        "requests_served": served,
        "blocks_loaded": loaded,
        "faults": faults,
        "errors": errors,
        "refusals": refusals,
        "ttft_p50_ms": _ms(percentile(ttft, 50)),
        "ttft_p99_ms": _ms(percentile(ttft, 99)),
        "ttft_mean_ms": _ms(statistics.fmean(ttft) if ttft else None),
    }


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1e3, 1)


def request_rows(episode: Episode, stock: dict | None) -> list[dict]:
    """One row per request sent: when, where, what came back."""
    rows = []
    for req_id, s in episode.sent.items():
        r = s.result or {}
        rows.append(
            {
                "id": req_id,
                "node": episode.nodes[s.req.node].name,
                "kind": s.req.kind,
                "family": s.req.family,
                "sent_at": round(s.t - episode.t0, 2),
                "ttft_ms": _ms(r.get("ttft")),
                "e2e_ms": _ms(r.get("e2e")),
                "prompt_tokens": r.get("prompt_tokens"),
                "cached_tokens": r.get("cached_tokens"),
                "timed_out": s.timed_out,
                "equals_stock": None
                if stock is None or not r
                else equals_stock(r, stock[req_id]),
            }
        )
    return rows
