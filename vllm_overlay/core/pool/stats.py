"""The pool's counters: ``PoolStats`` (one interval's, or the totals since
start) and the field each failure kind is counted in."""

from __future__ import annotations

import dataclasses

from vllm_overlay.core.pool.errors import Failure

# Failure kinds counted in a PoolStats field of their own.
KIND_FIELDS = {
    Failure.UNREACHABLE: "unreachable",
    Failure.SLOW: "slow",
    Failure.FULL: "full",
    Failure.READ_ONLY: "read_only",
    Failure.DENIED: "denied",
    Failure.BAD_REQUEST: "bad_requests",
}


@dataclasses.dataclass
class PoolStats:
    lookups: int = 0
    hits: int = 0  # blocks found by lookups
    misses: int = 0  # blocks not found (first gap ends a lookup)
    lookups_skipped: int = 0  # answered "miss" at once: reads paused, queue full
    lookup_timeouts: int = 0  # not answered within lookup_wait_s
    loaded_blocks: int = 0
    load_failures: int = 0  # missing or refused values on load
    load_timeouts: int = 0  # loads cancelled past io_timeout_s
    stored_blocks: int = 0
    skipped_existing: int = 0
    dropped_stores: int = 0  # over the in-flight limit, or writes paused
    limited_loads: int = 0  # blocks not loaded: over the in-flight load limit
    bad_signatures: int = 0  # values refused: unsigned, or a wrong MAC
    bad_keys: int = 0  # WRONGTYPE keys: a miss, deleted
    bytes_in: int = 0
    bytes_out: int = 0
    errors: int = 0
    internal_errors: int = 0  # bugs: that job failed, nothing paused
    stuck: int = 0  # times a pool thread was found stuck
    # failures by kind (errors.Failure; bad_keys, internal_errors and stuck
    # above are the other kinds), and pauses: reads or writes closed
    unreachable: int = 0
    slow: int = 0
    full: int = 0
    read_only: int = 0
    denied: int = 0
    bad_requests: int = 0
    pauses: int = 0
    io_seconds_in: float = 0.0
    io_seconds_out: float = 0.0

    def add(self, other: PoolStats) -> None:
        for field in dataclasses.fields(PoolStats):
            name = field.name
            setattr(self, name, getattr(self, name) + getattr(other, name))

    def as_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out["gb_per_s_in"] = (
            self.bytes_in / self.io_seconds_in / 1e9 if self.io_seconds_in else 0.0
        )
        out["gb_per_s_out"] = (
            self.bytes_out / self.io_seconds_out / 1e9 if self.io_seconds_out else 0.0
        )
        return out
