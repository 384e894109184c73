"""Whether the pool's reads and writes go to the network now, and the
background thread that reopens them.

Reads and writes each have a ``Gate``.  A failure closes gates for a
back-off that doubles from ``retry_backoff_s`` up to ``max_retry_backoff_s``
(``Gate.close``: the only place that arithmetic lives; errors.py says which
kind closes what).  Whole-pool kinds (unreachable, slow, stuck) are reopened
by the ``Monitor`` thread only: after the back-off, when no pool thread is
stuck and a PING answers within ``lookup_wait_s``; the other kinds reopen
by themselves when their back-off is over.  The same thread runs the
pool's watchdog (jobs past their deadline) every ``tick_s``.
"""

from __future__ import annotations

import dataclasses
import threading
import time

from vllm_overlay.core.pool.errors import Failure, PoolStuck, PoolTooSlow, classify

READ, WRITE = "read", "write"


@dataclasses.dataclass
class Gate:
    base: float
    cap: float
    backoff: float = 0.0
    reason: Failure | None = None
    until: float = 0.0

    def __post_init__(self) -> None:
        self.backoff = self.base

    def close(self, kind: Failure, now: float) -> float:
        """Closed for one back-off step (a long pause starts at the cap);
        returns the pause."""
        if kind.long_pause:
            self.backoff = self.cap
        self.reason, self.until = kind, now + self.backoff
        pause = self.backoff
        self.backoff = min(self.backoff * 2, self.cap)
        return pause


class Gates:
    """Both gates, thread-safe."""

    def __init__(self, base: float, cap: float) -> None:
        self.base = base
        self.lock = threading.Lock()
        self.gates = {READ: Gate(base, cap), WRITE: Gate(base, cap)}

    def is_open(self, direction: str) -> bool:
        gate = self.gates[direction]
        if gate.reason is None:
            return True
        if gate.reason.whole_pool:  # only the monitor reopens it
            return False
        if time.monotonic() >= gate.until:
            with self.lock:
                if gate.reason is not None and not gate.reason.whole_pool:
                    gate.reason = None
            return True
        return False

    def reason(self, direction: str) -> Failure | None:
        return self.gates[direction].reason

    def close(
        self, kind: Failure, direction: str, connecting: bool
    ) -> tuple[list, float]:
        """Close what ``kind`` closes; (directions closed, longest pause)."""
        if kind.whole_pool or (connecting and kind.long_pause):
            names = [READ, WRITE]
        elif kind.writes_only:
            names = [WRITE]
        elif kind in (Failure.BAD_KEY, Failure.INTERNAL):
            names = []
        else:
            names = [direction]
        now = time.monotonic()
        pause = 0.0
        with self.lock:
            for name in names:
                gate = self.gates[name]
                if gate.reason is not None and now < gate.until:
                    pause = max(pause, gate.until - now)
                    if gate.reason.whole_pool or not kind.whole_pool:
                        continue  # already paused for this (or worse)
                pause = max(pause, gate.close(kind, now))
        return names, pause

    def ok(self, direction: str) -> None:
        gate = self.gates[direction]
        if gate.backoff != self.base and gate.reason is None:
            with self.lock:
                gate.backoff = self.base

    def whole_pool_closed(self) -> tuple[list[Gate], float | None]:
        """The gates only the monitor reopens, and when to try."""
        with self.lock:
            closed = [
                g
                for g in self.gates.values()
                if g.reason is not None and g.reason.whole_pool
            ]
            return closed, max((g.until for g in closed), default=None)

    def reopen(self, closed: list[Gate]) -> None:
        with self.lock:
            for gate in closed:
                gate.reason = None

    def retry_later(self, closed: list[Gate], kind: Failure) -> None:
        now = time.monotonic()
        with self.lock:
            for gate in closed:
                gate.close(kind if kind.whole_pool else gate.reason, now)


class Monitor:
    """The health thread: reopens whole-pool gates (``ping()`` must answer
    within ``answer_s``; ``stuck()`` names a stuck pool thread, or None)
    and calls ``watchdog()`` every ``tick_s``.  Never dies: an unexpected
    exception is logged and the loop goes on."""

    def __init__(
        self,
        gates: Gates,
        ping,
        stuck,
        watchdog,
        answer_s: float,
        log_error,
        on_reopen,
        tick_s: float = 0.25,
    ) -> None:
        self.gates = gates
        self.ping = ping
        self.stuck = stuck
        self.watchdog = watchdog
        self.answer_s = answer_s
        self.log_error = log_error
        self.on_reopen = on_reopen
        self.tick_s = tick_s
        self.wake = threading.Event()
        self.closed = threading.Event()

    def run(self) -> None:
        while not self.closed.is_set():
            self.wake.wait(timeout=self.tick_s)
            self.wake.clear()
            try:
                self.watchdog()
                self._try_reopen()
            except Exception as exc:  # noqa: BLE001 - a bug: logged, go on
                self.log_error(exc)
                self.closed.wait(self.tick_s)

    def _try_reopen(self) -> None:
        if self.closed.is_set():
            return  # no new PING client once the pool is closed
        closed, until = self.gates.whole_pool_closed()
        if until is None or time.monotonic() < until:
            return
        start = time.monotonic()
        try:
            who = self.stuck()
            if who is not None:
                raise PoolStuck(
                    f"the pool's {who} thread is still busy past its deadline"
                )
            self.ping()
            latency = time.monotonic() - start
            if latency > self.answer_s:
                raise PoolTooSlow(
                    f"PING answered in {latency * 1e3:.0f} ms, more than "
                    f"lookup_wait_s ({self.answer_s * 1e3:.0f} ms)"
                )
        except Exception as exc:  # noqa: BLE001 - any failure: stay closed
            self.gates.retry_later(closed, classify(exc))
            return
        self.gates.reopen(closed)
        self.on_reopen((time.monotonic() - start) * 1e3)


def start_thread(target, name: str, *args) -> threading.Thread:
    thread = threading.Thread(target=target, args=args, name=name, daemon=True)
    thread.start()
    return thread
