"""vllm/v1/engine/core.py: no busy loop while requests only wait for KV loads.

EC-01 / EC-02: ``EngineCore.step`` (and ``step_with_batch_queue`` with an
empty batch queue) first waits a little, at most ``core/idle_wait``'s
``IDLE_WAIT_S``, when the scheduler has nothing to run but requests parked
in ``WAITING_FOR_REMOTE_KVS`` (an async KV load under way: shared pool,
offloading, a remote prefill), instead of running empty steps back to back
(``core/idle_wait`` holds the wait, its rules and the measured facts).

0.11.2's gate: the requests not running are in ``waiting``; finished
requests and finished loads are work for the next step (its
``failed_recving_kv_req_ids`` is not read, as before the gate moved to
``core/idle_wait``).  It waits on the KV connector's
``wait_for_remote_kv(timeout_s)`` when it has one (the shared pool's load
thread wakes it as soon as a load lands), else sleeps.  Stricter than
0.32's: every ``WAITING`` request is work for the next step, also one the
last step passed over because the shared pool's lookup was under way
(``get_num_new_matched_tokens`` answered None): that wake-up does not wake
on a lookup's answer, so waiting there would delay each answered lookup by
up to ``IDLE_WAIT_S``.
"""

from __future__ import annotations

import functools
import time

from vllm_overlay.core.idle_wait import IdleGate, wait_if_idle
from vllm_overlay.core.patching import REGISTRY, Patch

MODULE = "vllm.v1.engine.core"


def wait_on_connector(scheduler, timeout_s: float) -> bool:
    """The connector's ``wait_for_remote_kv(timeout_s)`` (whether a load
    ended it early), else a plain sleep."""
    connector = getattr(scheduler, "connector", None)
    wait = getattr(connector, "wait_for_remote_kv", None)
    if wait is None:
        time.sleep(timeout_s)
        return False
    return bool(wait(timeout_s))


@functools.cache
def gate() -> IdleGate:
    from vllm.v1.request import RequestStatus

    return IdleGate(
        queues=("waiting",),
        pending=("finished_req_ids", "finished_recving_kv_req_ids"),
        parked=RequestStatus.WAITING_FOR_REMOTE_KVS,
        waiting=RequestStatus.WAITING,
        wake=wait_on_connector,
        passed_over=False,
    )


def idle_wait(engine) -> bool:
    """Wait (bounded) if the engine only waits for KV loads; whether it
    waited."""
    return wait_if_idle(engine, gate())


def step(self):
    idle_wait(self)
    return REGISTRY.original("EC-01")(self)


def step_with_batch_queue(self):
    if not self.batch_queue:  # nothing in flight on the workers
        idle_wait(self)
    return REGISTRY.original("EC-02")(self)


_WHY = (
    "While every request waits for an async KV load, the engine ran empty "
    "steps back to back (10^4+ per load), starving the load thread of the "
    "GIL: a pool reload of 128 MiB took seconds. It now waits on the "
    "connector (or sleeps) for at most a few ms, and only then."
)
_UPSTREAM = "none found"
_REMOVAL = (
    "When upstream's engine loop blocks on KV transfer progress instead of "
    "stepping while only WAITING_FOR_REMOTE_KVS requests remain."
)
_FEATURE = "async KV loads (shared pool, offloading)"

PATCHES = [
    Patch(
        id="EC-01",
        module=MODULE,
        target="EngineCore.step",
        new=step,
        feature=_FEATURE,
        why=_WHY,
        upstream=_UPSTREAM,
        removal=_REMOVAL,
    ),
    Patch(
        id="EC-02",
        module=MODULE,
        target="EngineCore.step_with_batch_queue",
        new=step_with_batch_queue,
        feature=_FEATURE,
        why=_WHY + " (pipeline parallel, async scheduling: the batch-queue step)",
        upstream=_UPSTREAM,
        removal=_REMOVAL,
    ),
]
