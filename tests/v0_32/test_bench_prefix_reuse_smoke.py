"""The prefix-reuse benchmark on vLLM 0.32, --quick: every path happens
(vLLM's own hits by source say where its KV came from, the worker and the
pool tier their blocks), computes the cold run's tokens, and each reload's
phases are printed (tiny model, one round, five engines; ~1-2 min on 2 quiet
cores)."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

from vllm_overlay.testing.redis import missing_server

ROOT = pathlib.Path(__file__).resolve().parents[2]
SOURCES = {  # path -> where vLLM says its hit came from (CacheHitSource)
    "cold": set(),
    "hit": set(),
    "host_cl": {"host"},
    "host_pl": {"host"},
    "tier_host": {"host"},
    "pool": {"external_unspecified"},
}


def test_prefix_reuse_quick_on_032_runs_every_path(tmp_path):
    # The benchmark's default pool server (Valkey): the harness installs it.
    assert missing_server() is None, missing_server()
    json_path = tmp_path / "out.json"
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "bench_prefix_reuse.py"),
            "--quick",
            "--vllm",
            "0.32",
            "--json",
            str(json_path),
            "--png",
            str(tmp_path / "out.png"),
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    result = json.loads(json_path.read_text())
    assert not result["problems"]
    assert result["meta"]["vllm"] == "0.32"
    assert [r["key"] for r in result["rows"]] == list(SOURCES)
    for row in result["rows"]:
        assert row["path_ok"] == row["same_tokens_as_cold"] == 1, row

    run = result["runs"][0]["paths"]
    cacheable = result["meta"]["cacheable_tokens"]
    assert cacheable > 0
    assert run["cold"]["cached_tokens"] == 0
    for key, sources in SOURCES.items():
        assert set(run[key]["hits_by_source"]) == sources, key
        if key != "cold":
            assert run[key]["cached_tokens"] == cacheable, key
    blocks = cacheable // result["meta"]["block_size"]
    for key in ("host_cl", "host_pl", "tier_host", "pool"):
        assert run[key]["moved"]["loaded_blocks"] == blocks, key  # host->device
    assert run["pool"]["moved"]["pool_loaded_blocks"] == blocks  # pool->host
    assert run["tier_host"]["moved"]["pool_loaded_blocks"] == 0
    # per-layer: a copy per layer and block; cross-layer: one per request
    assert (
        run["host_pl"]["moved"]["load_copy_calls"]
        > (run["host_cl"]["moved"]["load_copy_calls"])
    )
    # the pool reload went through every phase, in order
    events = run["pool"]["events"]
    order = ["lookup", "answered", "tier_submit", "first_value", "read_done"]
    order += ["promoted", "h2d_submit", "h2d_seen", "first_token"]
    assert [events[e] for e in order] == sorted(events[e] for e in order)
    assert 0 <= events["lookup"] < events["first_token"] < run["pool"]["ttft_s"] + 0.01
    assert "| load thread: the rest read + checked |" in proc.stdout
    # where the load thread's read went: the kernel's accounting, sampled
    usage = run["pool"]["read_usage"]
    assert usage["wall_s"] >= usage["cpu_s"] > 0 and usage["runq_s"] >= 0
    assert usage["process_cpu_s"] >= usage["cpu_s"] - 0.01
    assert "server_cpu_s" in usage  # the benchmark's Valkey, by its pid
    assert not run["tier_host"].get("read_usage")  # its own host tier
    assert "| the load thread on a core |" in proc.stdout
    assert "pool reload, 2nd engine: external_unspecified" in proc.stdout
