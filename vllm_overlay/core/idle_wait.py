"""The engine's bounded wait while every request only waits for its KV.

When the scheduler has nothing to run but requests waiting on the KV
connector, vLLM's ``EngineCore`` (0.11.2 and 0.32 alike) runs empty steps
back to back: schedule nothing, execute an empty batch, poll the connector.
The thread doing that holds the GIL which the connector's transfer threads
(the pool's load thread, the CPU offloading worker's copy thread) need
between their socket reads and copies, so the load itself slows down: on
0.11.2, 10^4+ empty steps during one long load, and a pool reload of
128 MiB took seconds; on 0.32, measured on this 2-core machine, a 128 MiB
host reload in 256 copies took 1.77 s under 27 000 empty steps (see
benchmarks/RESULTS.md).

A request waits on the connector in two ways:

* parked (``WAITING_FOR_REMOTE_KVS``): its async load is under way;
* not yet scheduled (``WAITING``) and passed over by the last step because
  the connector could not say yet how many of its tokens it holds (on 0.32,
  ``get_num_new_matched_tokens`` answered None: a secondary tier's lookup,
  or its promotion into host memory, is under way).  Such a request was
  already waiting, with nothing running, when the last step began, and is
  still waiting now: that step did not schedule it.  A release whose
  wake-up does not wake on a lookup's answer (0.11.2) does not count these
  (``IdleGate.passed_over`` False): a waiting request there is work for the
  next step.

``wait_if_idle`` makes such a step wait first, at most ``IDLE_WAIT_S`` (the
one bound for both releases, read at each call), on the release's wake-up
(``IdleGate.wake``: 0.11.2's connector hook ``wait_for_remote_kv``, 0.32's
``TRANSFER_DONE`` event), which returns as soon as a transfer of this
process is done.  Nothing waits when any request runs or is new since the
last step, or anything else is pending for the next step (a finished load
still to be promoted, finished requests still to be sent to the workers);
a new request from the front end is picked up within ``IDLE_WAIT_S``.  The
engine counts its waits (``kv_idle_waits``) and those a transfer ended
early (``kv_idle_wakes``).

vLLM-free: the release's scheduler attribute names, request statuses and
wake-up come in an ``IdleGate`` (``patches/v0_11_2/patch_engine_core``,
``integration/v0_32/idle_wait``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

IDLE_WAIT_S = 0.002  # the longest an idle step waits for a KV transfer

_NONE: frozenset = frozenset()


@dataclasses.dataclass(frozen=True)
class IdleGate:
    """What one vLLM release's idle wait reads and how it waits."""

    # scheduler attributes holding the requests not running
    queues: tuple[str, ...]
    # scheduler attributes (sets): any of them non-empty is work for the
    # next step
    pending: tuple[str, ...]
    parked: Any  # the status of a request whose async KV load is under way
    waiting: Any  # the status of a request not yet scheduled
    # (scheduler, timeout_s) -> whether a transfer ended the wait early
    wake: Callable[[Any, float], bool]
    # whether a waiting request the last step passed over waits on the
    # connector (its lookup); else it is work for the next step
    passed_over: bool


def kv_waits(scheduler, gate: IdleGate, passed_over=_NONE) -> tuple[bool, frozenset]:
    """Whether every unfinished request waits on the connector (its async
    load, or for ``passed_over`` ids: its lookup) with nothing else pending
    for the next step; and, when nothing runs, the waiting requests' ids
    (the next call's ``passed_over``; ignored unless ``gate.passed_over``)."""
    if not gate.passed_over:
        passed_over = _NONE
    try:
        if scheduler.running:
            return False, _NONE
        other = any(getattr(scheduler, name) for name in gate.pending)
        queues = [getattr(scheduler, name) for name in gate.queues]
    except AttributeError:  # another scheduler class: never wait
        return False, _NONE
    waiting, parked = set(), False
    for queue in queues:
        for request in queue:
            if request.status == gate.waiting:
                waiting.add(request.request_id)
                if request.request_id in passed_over:
                    parked = True
                else:
                    other = True
            elif request.status == gate.parked:
                parked = True
            else:
                other = True
    return parked and not other, frozenset(waiting)


def wait_if_idle(engine, gate: IdleGate) -> bool:
    """Wait (at most ``IDLE_WAIT_S``) if the engine only waits for KV;
    returns whether it waited.  With ``gate.passed_over``, remembers which
    requests this step begins with waiting (the next call's
    ``passed_over``)."""
    remembered = getattr(engine, "kv_idle_passed_over", _NONE)
    waits, waiting = kv_waits(engine.scheduler, gate, remembered)
    if gate.passed_over:
        engine.kv_idle_passed_over = waiting
    if not waits:
        return False
    if gate.wake(engine.scheduler, IDLE_WAIT_S):
        engine.kv_idle_wakes = getattr(engine, "kv_idle_wakes", 0) + 1
    engine.kv_idle_waits = getattr(engine, "kv_idle_waits", 0) + 1
    return True
