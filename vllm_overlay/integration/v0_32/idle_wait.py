"""The engine's wait while every request waits for its KV: vLLM 0.32's
gate (``core/idle_wait`` holds the wait itself, its bound and its facts).

On 0.32 the requests not running are in ``waiting`` and
``kv_holding_waiting``; a failed load (``failed_recving_kv_req_ids``) is
work for the next step too; and a ``WAITING`` request the last step passed
over waits on the connector (a secondary tier's lookup or promotion).  The
wait is on ``TRANSFER_DONE``, which this process's CPU offloading worker
sets as each transfer completes and the pool tier each time its pool
answers a lookup or queues a load's result (always after the result is
there to be taken; a worker in another process, or another tier: the wait
runs to its bound).  This is the only place the scheduler's thread waits
for a transfer: the tiers' own methods never do.
"""

from __future__ import annotations

import functools
import threading

from vllm_overlay.core.idle_wait import IdleGate, wait_if_idle

# Set by this process's CPU offloading worker when a transfer is done, and
# by the pool tier's pool when a lookup is answered or a load is queued.
TRANSFER_DONE = threading.Event()


def wait_for_transfer(scheduler, timeout_s: float) -> bool:
    """Wait on ``TRANSFER_DONE`` (at most ``timeout_s``); whether it was
    set (then cleared for the next wait)."""
    if not TRANSFER_DONE.wait(timeout_s):
        return False
    TRANSFER_DONE.clear()
    return True


@functools.cache
def gate() -> IdleGate:
    from vllm.v1.request import RequestStatus

    return IdleGate(
        queues=("waiting", "kv_holding_waiting"),
        pending=(
            "finished_req_ids",
            "finished_recving_kv_req_ids",
            "failed_recving_kv_req_ids",
        ),
        parked=RequestStatus.WAITING_FOR_REMOTE_KVS,
        waiting=RequestStatus.WAITING,
        wake=wait_for_transfer,
        passed_over=True,
    )


def idle_wait(engine) -> bool:
    """Wait (bounded) if the engine only waits for KV; whether it waited."""
    return wait_if_idle(engine, gate())
