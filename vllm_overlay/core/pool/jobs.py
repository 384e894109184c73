"""What the pool's threads are handed: a lookup's ticket (its caller polls
it), a load job, a store job (and what became of it), and the sentinel
that stops a thread."""

from __future__ import annotations

import dataclasses
import time

from vllm_overlay.core.pool.resp import Guard

STOP = object()  # queued last: the thread that takes it ends


class LookupTicket:
    """One lookup's answer: ``present`` (a bool per key) once ``done``;
    ``None`` when the pool could not answer (a miss)."""

    __slots__ = ("keys", "present", "done", "abandoned", "submitted")

    def __init__(self, keys: list[bytes]) -> None:
        self.keys = keys
        self.present: list[bool] | None = None
        self.done = False
        self.abandoned = False
        self.submitted = time.monotonic()

    def _finish(self, present: list[bool] | None) -> None:
        self.present = present
        self.done = True

    @property
    def hits(self) -> int:
        """Leading keys present (0 if the pool could not answer)."""
        if not self.present:
            return 0
        return next((i for i, p in enumerate(self.present) if not p), len(self.keys))


@dataclasses.dataclass(eq=False)
class LoadJob:
    job_id: object
    keys: list[bytes]
    n: int  # leading keys fetched
    size: int  # bytes reserved under the in-flight load limit
    prepare: object
    into: object
    landed: object
    value_bytes: int
    deadline: float
    # Every write into the caller's buffers and every read of them for the
    # result (``landed``, ``prepare``) happens under ``guard.lock`` while
    # ``guard.cancelled`` is false (``KVPool.cancel_loads``).
    guard: Guard = dataclasses.field(default_factory=Guard)
    claimed: bool = False  # its result is being made (by one thread only)
    delivered: bool = False  # its result is queued for ``poll_loads``


@dataclasses.dataclass(frozen=True)
class StoreOutcome:
    """What became of one ``submit_store``'s values: ``written`` now,
    ``present`` already (not written again), ``failed`` (tried: the
    server refused them, or the write failed or timed out); the others
    were dropped on purpose, never tried (over the in-flight limit, or
    while writes were paused)."""

    total: int
    written: int = 0
    present: int = 0
    failed: int = 0

    @property
    def complete(self) -> bool:
        """Every value is in the pool."""
        return self.written + self.present == self.total

    @property
    def dropped(self) -> int:
        """Values not tried (the pool's own limits)."""
        return self.total - self.written - self.present - self.failed


@dataclasses.dataclass(eq=False)
class StoreJob:
    items: list  # the admitted (key, payload) pairs
    size: int
    encode: object
    on_done: object
    total: int  # values submitted (admitted or not)
    written: int = 0
    present: int = 0
    failed: int = 0
    released: bool = False
    # Every read of the caller's payloads (``encode``, each send of a
    # payload's bytes) happens under ``guard.lock`` while
    # ``guard.cancelled`` is false (``KVPool.cancel_stores``).
    guard: Guard = dataclasses.field(default_factory=Guard)

    def outcome(self) -> StoreOutcome:
        return StoreOutcome(self.total, self.written, self.present, self.failed)
