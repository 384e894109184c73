"""The cross-layer series in patches/, applied to a copy of the installed
vLLM 0.11.2 and run with the overlay disabled, behaves like the overlay."""

from __future__ import annotations

import importlib.util
import pathlib
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def patched_tree(tmp_path_factory):
    site = pathlib.Path(importlib.util.find_spec("vllm").origin).parent
    tree = tmp_path_factory.mktemp("patched-vllm")
    shutil.copytree(site, tree / "vllm")
    for line in (ROOT / "patches" / "series").read_text().split():
        subprocess.run(["git", "apply", "-p1", str(ROOT / "patches" / line)],
                       cwd=tree, check=True, capture_output=True)
    return tree


def test_patched_vllm_equals_the_overlay(llm_run, patched_tree):
    config = {"dtype": "float32", "chunked": True, "connector": "probe"}
    overlay = llm_run(config)
    patched = llm_run(config, VLLM_OVERLAY_DISABLE="1",
                      PYTHONPATH=str(patched_tree))
    assert "disabled by VLLM_OVERLAY_DISABLE" in patched.log
    for run in (overlay, patched):
        assert run.kv["cross_layer"] and run.kv["storages"] == 1
        assert run.kv["blocks_contiguous_all_layers"]
        assert run.kv["layout_matches_written_bytes"]
        assert run.kv["connector_registered"] == "cross-layer"
    assert patched.kv["layout"] == overlay.kv["layout"]
    for p in range(2):
        assert patched.tokens(p) == overlay.tokens(p)
        assert patched.logprobs(p) == overlay.logprobs(p)


def test_patched_scheduler_handles_kv_pressure_like_the_overlay(
        patched_tree):
    """patches/kv-pressure in place of KV-01..04: many async loads into a
    small device cache neither stall nor change tokens."""
    from conftest import _memoized

    run = _memoized("run_pressure.py")
    overlay = run({"connector": "offload"})
    patched = run({"connector": "offload", "stall_s": 10},
                  VLLM_OVERLAY_SKIP_PATCHES="KV-01,KV-02,KV-03,KV-04",
                  PYTHONPATH=str(patched_tree))
    assert not any(p["stalled"] for p in patched.passes)
    assert patched.result["overlay"].get("deferred") is None  # no KV-01
    assert patched.result["totals"]["load"]["blocks"] >= 16
    for p in range(2):
        assert [o["tokens"] for o in patched.passes[p]["outputs"]] == \
            [o["tokens"] for o in overlay.passes[p]["outputs"]]
