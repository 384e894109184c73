"""vllm/v1/core/sched/scheduler.py: async KV loads under KV pressure.

KV-03: requests parked on an async KV load go first in the waiting queue.

The scheduler stops scanning the waiting queue at the first request that
does not fit.  A parked request (KV-01) is only promoted when the scan
reaches it; if a request holding no blocks (a preempted one, put back at the
front) does not fit while nothing runs, the parked requests behind it that
hold the blocks it needs are never reached and the engine stalls.  Moving
the parked requests to the front (stable, FCFS order kept within each part)
keeps the invariant "a request that holds blocks is never behind one that
holds none".  Priority queues are left alone (their order is the policy).

KV-04: a preempted request whose prefix is then loaded asynchronously must
resume as a preempted request (upstream PR #31583).  Stock 0.11.2 sets it
back to WAITING when the load lands, so it is scheduled as a *new* request:
the worker rebuilds its state from the prompt alone and loses the tokens it
had generated (wrong outputs from there on).  Here such a request keeps
PREEMPTED; it is promoted (blocks cached, computed tokens set) and scheduled
as resumed one step later.
"""

from __future__ import annotations

import logging

from vllm_overlay.core.patching import REGISTRY, Patch

MODULE = "vllm.v1.core.sched.scheduler"
logger = logging.getLogger("vllm.overlay")


def holds_blocks(manager, request_id: str) -> bool:
    """Whether a request holds KV blocks (a waiting one only does while it
    is parked on an async KV load)."""
    return any(
        mgr.req_to_blocks.get(request_id)
        for mgr in manager.coordinator.single_type_managers
    )


def parked_first(queue, is_parked) -> int:
    """Move the requests for which ``is_parked(request)`` holds to the front
    of a FCFS deque queue, keeping order; returns how many it moved."""
    marks = [is_parked(r) for r in queue]
    first_free = next((i for i, m in enumerate(marks) if not m), len(marks))
    if not any(marks[first_free:]):
        return 0  # already in front (the common case)
    ahead = [r for r, m in zip(queue, marks) if m]
    behind = [r for r, m in zip(queue, marks) if not m]
    queue.clear()
    queue.extend(ahead + behind)
    return len(ahead)


def schedule(self):
    from vllm.v1.core.sched.request_queue import FCFSRequestQueue

    if (
        self.connector is not None
        and self.waiting
        and isinstance(self.waiting, FCFSRequestQueue)
    ):
        manager = self.kv_cache_manager
        moved = parked_first(
            self.waiting, lambda r: holds_blocks(manager, r.request_id)
        )
        if moved:
            self.vllm_overlay_reordered = getattr(self, "vllm_overlay_reordered", 0) + 1
            logger.debug(
                "vllm-overlay: %d requests holding KV blocks for "
                "an async load moved to the front of the waiting "
                "queue",
                moved,
            )
    return REGISTRY.original("KV-03")(self)


def _update_waiting_for_remote_kv(self, request) -> bool:
    from vllm.v1.request import RequestStatus

    ready = REGISTRY.original("KV-04")(self, request)
    if ready and request.num_preemptions > 0:
        # The caller would set WAITING (a new request); keep it a resumed
        # one.  Reported as not ready: the next step schedules it.
        request.status = RequestStatus.PREEMPTED
        self.vllm_overlay_resumed_after_load = (
            getattr(self, "vllm_overlay_resumed_after_load", 0) + 1
        )
        logger.debug(
            "vllm-overlay: %s resumes after its async KV load (%d output tokens kept)",
            request.request_id,
            request.num_output_tokens,
        )
        return False
    return ready


PATCHES = [
    Patch(
        id="KV-03",
        module=MODULE,
        target="Scheduler.schedule",
        new=schedule,
        feature="async KV loads under KV pressure",
        why="A request that holds no blocks and does not fit ends the "
        "waiting-queue scan; parked async loads behind it, holding the "
        "blocks, were never promoted (stall). Parked requests go first.",
        upstream="vLLM PR #57841 (same invariant, enforced at admission); "
        "PR #45406 (recovery when nothing runs)",
        removal="With KV-01/KV-02, once the upstream scheduler keeps "
        "block-holding requests ahead of the others.",
    ),
    Patch(
        id="KV-04",
        module=MODULE,
        target="Scheduler._update_waiting_for_remote_kv",
        new=_update_waiting_for_remote_kv,
        feature="async KV loads under KV pressure",
        why="A preempted request resumed through an async KV load was "
        "scheduled as a new request and lost its generated tokens on the "
        "worker (wrong outputs); it now resumes as preempted.",
        upstream="vLLM PR #31583 (same rule, in the schedule loop; after 0.11.2)",
        removal="When the upstream scheduler schedules such requests as "
        "resumed (test_kv_pressure_e2e passes with "
        "VLLM_OVERLAY_SKIP_PATCHES=KV-04).",
    ),
]
