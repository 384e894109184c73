"""Two ``vllm serve`` nodes of vLLM 0.11.2 with MultiConnector(
OverlayOffloadingConnector, SharedKVPoolConnector) share a real
redis-server: node A computes the prompts, then serves them from its host
memory (after ``/reset_prefix_cache`` emptied its device cache); node B, a
new server with empty host memory, loads them from the pool, then serves
them from its host memory.  Every answer equals stock 0.11.2's (in-process
run_pool.py, one request at a time): tokens and logprobs bit for bit, and
the cached-token counts of a device prefix-cache hit.

Under ``vllm serve`` the stats reach the API server, where MultiConnector
requires Prometheus metrics of every connector that reports stats (before
the overlay's connectors had them, every request failed with HTTP 500);
the counters in /metrics say which tier served what.
"""

from __future__ import annotations

import json
import pathlib
import sys
import time
import urllib.request

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
from run_pool import prompts  # noqa: E402
from support.redis_server import redis_server  # noqa: E402
from support.served_vllm import (  # noqa: E402
    SERVED_NAME,
    complete,
    harness_env,
    post,
    served_model,
)

CONFIG = {
    "model_name": "vllm_overlay/models/tiny_llama",
    "model_args": {
        "dtype": "float32",
        "max_model_len": 1024,
        "num_gpu_blocks_override": 48,
        "enforce_eager": True,
        "seed": 0,
    },
}
HIT = [3 * 128, 2 * 128]


def kv_transfer_config(url: str) -> str:
    from vllm_overlay.testing.v0_11_2 import TEST_POOL_OPTIONS

    return json.dumps(
        {
            "kv_connector": "MultiConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "connectors": [
                    {
                        "kv_connector": "OverlayOffloadingConnector",
                        "kv_role": "kv_both",
                        "kv_connector_extra_config": {"cpu_bytes": 64 * 2**20},
                    },
                    {
                        "kv_connector": "SharedKVPoolConnector",
                        "kv_role": "kv_both",
                        "kv_connector_extra_config": {"url": url, **TEST_POOL_OPTIONS},
                    },
                ]
            },
        }
    )


def reset_prefix_cache(port: int) -> None:
    """Empty the device prefix cache once the stores are done: short
    requests run the steps that finish them (0.11.2's endpoint does not say
    whether the reset succeeded; the counters and the cached-token counts
    of the next pass do)."""
    for _ in range(2):
        post(port, "/v1/completions", {"model": SERVED_NAME, "prompt": "hi"})
    post(port, "/reset_prefix_cache")


def counters(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith("vllm:overlay_") and "_total{" in line:
            out[line.split("_total{")[0]] = float(line.rsplit(" ", 1)[1])
    return out


def node(url: str, log: pathlib.Path) -> dict:
    flags = ["--enable-prompt-tokens-details"]
    flags += ["--kv-transfer-config", kv_transfer_config(url)]
    # /reset_prefix_cache; vLLM's stats log every 0.5 s
    env = harness_env(VLLM_SERVER_DEV_MODE="1", VLLM_LOG_STATS_INTERVAL="0.5")
    with served_model(CONFIG, log, flags, env) as port:
        first = [complete(port, p) for p in prompts("shared")]
        reset_prefix_cache(port)
        second = [complete(port, p) for p in prompts("shared")]
        reset_prefix_cache(port)  # (its steps report the last stats)
        return {
            "passes": [first, second],
            "counters": counters(port),
            "log": logged_stats(
                log, ("OverlayOffloadingConnector", "SharedKVPoolConnector")
            ),
        }


def logged_stats(
    log: pathlib.Path, names: tuple[str, ...], deadline_s: float = 20.0
) -> str:
    """The server's log once vLLM's periodic stats logger has logged a
    "KV Transfer metrics" line for each connector in ``names`` (the logger
    runs on its own interval, so the last line can come after the last
    answer), or whatever it holds at the deadline."""
    end = time.monotonic() + deadline_s
    while True:
        text = log.read_text(errors="replace")
        lines = [line for line in text.splitlines() if "KV Transfer metrics" in line]
        if (
            all(any(n in line for line in lines) for n in names)
            or time.monotonic() > end
        ):
            return text
        time.sleep(0.2)


def test_two_served_nodes_host_then_pool(tmp_path):
    from conftest import _memoized

    # Stock's run, shared with test_shared_pool_e2e and
    # test_multi_connector_e2e (the same arguments: one process a session).
    stock = _memoized("run_pool.py")(
        {"url": None, "prompts": "shared", "repeat": True}, VLLM_OVERLAY_DISABLE="1"
    )
    with redis_server() as server:
        a = node(server.url, tmp_path / "serve-a.log")
        b = node(server.url, tmp_path / "serve-b.log")

    def same(got, want):
        assert [x["tokens"] for x in got] == [x["tokens"] for x in want]
        assert [x["logprobs"] for x in got] == [x["logprobs"] for x in want]
        assert [x["cached_tokens"] for x in got] == [x["cached_tokens"] for x in want]

    same(a["passes"][0], stock.passes[0])  # computed
    for run in (a["passes"][1], b["passes"][0], b["passes"][1]):
        assert [x["cached_tokens"] for x in run] == HIT
        same(run, stock.passes[1])  # stock's device prefix-cache hit
    host, pool = "vllm:overlay_host_", "vllm:overlay_pool_"
    # A: computed and stored in both tiers, its repeat from host memory.
    assert a["counters"][host + "stored_blocks"] == 5
    assert a["counters"][pool + "stored_blocks"] == 5
    assert a["counters"][host + "loaded_blocks"] == 5
    assert a["counters"][pool + "loaded_blocks"] == 0
    # B: from the pool, promoted to host memory, its repeat from there.
    assert b["counters"][pool + "loaded_blocks"] == 5
    assert b["counters"][pool + "load_failures"] == 0
    assert b["counters"][host + "stored_blocks"] == 5
    assert b["counters"][host + "loaded_blocks"] == 5
    assert b["counters"][pool + "stored_blocks"] == 0
    for run in (a, b):
        assert "Internal Server Error" not in run["log"]
        # vLLM's own stats log, per connector.
        logged = [
            line for line in run["log"].splitlines() if "KV Transfer metrics" in line
        ]
        assert any("OverlayOffloadingConnector" in line for line in logged)
        assert any("SharedKVPoolConnector" in line for line in logged)
        assert "KV connector MultiConnector does not prefer cross-layer" in run["log"]
