"""EC-01/EC-02: the engine does not busy-loop while every request waits for
its KV load, never waits when there is other work, and the pool wakes it
as soon as a load is done.

A real vLLM 0.11.2 Scheduler with a request parked on an async load
(tests/support/sched_scenarios.py) under an ``EngineCore`` without
``__init__``: its executor runs nothing and answers empty outputs, so a
step costs what the scheduler costs - stock vLLM runs such steps back to
back for as long as the load takes."""

from __future__ import annotations

import pathlib
import sys
import threading
import time

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from support.redis_server import redis_server  # noqa: E402
from support.sched_scenarios import (  # noqa: E402
    build,
    engine_shell,
    parked_load,
    report_loaded,
)

WINDOW_S = 0.3


def _steps_in_window(engine, step) -> int:
    deadline = time.monotonic() + WINDOW_S
    n = 0
    while time.monotonic() < deadline:
        step(engine)
        n += 1
    return n


@pytest.fixture
def make(overlay):
    return build()


@pytest.mark.patch_test("EC-01")
def test_ec01_idle_engine_waits_instead_of_spinning(make):
    from vllm.v1.engine.core import EngineCore

    from vllm_overlay.core.idle_wait import IDLE_WAIT_S

    sched, a, out = parked_load(make)
    engine = engine_shell(sched)
    steps = _steps_in_window(engine, EngineCore.step)
    # Each step waited (the offloading connector has no wait hook: a
    # sleep of IDLE_WAIT_S); stock runs thousands of empty steps here.
    assert getattr(engine, "kv_idle_waits", 0) == steps
    assert steps <= WINDOW_S / IDLE_WAIT_S + 5
    # The load lands: the next steps promote and run A, without waiting.
    report_loaded(sched, out, "A")
    engine.kv_idle_waits = 0
    for _ in range(2):  # promoted, then scheduled
        EngineCore.step(engine)
    assert engine.kv_idle_waits == 0
    assert a.num_output_tokens >= 1


@pytest.mark.patch_test("EC-02")
def test_ec02_idle_batch_queue_engine_waits_instead_of_spinning(make):
    from vllm.v1.engine.core import EngineCore

    from vllm_overlay.core.idle_wait import IDLE_WAIT_S

    sched, a, out = parked_load(make)
    engine = engine_shell(sched, batch_queue=True)
    steps = _steps_in_window(engine, EngineCore.step_with_batch_queue)
    assert getattr(engine, "kv_idle_waits", 0) == steps
    assert steps <= WINDOW_S / IDLE_WAIT_S + 5
    assert not engine.batch_queue


@pytest.mark.patch_test("EC-01")
def test_ec01_wakes_on_the_connector_hook(make):
    """With a hook (the shared pool's ``wait_for_remote_kv``), the engine
    waits on it with the bound and goes on the moment it returns."""
    from vllm.v1.engine.core import EngineCore

    from vllm_overlay.core.idle_wait import IDLE_WAIT_S

    sched, a, out = parked_load(make)
    calls = []
    sched.connector.wait_for_remote_kv = lambda timeout_s: calls.append(timeout_s)
    engine = engine_shell(sched)
    for _ in range(5):
        EngineCore.step(engine)
    assert calls == [IDLE_WAIT_S] * 5


def test_never_waits_while_a_request_can_run(make):
    """A runnable request next to the parked one: no step waits (the
    scheduler reports its tokens, the executor answers empty outputs, so
    the request stays runnable)."""
    from vllm.v1.engine.core import EngineCore

    scheduler, request = make
    sched, a, out = parked_load(make)
    sched.add_request(request("B", 20, seed=9))
    calls = []
    sched.connector.wait_for_remote_kv = lambda timeout_s: calls.append(timeout_s)
    engine = engine_shell(sched)
    for _ in range(5):
        EngineCore.step(engine)
    assert calls == [] and getattr(engine, "kv_idle_waits", 0) == 0


def test_never_waits_once_a_load_landed_or_with_finished_requests(make):
    from vllm_overlay.core.idle_wait import kv_waits
    from vllm_overlay.patches.v0_11_2.patch_engine_core import gate

    sched, a, out = parked_load(make)
    assert kv_waits(sched, gate())[0]
    sched.finished_req_ids.add("gone")  # still to be sent to the workers
    assert not kv_waits(sched, gate())[0]
    sched.finished_req_ids.clear()
    report_loaded(sched, out, "A")  # landed: the next schedule() promotes it
    assert not kv_waits(sched, gate())[0]


def test_a_request_passed_over_for_its_lookup_is_work_on_0_11_2(make):
    """0.11.2's gate is stricter than 0.32's (``core/idle_wait``): a
    ``WAITING`` request the last step passed over (the shared pool's lookup
    under way) is work for the next step, and no step waits for it: the
    connector's wake-up does not wake on a lookup's answer."""
    from vllm.v1.engine.core import EngineCore

    from vllm_overlay.core.idle_wait import kv_waits
    from vllm_overlay.patches.v0_11_2.patch_engine_core import gate

    scheduler, request = make
    sched, a, out = parked_load(make)
    sched.add_request(request("B", 20, seed=9))
    assert not kv_waits(sched, gate(), passed_over=frozenset({"B"}))[0]
    engine = engine_shell(sched)
    engine.kv_idle_passed_over = frozenset({"B"})  # not read on 0.11.2
    sched.connector.get_num_new_matched_tokens = lambda *args: (None, False)
    calls = []
    sched.connector.wait_for_remote_kv = lambda timeout_s: calls.append(timeout_s)
    for _ in range(3):
        EngineCore.step(engine)
    assert [r.request_id for r in sched.waiting if r.status.name == "WAITING"] == [
        "B"
    ]  # passed over each step
    assert calls == [] and getattr(engine, "kv_idle_waits", 0) == 0


def test_the_pool_wakes_a_waiting_engine_when_a_load_is_done(server_kind):
    """``KVPool.wait_for_loads`` (the connector's hook) returns as soon as
    a load of any pool of the process is done, else after its timeout."""
    from vllm_overlay.core.pool.config import PoolConfig
    from vllm_overlay.core.pool.pool import KVPool

    with redis_server(kind=server_kind) as server:
        worker = KVPool(PoolConfig(url=server.url))
        scheduler_side = KVPool(PoolConfig(url=server.url), io_threads=False)
        try:
            assert worker.submit_store([(b"k", b"v" * 1000)]) == 1
            assert worker.drain()
            worker.poll_loads()
            scheduler_side.wait_for_loads(0)  # consume an earlier signal
            start = time.monotonic()
            assert not scheduler_side.wait_for_loads(0.05)  # nothing loads
            assert time.monotonic() - start >= 0.045
            woke = []

            def waiter() -> None:
                woke.append(scheduler_side.wait_for_loads(5.0))
                woke.append(time.monotonic())

            thread = threading.Thread(target=waiter)
            thread.start()
            time.sleep(0.05)
            submitted = time.monotonic()
            worker.submit_load("j", [b"k"])
            thread.join(timeout=5)
            assert woke[0] is True
            assert woke[1] - submitted < 1.0  # not the 5 s timeout
            assert worker.poll_loads() == [("j", [b"v" * 1000])]
        finally:
            worker.close()
            scheduler_side.close()
