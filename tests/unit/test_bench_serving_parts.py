"""The serving benchmark's parts that need no vLLM: the workload generator,
the proxy (a real aiohttp server in front of two real HTTP backends that
stream), the client's TTFT, the metrics reader and the ideal hit count."""

from __future__ import annotations

import asyncio
import json
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks" / "serving"))
import prometheus_client  # noqa: E402, F401
from aiohttp import web  # noqa: E402
from checks import ideal_hits, notes, pool_trouble, problems  # noqa: E402
from client import replay  # noqa: E402
from metrics import add, finished, hits, parse  # noqa: E402
from proxy import build_app  # noqa: E402
from workload import Turn, WorkloadSpec, generate, prefilled_tokens  # noqa: E402

SPEC = WorkloadSpec(
    conversations=4,
    system_prompts=2,
    system_tokens=256,
    turns=(2, 4),
    user_tokens=(10, 30),
    answer_tokens=(10, 30),
)


def test_each_turn_extends_the_previous_one_and_the_seed_fixes_it():
    work = generate(SPEC, 7)
    assert generate(SPEC, 7)["turns"] == work["turns"]
    assert generate(SPEC, 8)["turns"] != work["turns"]
    last = {}
    for turn in work["turns"]:  # the sending order keeps each conversation's
        system = work["systems"][turn.system]
        assert turn.prompt[: len(system)] == system
        if turn.index:
            prev = last[turn.conversation]
            assert prev.index == turn.index - 1
            assert turn.prompt[: len(prev.prompt)] == prev.prompt
            assert len(turn.prompt) >= len(prev.prompt) + 20  # answer + user
        else:
            assert turn.conversation not in last
        last[turn.conversation] = turn
    convs = [t.conversation for t in work["turns"]]
    assert convs != sorted(convs)  # interleaved, not one conversation after another
    assert all(3 <= i < SPEC.vocab for t in work["turns"] for i in t.prompt)


def test_the_simulation_counts_what_each_router_leaves_to_prefill():
    """Two conversations of two turns over two nodes, 4-token blocks:
    round-robin sends each second turn to the node without its first turn,
    sticky to the one with it (only the new tokens past its full blocks are
    prefilled)."""
    a1, b1 = list(range(3, 13)), list(range(20, 30))  # 10 tokens: 2 full blocks
    a2, b2 = a1 + [40] * 6, b1 + [50] * 6
    work = {
        "turns": [
            Turn(0, 0, 0, a1),
            Turn(1, 0, 0, b1),
            Turn(1, 1, 0, b2),  # round-robin: node 0, b1 is on node 1
            Turn(0, 1, 0, a2),  # node 1, a1 is on node 0
        ]
    }
    assert prefilled_tokens(work, 2, sticky=False, block=4) == 10 + 10 + 16 + 16
    assert prefilled_tokens(work, 2, sticky=True, block=4) == 10 + 10 + 8 + 8
    assert prefilled_tokens(work, 1, sticky=False, block=4) == 10 + 10 + 8 + 8


@pytest.mark.parametrize(
    "bad", [["--nodes", "0"], ["--block", "0"], ["--seeds", "0"], ["--turns", "5", "3"]]
)
def test_the_simulation_refuses_bad_options(bad):
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "serving" / "workload.py")]
        + ["--simulate", *bad],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2, proc.stderr
    assert "must be at least 1" in proc.stderr or "1 <= MIN <= MAX" in proc.stderr


