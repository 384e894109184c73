"""Shared KV pool soak: the chaos test's nodes, workload and fault injector
(tests/support/chaos_*.py) run for ``--minutes``, in windows that alternate
between fault-free and faulty (the order flips every repeat: ABBA), so
both see the same machine over time.

Each window sends its own prompts (the same seeded mix of prefix-sharing
and unrelated requests, a tag keeps windows from sharing prefixes); a
faulty window injects a seeded schedule of faults (SIGSTOP/SIGCONT, kill
and restart, CLIENT PAUSE, maxmemory, values overwritten with wrong,
unsigned or other-layout bytes), each followed by the pool-resumes check.
TTFT percentiles are over the background requests (the same mix in both
kinds of window; probes and victims excluded), measured by the engine
(request added -> first token).  At the end every prompt is computed by a
stock engine (tokens compared), and the nodes report their blocks and pool
threads.

On the vLLM this interpreter runs: 0.11.2 (nodes with the overlay's
``SharedKVPoolConnector``) or 0.32 (``.venv-0.32``: nodes with upstream's
``OffloadingConnector``, host memory and the pool tier; chaos_node_v032.py,
chaos_cluster_v032.py: node ``a``'s pool link through a proxy, and with
``layouts`` a third engine with cross-layer blocks).  ``--kinds``: the
fault kinds (default the server and value faults, on either release; on
0.32 also ``reset_cache``, ``failed_copy``, ``weights_update``,
``slow_reset``, ``layouts``: tests/support/chaos_run_v032.py).  After a
``weights_update`` every request is compared with stock running its node's
weights at the time.

    python benchmarks/soak_pool.py --minutes 5 [--repeats 3] [--seed 19]
        [--json out.json] [--logs DIR] [--kinds sigstop,kill,...]
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import pathlib
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from support.chaos_cluster import NODE_SCRIPT, Cluster  # noqa: E402
from support.chaos_faults import KINDS, FaultInjector, schedule  # noqa: E402
from support.chaos_report import (  # noqa: E402
    equals_stock,
    finish,
    percentile,
    problems,
    stock_tokens,
)
from support.chaos_run import ERROR_COUNTERS, Episode, pool_totals  # noqa: E402
from support.chaos_workload import Workload  # noqa: E402

BACKGROUND = ("family", "unrelated")
FAULT_EVERY_S = 12.0  # about one fault per this many seconds of a faulty window
V032 = importlib.metadata.version("vllm").startswith("0.32.")
if V032:
    from support.chaos_cluster_v032 import Cluster032  # noqa: E402
    from support.chaos_identity_v032 import stock_tokens_v032  # noqa: E402
    from support.chaos_run_v032 import (  # noqa: E402
        KINDS_V032,
        NODE_FAULTS,
        Episode032,
        problems_v032,
    )


def counters(episode: Episode) -> dict[str, int]:
    """Both pool nodes' error counters (all their pools), now."""
    out = dict.fromkeys(ERROR_COUNTERS, 0)
    for j in range(len(episode.nodes)):
        totals = pool_totals(episode.stats(j)["totals"])
        for k in ERROR_COUNTERS:
            out[k] += totals.get(k, 0)
    return out


def window(cluster, injector, seed: int, tag: str, seconds: float, faulty: bool, kinds):
    workload = Workload(seed, tag=tag)
    episode = (Episode032 if V032 else Episode)(cluster, workload, injector, seed=seed)
    before = counters(episode)
    start = time.monotonic()
    plan = []
    if faulty:  # the kinds in turn across windows
        n = max(1, round(seconds / FAULT_EVERY_S))
        plan = schedule(seed, n, first=sum(injector.counts.values()), kinds=kinds)
    episode.run(plan, tail_s=0.0, min_s=seconds)  # the same length either way
    after = counters(episode)
    return {
        "tag": tag,
        "faulty": faulty,
        "episode": episode,
        "seconds": time.monotonic() - start,
        "errors": {k: after[k] - before[k] for k in ERROR_COUNTERS},
    }


