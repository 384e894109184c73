"""Replays a workload (workload.py) against an OpenAI-compatible server over
HTTP: streamed completions, the prompt sent as token ids; time to first
token (TTFT) measured here, from sending the request to the first streamed
event that carries a choice.

``concurrency`` users send the turns in the workload's order; a turn waits
until its conversation's previous turn was answered, plus ``think_s``
(the user reading and typing), while other users' turns go on.  Each turn
says which conversation it belongs to (``X-Session-Id`` and the body's
``user``): a sticky router keys on it, a round-robin one ignores it.
"""

from __future__ import annotations

import asyncio
import json
import time

from aiohttp import ClientSession, ClientTimeout


async def _one(
    session, url: str, model: str, turn, system_tokens: int, max_tokens: int
) -> dict:
    body = {
        "model": model,
        "prompt": turn.prompt,
        "max_tokens": max_tokens,
        "min_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "user": f"conversation-{turn.conversation}",
    }
    headers = {"X-Session-Id": f"conversation-{turn.conversation}"}
    record = {
        "conversation": turn.conversation,
        "turn": turn.index,
        "prompt_tokens": len(turn.prompt),
        "system_tokens": system_tokens,
    }
    sent = time.perf_counter()
    first, events, usage = None, 0, None
    async with session.post(url, json=body, headers=headers) as reply:
        record["node"] = reply.headers.get("X-Routed-To")
        if reply.status != 200:
            record["error"] = f"HTTP {reply.status}: {(await reply.text())[:300]}"
            return record
        async for raw in reply.content:
            line = raw.strip()
            if not line.startswith(b"data:") or line == b"data: [DONE]":
                continue
            event = json.loads(line[5:])
            if event.get("choices"):
                events += 1
                if first is None:
                    first = time.perf_counter()
            if event.get("usage"):
                usage = event["usage"]
    done = time.perf_counter()
    if first is None:
        record["error"] = "no token streamed"
        return record
    details = (usage or {}).get("prompt_tokens_details") or {}
    record.update(
        ttft_s=first - sent,
        latency_s=done - sent,
        streamed_events=events,
        completion_tokens=(usage or {}).get("completion_tokens"),
        cached_tokens=details.get("cached_tokens"),
    )
    return record


async def replay(
    base_url: str,
    workload: dict,
    model: str,
    *,
    concurrency: int,
    think_s: float,
    max_tokens: int,
    timeout_s: float,
) -> dict:
    """Every turn once; per-request records in sending order, wall time."""
    turns = workload["turns"]
    answered: dict[tuple[int, int], asyncio.Future] = {}
    loop = asyncio.get_running_loop()
    for t in turns:
        answered[(t.conversation, t.index)] = loop.create_future()
    queue = iter(range(len(turns)))
    records: list[dict | None] = [None] * len(turns)
    url = base_url.rstrip("/") + "/v1/completions"

    async def user(session):
        for i in queue:
            turn = turns[i]
            if turn.index:
                await answered[(turn.conversation, turn.index - 1)]
                await asyncio.sleep(think_s)
            try:
                system = len(workload["systems"][turn.system])
                records[i] = await _one(session, url, model, turn, system, max_tokens)
            except Exception as e:  # recorded, and the conversation goes on
                records[i] = {
                    "conversation": turn.conversation,
                    "turn": turn.index,
                    "prompt_tokens": len(turn.prompt),
                    "error": f"{type(e).__name__}: {e}",
                }
            answered[(turn.conversation, turn.index)].set_result(None)

    start = time.perf_counter()
    async with ClientSession(timeout=ClientTimeout(total=timeout_s)) as session:
        await asyncio.gather(*(user(session) for _ in range(concurrency)))
    return {"wall_s": time.perf_counter() - start, "requests": records}