def test_ideal_hits_count_the_previous_prompts_full_blocks():
    work = generate(SPEC, 7)
    expected, prev = 0, {}
    for t in work["turns"]:
        prefix = prev[t.conversation] if t.index else 256
        expected += min(prefix // 128, (len(t.prompt) - 1) // 128) * 128
        prev[t.conversation] = len(t.prompt)
    assert ideal_hits(work, 128) == expected > 0


def backend(name: str):
    """A stand-in node: streams three SSE events (the first after 50 ms)
    naming itself, and answers the prompt's length in the usage."""

    async def completions(request):
        body = await request.json()
        reply = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await reply.prepare(request)
        await asyncio.sleep(0.05)
        for i in range(3):
            event = {"choices": [{"text": f"{name}{i}"}]}
            await reply.write(f"data: {json.dumps(event)}\n\n".encode())
        usage = {
            "choices": [],
            "usage": {
                "completion_tokens": 3,
                "prompt_tokens_details": {"cached_tokens": len(body["prompt"])},
            },
        }
        await reply.write(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())
        await reply.write_eof()
        return reply

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    return app


async def serve(app) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    return runner, f"http://127.0.0.1:{port}"


async def replay_through(mode: str) -> dict:
    runners, urls = [], []
    for name in ("n0", "n1"):
        runner, url = await serve(backend(name))
        runners.append(runner)
        urls.append(url)
    proxy, proxy_url = await serve(build_app(urls, mode, 30.0))
    try:
        return await replay(
            proxy_url,
            generate(SPEC, 3),
            "m",
            concurrency=3,
            think_s=0.0,
            max_tokens=3,
            timeout_s=30.0,
        )
    finally:
        for r in [proxy, *runners]:
            await r.cleanup()


@pytest.mark.parametrize("mode", ["rr", "sticky"])
def test_the_proxy_routes_and_streams(mode):
    result = asyncio.run(replay_through(mode))
    records = result["requests"]
    assert all("error" not in r for r in records), records
    assert all(
        r["streamed_events"] == 3 and r["completion_tokens"] == 3 for r in records
    )
    assert all(r["cached_tokens"] == r["prompt_tokens"] for r in records)
    assert all(0.05 <= r["ttft_s"] <= r["latency_s"] for r in records)
    nodes = [r["node"] for r in records]
    assert sorted(set(nodes)) == ["0", "1"]
    by_conv = {}
    for r in records:
        by_conv.setdefault(r["conversation"], set()).add(r["node"])
    if mode == "sticky":  # one node per conversation
        assert all(len(n) == 1 for n in by_conv.values()), by_conv
    else:  # round-robin splits the requests evenly and moves conversations
        assert abs(nodes.count("0") - nodes.count("1")) <= 1
        assert any(len(n) == 2 for n in by_conv.values()), by_conv


EXPOSITION_032 = """\
# TYPE vllm:prompt_tokens_cached_by_source_total counter
vllm:prompt_tokens_cached_by_source_total{engine="0",source="device"} 512.0
vllm:prompt_tokens_cached_by_source_total{engine="0",source="host"} 256.0
vllm:prompt_tokens_cached_by_source_total{source="external_unspecified"} 128.0
vllm:prompt_tokens_cached_by_source_total{engine="0",source="p2p"} 0.0
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0"} 2000.0
# TYPE vllm:prompt_tokens_by_source_total counter
vllm:prompt_tokens_by_source_total{engine="0",source="local_compute"} 1104.0
# TYPE vllm:kv_offload_pool_pauses_total counter
vllm:kv_offload_pool_pauses_total{engine="0"} 2.0
# TYPE vllm:kv_offload_pool_loaded_blocks_total counter
vllm:kv_offload_pool_loaded_blocks_total{engine="0"} 1.0
# TYPE vllm:request_success_total counter
vllm:request_success_total{engine="0",finished_reason="length"} 3.0
"""
EXPOSITION_0112 = """\
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine="0"} 384.0
# TYPE vllm:external_prefix_cache_hits_total counter
vllm:external_prefix_cache_hits_total{engine="0"} 640.0
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0"} 1500.0
"""


def test_hits_by_source_from_each_release_s_metrics():
    new = hits(parse(EXPOSITION_032))
    assert new["device"] == 512 and new["host"] == 256 and new["pool"] == 128
    assert new["external"] == 0 and new["prompt_tokens"] == 2000
    assert new["computed"] == 1104
    assert new["raw"] == {"device": 512, "host": 256, "external_unspecified": 128}
    assert new["pool_tier"] == {"pauses": 2, "loaded_blocks": 1}
    assert pool_trouble(new) == " (pool tier: {'pauses': 2})"
    old = hits(parse(EXPOSITION_0112))
    assert (old["device"], old["host"], old["pool"], old["external"]) == (
        384,
        0,
        0,
        640,
    )
    # The overlay's 0.11.2 connectors' own counter splits it.
    split = hits(
        parse(
            EXPOSITION_0112
            + "# TYPE vllm:overlay_pool_loaded_blocks_total counter\n"
            + 'vllm:overlay_pool_loaded_blocks_total{engine="0"} 3.0\n'
        )
    )
    assert (split["host"], split["pool"], split["external"]) == (256, 384, 640)
    # 0.11.2's device counter counts repeated lookups: the answers' cached
    # tokens (usage) give the device's share.
    told = hits(parse(EXPOSITION_0112), cached=1000)
    assert (told["device"], told["device_counter"]) == (360, 384)
    assert told["computed"] == 1500 - 1000
    both = add([new, new])
    assert both["pool"] == 256 and both["raw"]["host"] == 512
    assert both["pool_tier"]["pauses"] == 4 and finished(parse(EXPOSITION_032)) == 3


def _moved_run(writer_counts: dict) -> dict:
    """(c): a conversation's turn 1 on node 1 after its turn 0 on node 0,
    past the system prompt's blocks, with no pool hits on node 1."""
    requests = [
        {"conversation": 0, "turn": 0, "node": 0, "prompt_tokens": 300},
        {"conversation": 0, "turn": 1, "node": 1, "prompt_tokens": 340},
    ]
    for r in requests:
        r["system_tokens"] = 100
    nodes = [{"device": 0, "pool": 0, **writer_counts}, {"device": 0, "pool": 0}]
    return {
        "config": "c",
        "repeat": 0,
        "requests": requests,
        "nodes": nodes,
        "hits": add(nodes),
    }


def test_a_moved_turn_without_pool_hits_is_a_problem_unless_the_pool_paused():
    """Without trouble it is a problem (the pool should have served it);
    when the pool tier paused in that repeat, on the node that stored it
    too, the turn recomputed as designed: a note, not a problem."""
    quiet = _moved_run({})
    assert problems([quiet], 128) == [
        "(c) repeat 0: node 1 served 1 turn(s) whose previous turn ran on "
        "another node, with no pool hits"
    ]
    assert notes([quiet], 128) == []
    paused = _moved_run({"pool_tier": {"pauses": 1, "unreachable": 1}})
    assert problems([paused], 128) == []
    (note,) = notes([paused], 128)
    assert note.startswith("(c) repeat 0: node 1 served 1 turn(s)")
    assert "(pool tier: {'pauses': 1, 'unreachable': 1})" in note
