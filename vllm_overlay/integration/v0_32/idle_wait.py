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
transfer completes and the pool tier each time its pool answers a lookup
or queues a load's result (always after the result is there to be taken;
a worker in another process, or another tier: a plain bounded sleep).  This
is the only place the scheduler's thread waits for a transfer: the tiers'
own methods never do.  Nothing waits when any request runs or is new since
the last step, a finished load is still to be promoted, or finished
requests are still to be sent to the workers; a new request from the front
end is picked up within ``IDLE_WAIT_S``.  The engine counts its waits
(``kv_idle_waits``) and those a transfer ended early (``kv_idle_wakes``).
"""

from __future__ import annotations

import threading

IDLE_WAIT_S = 0.002  # the longest an idle step waits for a KV transfer
# Set by this process's CPU offloading worker when a transfer is done, and
# by the pool tier's pool when a lookup is answered or a load is queued.
TRANSFER_DONE = threading.Event()


def kv_waits(scheduler, passed_over=frozenset()) -> tuple[bool, frozenset]:
    """Whether every unfinished request waits on the connector (its async
    load, or for ``passed_over`` ids: its lookup) with nothing else pending
    for the next step; and, when nothing runs, the ``WAITING`` requests'
    ids (the next call's ``passed_over``)."""
    from vllm.v1.request import RequestStatus

    try:
        if scheduler.running:
            return False, frozenset()
        pending = (
            scheduler.finished_req_ids
            or scheduler.finished_recving_kv_req_ids
            or scheduler.failed_recving_kv_req_ids
        )
        queues = (scheduler.waiting, scheduler.kv_holding_waiting)
    except AttributeError:  # another scheduler class: never wait
        return False, frozenset()
    waiting, parked, other = set(), False, bool(pending)
    for queue in queues:
        for request in queue:
            if request.status == RequestStatus.WAITING:
                waiting.add(request.request_id)
                if request.request_id in passed_over:
                    parked = True
                else:
                    other = True
            elif request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                parked = True
            else:
                other = True
    return parked and not other, frozenset(waiting)


def idle_wait(engine) -> bool:
    """Wait (at most ``IDLE_WAIT_S``) if the engine only waits for KV;
    returns whether it waited.  Remembers which requests this step begins
    with waiting (the next call's ``passed_over``)."""
    passed_over = getattr(engine, "kv_idle_passed_over", frozenset())
    waits, engine.kv_idle_passed_over = kv_waits(engine.scheduler, passed_over)
    if not waits:
        return False
    if TRANSFER_DONE.wait(IDLE_WAIT_S):
        TRANSFER_DONE.clear()
        engine.kv_idle_wakes = getattr(engine, "kv_idle_wakes", 0) + 1
    engine.kv_idle_waits = getattr(engine, "kv_idle_waits", 0) + 1
    return True
