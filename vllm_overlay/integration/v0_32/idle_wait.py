"""The engine's wait while every request waits for its KV (vLLM 0.32).

When the scheduler has nothing to run but requests waiting on the KV
connector, vLLM 0.32's ``EngineCore`` runs empty steps back to back:
schedule nothing, execute an empty batch, poll the connector.  The thread
doing that holds the GIL which the CPU offloading worker's copy thread and
the pool's load thread need between their copies and socket reads, so the
load itself slows down (measured on this 2-core machine: a 128 MiB host
reload in 256 copies took 1.77 s under 27 000 empty steps; see
benchmarks/RESULTS.md).  A request waits on the connector in two ways:

* parked in ``WAITING_FOR_REMOTE_KVS``: its async load (host memory to the
  KV cache) is under way;
* ``WAITING``, passed over by the last step because the connector could not
  say yet how many of its tokens it holds (``get_num_new_matched_tokens``
  answered None): a secondary tier's lookup, or its promotion into host
  memory (the pool tier's read), is under way.  Such a request was already
  waiting, with nothing running, when the last step began, and is still
  ``WAITING`` now: that step did not schedule it.

``idle_wait`` makes such a step wait first, at most ``IDLE_WAIT_S``, on
``TRANSFER_DONE``, which this process's CPU offloading worker sets as each
transfer completes and the pool tier as each of its loads does (a worker in
another process, or another tier: a plain bounded sleep).  Nothing waits
when any request runs or is new since the last step, a finished load is
still to be promoted, or finished requests are still to be sent to the
workers; a new request from the front end is picked up within
``IDLE_WAIT_S``.
"""

from __future__ import annotations

import threading

IDLE_WAIT_S = 0.002  # the longest an idle step waits for a KV transfer
# Set by this process's CPU offloading worker when a transfer is done.
TRANSFER_DONE = threading.Event()


def waits_only_for_remote_kv(scheduler, passed_over=frozenset()) -> bool:
    """Every unfinished request waits on the connector (its async load, or
    for ``passed_over`` ids: its lookup), and nothing else is pending for
    the next step."""
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
            status = request.status
            if status == RequestStatus.WAITING_FOR_REMOTE_KVS or (
                status == RequestStatus.WAITING and request.request_id in passed_over
            ):
                parked = True
                continue
            return False
    return parked


def waiting_ids(scheduler) -> frozenset:
    """The ``WAITING`` requests' ids, when nothing runs (else empty)."""
    from vllm.v1.request import RequestStatus

    try:
        if scheduler.running:
            return frozenset()
        queues = (scheduler.waiting, scheduler.kv_holding_waiting)
    except AttributeError:
        return frozenset()
    return frozenset(
        r.request_id for q in queues for r in q if r.status == RequestStatus.WAITING
    )


def idle_wait(engine) -> bool:
    """Wait (at most ``IDLE_WAIT_S``) if the engine only waits for KV;
    returns whether it waited.  Remembers which requests this step begins
    with waiting (the next call's ``passed_over``)."""
    scheduler = engine.scheduler
    passed_over = getattr(engine, "kv_idle_passed_over", frozenset())
    waits = waits_only_for_remote_kv(scheduler, passed_over)
    engine.kv_idle_passed_over = waiting_ids(scheduler)
    if not waits:
        return False
    if TRANSFER_DONE.wait(IDLE_WAIT_S):
        TRANSFER_DONE.clear()
    engine.kv_idle_waits = getattr(engine, "kv_idle_waits", 0) + 1
    return True
