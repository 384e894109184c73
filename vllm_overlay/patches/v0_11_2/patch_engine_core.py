"""vllm/v1/engine/core.py: no busy loop while requests only wait for KV loads.

EC-01 / EC-02: when the scheduler has nothing to run but requests parked in
``WAITING_FOR_REMOTE_KVS`` (an async KV load under way: shared pool,
offloading, a remote prefill), ``EngineCore.step`` (and
``step_with_batch_queue`` with an empty batch queue) first waits a little:
on the KV connector's ``wait_for_remote_kv(timeout_s)`` when it has one (the
shared pool's load thread wakes it as soon as a load lands), else a plain
sleep; ``IDLE_WAIT_S`` at most either way.

Stock vLLM 0.11.2 runs empty steps back to back meanwhile (schedule
nothing, execute an empty batch, poll the connector): on a loaded host that
is 10^4+ empty steps during one long load, and the engine thread holds the
GIL the load thread needs for every socket read.  Nothing waits when any request
can run, a finished load is waiting to be promoted, or finished requests
are still to be sent to the workers; the wait is bounded, so a new request
from the front end is picked up within ``IDLE_WAIT_S``.
"""

from __future__ import annotations

import time

from vllm_overlay.core.patching import REGISTRY, Patch

MODULE = "vllm.v1.engine.core"
IDLE_WAIT_S = 0.002  # the longest an idle step waits for a KV load


def waits_only_for_remote_kv(scheduler) -> bool:
    """Every unfinished request is parked on an async KV load that has not
    landed, and nothing else is pending for the next step."""
    from vllm.v1.request import RequestStatus

    try:
        if (
            scheduler.running
            or scheduler.finished_req_ids
            or scheduler.finished_recving_kv_req_ids
        ):
            return False
        waiting = scheduler.waiting
    except AttributeError:  # another scheduler class: never wait
        return False
    return bool(waiting) and all(
        request.status == RequestStatus.WAITING_FOR_REMOTE_KVS for request in waiting
    )


def idle_wait(engine) -> bool:
    """Wait (at most ``IDLE_WAIT_S``) if the engine only waits for KV loads;
    returns whether it waited."""
    scheduler = engine.scheduler
    if not waits_only_for_remote_kv(scheduler):
        return False
    wait = getattr(getattr(scheduler, "connector", None), "wait_for_remote_kv", None)
    if wait is not None:
        wait(IDLE_WAIT_S)
    else:
        time.sleep(IDLE_WAIT_S)
    engine.vllm_overlay_idle_waits = getattr(engine, "vllm_overlay_idle_waits", 0) + 1
    return True


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
