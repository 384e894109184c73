"""patches/tools/run_upstream_tests_032.py: vLLM 0.32.0's own tests with
and without the overlay must agree test by test (the run itself is in tox's
``patches`` environment)."""

from __future__ import annotations

import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "patches" / "tools"))
import run_upstream_tests_032 as runner  # noqa: E402


def test_a_test_that_fails_only_with_the_overlay_is_a_difference():
    stock = {"a": "passed", "b": "failed", "c": "skipped", "d": "passed"}
    overlay = {"a": "passed", "b": "error", "c": "skipped", "d": "failed"}
    both, differ = runner.compare(stock, overlay)
    assert both == ["b"]  # failing in both: listed, not a difference
    assert differ == [
        "  b: stock failed, overlay error",
        "  d: stock passed, overlay failed",
    ]
    assert runner.compare(stock, dict(stock)) == (["b"], [])
    assert runner.compare(stock, {})[1][0] == "  a: stock passed, overlay not run"


def test_the_selection_covers_what_the_overlay_plugs_into():
    assert set(runner.SELECT) >= {
        "tests/v1/kv_offload",
        "tests/v1/kv_connector/unit/offloading_connector",
        "tests/engine/test_arg_utils.py",
    }
    for path, why in runner.DESELECT.items():
        assert why and any(path.startswith(s) for s in runner.SELECT), path
