"""What each replay must show: no failed request, and hits from where the
configuration says they come from."""

from __future__ import annotations

import report

# The column a configuration's connector reports its hits in (None: none).
CONNECTOR_COLUMN = {"a": None, "b": None, "c": "pool", "d": "pool", "e": "external"}


def ideal_hits(work: dict, block: int) -> int:
    """Hit tokens if every turn found its previous prompt's full blocks
    (the first turn: its system prompt's) where it runs; vLLM serves at
    most the prompt's full blocks short of its last token."""
    previous = {}
    total = 0
    for turn in work["turns"]:
        key = (turn.conversation, turn.index - 1)
        prefix = len(previous[key]) if turn.index else len(work["systems"][turn.system])
        total += min(prefix // block, (len(turn.prompt) - 1) // block) * block
        previous[(turn.conversation, turn.index)] = turn.prompt
    return total


def moved_turns(run: dict, block: int) -> dict[int, int]:
    """Per node, the turns it served whose previous turn ran on the other
    node (the proxy's ``X-Routed-To``) and whose previous prompt had full
    blocks past the system prompt (blocks only another node computed)."""
    requests = {(r["conversation"], r["turn"]): r for r in run["requests"]}
    moved: dict[int, int] = {}
    for (conv, turn), r in requests.items():
        before = requests.get((conv, turn - 1))
        if not turn or before is None:
            continue
        if None in (r.get("node"), before.get("node")):
            continue
        own = before["prompt_tokens"] // block > r["system_tokens"] // block
        if own and r["node"] != before["node"]:
            moved[int(r["node"])] = moved.get(int(r["node"]), 0) + 1
    return moved


def problems(runs: list[dict], block: int) -> list[str]:
    out = []
    for run in runs:
        name = f"({run['config']}) repeat {run['repeat']}"
        errors = [r["error"] for r in run["requests"] if "error" in r]
        if errors:
            out.append(f"{name}: {len(errors)} request(s) failed: {errors[0]}")
        hits, column = run["hits"], CONNECTOR_COLUMN[run["config"]]
        foreign = {c for c in ("host", "pool", "external") if hits.get(c)}
        if column is None and foreign:
            out.append(f"{name}: no connector, yet hits from {sorted(foreign)}")
        if run["config"] == "b" and hits["device"] != run["ideal_hits"]:
            out.append(
                f"{name}: sticky routing hit {hits['device']} device tokens, "
                f"not the ideal {run['ideal_hits']} (device cache too small?)"
            )
        if not run_trouble(run):
            out += [f"{name}: {text}" for text in unserved_moves(run, block)]
    return out


def unserved_moves(run: dict, block: int) -> list[str]:
    """The nodes that served turns whose previous turn ran on another
    node, yet got no hits from the configuration's connector column."""
    column = CONNECTOR_COLUMN[run["config"]]
    if column is None:
        return []
    return [
        f"node {node} served {n} turn(s) whose previous turn ran on another "
        f"node, with no {column} hits" + pool_trouble(run["nodes"][node])
        for node, n in moved_turns(run, block).items()
        if not run["nodes"][node].get(column)
    ]


def run_trouble(run: dict) -> str:
    """The pool tier's failures and pauses in this repeat, on any node
    (the writer's count as much as the reader's: a store the pool dropped
    while paused is a later miss elsewhere)."""
    for counts in (run["hits"], *run["nodes"]):
        trouble = pool_trouble(counts)
        if trouble:
            return trouble
    return ""


def notes(runs: list[dict], block: int) -> list[str]:
    """Where vLLM's hit counters and the answers' cached tokens disagree
    (0.32: e.g. a preempted request admitted twice); and moved turns
    without pool hits in a repeat where the pool tier failed or paused
    (a loaded machine can stall the server past the tier's deadlines: its
    requests then recompute, as designed, and the table's ``pool pauses``
    shows it), which are problems in a repeat without trouble."""
    out = []
    for run in runs:
        trouble = run_trouble(run)
        if trouble:
            name = f"({run['config']}) repeat {run['repeat']}"
            out += [
                f"{name}: {text}; the pool tier failed or paused in this "
                f"repeat{trouble}: those turns recomputed, as designed"
                for text in unserved_moves(run, block)
            ]
        hits = run["hits"]
        counted = sum(hits.get(c, 0) for c in ("device", "host", "pool"))
        if "raw" in hits and counted != hits.get("cached", counted):
            out.append(
                f"({run['config']}) repeat {run['repeat']}: vLLM's metrics count "
                f"{counted} hit tokens, the answers {hits['cached']}"
            )
    return out


TROUBLE = ("pauses", "lookup_timeouts", "slow", "unreachable", "errors")


def pool_trouble(counts: dict) -> str:
    """The pool tier's failures and pauses in these counts, if any."""
    tier = counts.get("pool_tier") or {}
    seen = {k: tier[k] for k in TROUBLE if tier.get(k)}
    return f" (pool tier: {seen})" if seen else ""


def progress(run: dict) -> str:
    n = report.run_numbers(run)
    hits = run["hits"]
    cols = "/".join(str(hits.get(c, 0)) for c in report.HIT_COLUMNS)
    return (
        f"repeat {run['repeat']} ({run['config']}): {len(run['requests'])} requests "
        f"in {run['wall_s']:.1f} s, routed {run['routed']}; TTFT p50 "
        f"{n['ttft_p50_ms']:.0f} ms, p90 {n['ttft_p90_ms']:.0f} ms; hit tokens "
        f"device/host/pool/external {cols} (ideal {run['ideal_hits']}), "
        f"prefilled {hits.get('computed', '-')} of {hits.get('prompt_tokens')}"
        + pool_trouble(hits)
    )
