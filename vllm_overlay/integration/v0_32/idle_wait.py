"""The engine's wait while every request waits for its KV load (vLLM 0.32).

When the scheduler has nothing to run but requests parked in
``WAITING_FOR_REMOTE_KVS`` (an async load from host memory or a secondary
tier under way), vLLM 0.32's ``EngineCore`` runs empty steps back to back:
schedule nothing, execute an empty batch, poll the connector.  The thread
doing that holds the GIL which the CPU offloading worker's copy thread and
the pool's load thread need between their copies and socket reads, so the
load itself slows down (measured on this 2-core machine: a 128 MiB host
reload in 256 copies took 1.77 s under 27 000 empty steps; see
benchmarks/RESULTS.md).

``idle_wait`` makes such a step wait first, at most ``IDLE_WAIT_S``, on
``TRANSFER_DONE``, which the CPU offloading worker of this process sets as
each transfer completes (a worker in another process: a plain bounded
sleep).  Nothing waits when any request can run, a finished load is still
to be promoted, or finished requests are still to be sent to the workers;
a new request from the front end is picked up within ``IDLE_WAIT_S``.
"""

from __future__ import annotations

import threading

IDLE_WAIT_S = 0.002  # the longest an idle step waits for a KV transfer
# Set by this process's CPU offloading worker when a transfer is done.
TRANSFER_DONE = threading.Event()


def waits_only_for_remote_kv(scheduler) -> bool:
    """Every unfinished request is parked on an async KV load that has not
    landed, and nothing else is pending for the next step."""
    from vllm.v1.request import RequestStatus

    try:
        if (
            scheduler.running
            or scheduler.finished_req_ids
            or scheduler.finished_recving_kv_req_ids
            or scheduler.failed_recving_kv_req_ids
        ):
            return False
        queues = (scheduler.waiting, scheduler.kv_holding_waiting)
    except AttributeError:  # another scheduler class: never wait
        return False
    parked = False
    for queue in queues:
        for request in queue:
            if request.status != RequestStatus.WAITING_FOR_REMOTE_KVS:
                return False
            parked = True
    return parked


def idle_wait(engine) -> bool:
    """Wait (at most ``IDLE_WAIT_S``) if the engine only waits for KV loads;
    returns whether it waited."""
    if not waits_only_for_remote_kv(engine.scheduler):
        return False
    if TRANSFER_DONE.wait(IDLE_WAIT_S):
        TRANSFER_DONE.clear()
    engine.kv_idle_waits = getattr(engine, "kv_idle_waits", 0) + 1
    return True