def table(rows: list[tuple[str, str, str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    lines = [
        "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |" for r in rows
    ]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=3.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=19)
    ap.add_argument("--json", help="write the raw figures here")
    ap.add_argument("--logs", help="keep the nodes' logs in this folder")
    ap.add_argument("--kinds", default=",".join(KINDS), help="fault kinds, in turn")
    args = ap.parse_args()
    kinds = tuple(args.kinds.split(","))
    unknown = set(kinds) - set(KINDS_V032 if V032 else KINDS)
    if unknown:
        ap.error(f"unknown fault kinds on this vLLM: {sorted(unknown)}")
    seconds = args.minutes * 60 / (2 * args.repeats)
    windows = []
    wall = time.monotonic()
    with (
        tempfile.TemporaryDirectory(prefix="soak-pool-") as tmp,
        cluster_for(pathlib.Path(args.logs or tmp), kinds) as cluster,
    ):
        cluster.wait_ready()
        injector = FaultInjector(cluster.server, cluster.mac_key, args.seed)
        for r in range(args.repeats):
            order = (False, True) if r % 2 == 0 else (True, False)
            for faulty in order:
                tag = f"r{r}{'x' if faulty else 'o'}"
                print(
                    f"window {tag} ({'faults' if faulty else 'no faults'})", flush=True
                )
                windows.append(
                    window(
                        cluster, injector, args.seed + r, tag, seconds, faulty, kinds
                    )
                )
        episodes = [w["episode"] for w in windows]
        finals = finish(episodes[0])
        if V032:
            stock = stock_tokens_v032(cluster.stock, cluster, episodes)
        else:
            stock = stock_tokens(cluster.stock, episodes)
        found = problems(episodes, finals, stock)
        if V032:  # (each window checks the run so far: once each)
            found += list(
                dict.fromkeys(p for ep in episodes for p in problems_v032(ep))
            )
    wall = time.monotonic() - wall
    figures = {
        k: summarize([w for w in windows if w["faulty"] is k], stock)
        for k in (False, True)
    }
    faults = {kind: 0 for kind in kinds}
    for w in windows:
        for f in w["episode"].faults:
            faults[f["kind"]] += 1
    print()
    during, updated = node_fault_figures(windows, stock) if V032 else ({}, None)
    print(render(figures, faults, args, wall, during, updated))
    print(f"\nproblems: {len(found)}")
    for p in found:
        print(" -", p.splitlines()[0])
    if args.json:
        pathlib.Path(args.json).write_text(
            json.dumps(
                {
                    "args": vars(args),
                    "figures": {str(k): v for k, v in figures.items()},
                    "faults": faults,
                    "during": during,
                    "updated_weights": updated,
                    "problems": found,
                    "finals": finals,
                    "resumed_after_s": [
                        (f["kind"], f["resumed_after_s"])
                        for w in windows
                        for f in w["episode"].faults
                    ],
                    # What each 0.32 node fault did (its probes and threads
                    # left out).
                    "node_faults": [
                        {
                            k: v
                            for k, v in f.items()
                            if k not in ("threads", "probes", "requests")
                        }
                        for w in windows
                        for f in w["episode"].faults
                        if V032 and f["kind"] in NODE_FAULTS
                    ],
                },
                indent=1,
                default=str,
            )
        )


def node_fault_figures(windows: list[dict], stock: dict):
    """(requests sent during each 0.32 node fault kind, != stock) and, by
    window kind, (requests on updated weights, != stock)."""
    during: dict[str, list[int]] = {}
    updated = {False: [0, 0], True: [0, 0]}
    for w in windows:
        ep = w["episode"]
        for f in ep.faults:
            if f["kind"] in ("weights_update", "slow_reset", "layouts"):
                row = during.setdefault(f["kind"], [0, 0])
                for req_id in f["requests"]:
                    row[0] += 1
                    row[1] += _wrong(ep.sent[req_id], stock)
        for req_id, sent in ep.sent.items():
            if ep.versions.get(req_id):
                updated[w["faulty"]][0] += 1
                updated[w["faulty"]][1] += _wrong(sent, stock)
    return {k: tuple(v) for k, v in during.items()}, {
        k: tuple(v) for k, v in updated.items()
    }


def _wrong(sent, stock: dict) -> int:
    return int(
        sent.result is not None and not equals_stock(sent.result, stock[sent.req.id])
    )


def cluster_for(workdir: pathlib.Path, kinds):
    if V032:  # a third engine only for the layouts fault
        return Cluster032(workdir, layouts="layouts" in kinds)
    return Cluster(workdir, script=NODE_SCRIPT)


def summarize(windows: list[dict], stock: dict) -> dict:
    sent = [s for w in windows for s in w["episode"].sent.values()]
    background = [s for s in sent if s.req.kind in BACKGROUND and s.result]
    ttft = [s.result["ttft"] for s in background if s.result["ttft"] is not None]
    errors = dict.fromkeys(ERROR_COUNTERS, 0)
    for w in windows:
        for k, v in w["errors"].items():
            errors[k] += v
    return {
        "windows": len(windows),
        "seconds": sum(w["seconds"] for w in windows),
        "sent": len(sent),
        "served": sum(1 for s in sent if s.result),
        "timed_out": sum(1 for s in sent if s.timed_out),
        "mismatched": sum(
            1 for s in sent if s.result and not equals_stock(s.result, stock[s.req.id])
        ),
        "ttft_n": len(ttft),
        "ttft_p50_ms": round(percentile(ttft, 50) * 1e3, 1) if ttft else None,
        "ttft_p99_ms": round(percentile(ttft, 99) * 1e3, 1) if ttft else None,
        "errors": errors,
    }


def render(
    figures: dict, faults: dict, args, wall: float, during=None, updated=None
) -> str:
    """The table; ``during``: kind -> (requests sent during those faults,
    how many != stock); ``updated``: faulty -> (requests after a weight
    update of their node, how many != stock)."""
    during = during or {}
    free, faulty = figures[False], figures[True]
    rows = [("", "fault-free", "with faults")]
    rows.append(
        (
            "windows (s of traffic)",
            f"{free['windows']} ({free['seconds']:.0f})",
            f"{faulty['windows']} ({faulty['seconds']:.0f})",
        )
    )
    rows.append(
        (
            "requests served / sent",
            f"{free['served']} / {free['sent']}",
            f"{faulty['served']} / {faulty['sent']}",
        )
    )
    for name, key in (
        ("past their deadline", "timed_out"),
        ("tokens != stock", "mismatched"),
    ):
        rows.append((name, str(free[key]), str(faulty[key])))
    for q in ("p50", "p99"):
        rows.append(
            (
                f"TTFT {q}, ms (n={free['ttft_n']} / {faulty['ttft_n']})",
                str(free[f"ttft_{q}_ms"]),
                str(faulty[f"ttft_{q}_ms"]),
            )
        )
    for kind, n in faults.items():
        rows.append((f"faults injected: {kind}", "0", str(n)))
    for kind, (n, wrong) in during.items():
        rows.append((f"sent during {kind}: tokens != stock", "-", f"{wrong} of {n}"))
    if updated is not None:
        rows.append(
            (
                "with updated weights: tokens != stock",
                f"{updated[False][1]} of {updated[False][0]}",
                f"{updated[True][1]} of {updated[True][0]}",
            )
        )
    for k in ERROR_COUNTERS:
        rows.append(
            (f"pool counter: {k}", str(free["errors"][k]), str(faulty["errors"][k]))
        )
    head = (
        f"soak_pool.py --minutes {args.minutes:g} --repeats {args.repeats} "
        f"--seed {args.seed} --kinds {args.kinds} (vLLM "
        f"{importlib.metadata.version('vllm')}): {wall / 60:.1f} min wall"
    )
    return head + "\n\n" + table(rows)


if __name__ == "__main__":
    main()
