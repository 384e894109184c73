"""Whether the pool's reads and writes go to the network now
(``reads_open``, ``writes_open``, ``state``), and what a failure does: count
it by kind, close the gates it closes (``health.Gates``), log it once per
kind and pause (rate-limited); for the watchdog, cancel loads past their
deadline and pause the pool while one of its threads is stuck.  A mixin of
``KVPool`` (pool.py), whose constructor sets the state named below."""

from __future__ import annotations

import logging
import threading

from vllm_overlay.core.pool.config import PoolConfig
from vllm_overlay.core.pool.errors import Failure, PoolStuck, classify
from vllm_overlay.core.pool.health import READ, WRITE, Gates, Monitor
from vllm_overlay.core.pool.ratelog import RateLimitedLog
from vllm_overlay.core.pool.stats import KIND_FIELDS, PoolStats

logger = logging.getLogger("vllm.overlay")

GRACE_S = 1.0  # past a job's deadline before the watchdog steps in


class PoolFailures:
    """Owns no state of its own: the gates (``_gates``) and the failure
    counters are the pool's, written here only.  Reads ``config``,
    ``misconfigured`` and ``_closed`` (pool.py); sets ``_monitor.wake``;
    counts ``stats.errors``, ``bad_keys``, ``internal_errors``, ``stuck``,
    the per-kind fields (``KIND_FIELDS``) and ``pauses`` under ``_lock``.
    Calls ``_stuck`` (pool.py) and ``_cancel_late_loads`` (loads.py) from
    ``_watchdog``.  Its interface: ``reads_open``, ``writes_open``,
    ``_failed``, ``_internal``, ``_ok``; the monitor's ``_watchdog`` and
    ``_reopened``."""

    config: PoolConfig
    stats: PoolStats
    misconfigured: str | None
    _lock: threading.Lock
    _gates: Gates
    _log: RateLimitedLog
    _monitor: Monitor
    _closed: threading.Event

    def reads_open(self) -> bool:
        """Lookups and loads go to the network now (never once closed)."""
        return (
            self.misconfigured is None
            and not self._closed.is_set()
            and self._gates.is_open(READ)
        )

    def writes_open(self) -> bool:
        """Stores go to the network now (never once closed)."""
        return (
            self.misconfigured is None
            and not self._closed.is_set()
            and self._gates.is_open(WRITE)
        )

    def is_down(self) -> bool:
        return not self.reads_open()

    def state(self) -> dict[str, str]:
        """``{"read": "open" | <failure kind>, "write": ...}``."""
        out = {}
        for direction in (READ, WRITE):
            if self.misconfigured is not None:
                out[direction] = "misconfigured"
            elif self._gates.is_open(direction):
                out[direction] = "open"
            else:
                out[direction] = self._gates.reason(direction).value
        return out

    def _failed(self, exc: BaseException, what: str, direction: str) -> Failure:
        """Count, classify and react to a failure; returns its kind.  Once
        the pool is closed, failures are its own hang-ups: not counted."""
        kind = classify(exc)
        if self._closed.is_set():
            return kind
        with self._lock:
            self.stats.errors += 1
            self.stats.bad_keys += kind is Failure.BAD_KEY
            self.stats.internal_errors += kind is Failure.INTERNAL
            self.stats.stuck += kind is Failure.STUCK
            field = KIND_FIELDS.get(kind)
            if field is not None:
                setattr(self.stats, field, getattr(self.stats, field) + 1)
        if kind is Failure.INTERNAL:
            self._internal(what, exc)
            return kind
        closed, pause = self._gates.close(kind, direction, what == "connect")
        if closed:
            with self._lock:
                self.stats.pauses += 1
        if kind.whole_pool:
            self._monitor.wake.set()
        paused = (
            "reads and writes"
            if len(closed) == 2
            else "writes"
            if kind.writes_only
            else f"{direction}s"
        )
        self._log.log(
            logging.ERROR if kind.long_pause else logging.WARNING,
            kind,
            "vllm-overlay KV pool %s: %s failed, %s (%s: %s); %s; requests "
            "recompute instead",
            self.config.redacted_url,
            what,
            kind.value,
            type(exc).__name__,
            self.config.redact(str(exc)),
            f"{paused} paused for {pause:.1f}s"
            + (" (until a PING answers)" if kind.whole_pool else "")
            if closed
            else "this key only",
        )
        return kind

    def _internal(self, what: str, exc: BaseException) -> None:
        """A bug, not the server's doing: logged with its traceback; the
        job it happened in failed (its requests recompute), nothing pauses."""
        self._log.log(
            logging.ERROR,
            ("internal", what),
            "vllm-overlay KV pool %s: %s failed with an internal error (%s: %s), "
            "not the server's doing; that job's requests recompute, the pool "
            "goes on",
            self.config.redacted_url,
            what,
            type(exc).__name__,
            self.config.redact(str(exc)),
            exc_info=exc,
        )

    def _ok(self, direction: str) -> None:
        self._gates.ok(direction)

    def _reopened(self, ping_ms: float) -> None:
        logger.info(
            "vllm-overlay KV pool %s answers again (PING %.1f ms): "
            "lookups, loads and stores resume",
            self.config.redacted_url,
            ping_ms,
        )

    def _watchdog(self) -> None:
        """Loads past their deadline (a stuck thread, or queued behind one)
        are cancelled and handed to their caller as failed; a stuck thread
        pauses the pool."""
        self._cancel_late_loads(GRACE_S)
        who = self._stuck()
        if who is not None and self._gates.reason(READ) is not Failure.STUCK:
            self._failed(
                PoolStuck(f"the {who} thread is busy with one job past its deadline"),
                who,
                READ,
            )
