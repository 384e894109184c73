"""One rate-limited logger for the pool: a message of a given topic is
logged at most once per interval; the ones held back are counted and the
next line that gets through says how many there were."""

from __future__ import annotations

import logging
import threading
import time


class RateLimitedLog:
    def __init__(self, logger: logging.Logger, interval_s: float = 30.0) -> None:
        self.logger = logger
        self.interval_s = interval_s
        self._lock = threading.Lock()
        self._last: dict[object, float] = {}
        self._held: dict[object, int] = {}

    def ready(self, topic: object) -> int | None:
        """None: hold this one back (counted); else the number held back
        since the last line of ``topic`` (that line is now due)."""
        now = time.monotonic()
        with self._lock:
            if now - self._last.get(topic, -1e18) < self.interval_s:
                self._held[topic] = self._held.get(topic, 0) + 1
                return None
            self._last[topic] = now
            return self._held.pop(topic, 0)

    def mark(self, topic: object) -> None:
        """Something else just said it: hold this topic's next line back."""
        with self._lock:
            self._last[topic] = time.monotonic()

    def log(
        self,
        level: int,
        topic: object,
        msg: str,
        *args,
        exc_info: BaseException | None = None,
    ) -> bool:
        """Log ``msg % args`` unless ``topic`` was logged within the
        interval; True if it was logged."""
        held = self.ready(topic)
        if held is None:
            return False
        if held:
            msg += " (%d more like it since the last message)"
            args = (*args, held)
        msg += "; this message repeats at most every %.0f s"
        args = (*args, self.interval_s)
        self.logger.log(level, msg, *args, exc_info=exc_info)
        return True
