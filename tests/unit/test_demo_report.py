"""The demo's note on speed says what the run measured, whichever way it
went (vllm_overlay/demo/report.py; no vLLM needed)."""

from __future__ import annotations

from vllm_overlay.demo.report import copy_outcome, speed_note


def test_a_slower_reload_is_reported_as_measured():
    note = speed_note(recompute_ms=4.8, reload_ms=8.1, prompt_tokens="330-394")
    assert note.startswith(
        "* In this run the host reload took 8.1 ms and the recompute 4.8 ms"
    )
    assert "the recompute was 1.69x faster" in note
    assert "the reload was" not in note


def test_a_faster_reload_is_reported_as_measured():
    note = speed_note(recompute_ms=15.2, reload_ms=13.1, prompt_tokens="330-394")
    assert "the host reload took 13.1 ms and the recompute 15.2 ms" in note
    assert "the reload was 1.16x faster" in note
    assert "the recompute was" not in note
    assert "330-394 tokens" in note


def _pass(tokens: list[list[int]]) -> dict:
    return {
        "requests": [
            {"tokens": t, "correct": 2, "wanted": 2, "exact": True} for t in tokens
        ]
    }


def test_tokens_are_compared_with_the_recompute_and_with_stock():
    ours, other = _pass([[1, 2], [3, 4]]), _pass([[1, 2], [3, 5]])
    same = copy_outcome(ours, ours, ours)
    assert same["same_tokens_as_recompute"] and same["same_tokens_as_stock"]
    differ = copy_outcome(ours, ours, other)
    assert differ["same_tokens_as_recompute"] and not differ["same_tokens_as_stock"]
    assert copy_outcome(ours, None, None)["same_tokens_as_stock"] is None
