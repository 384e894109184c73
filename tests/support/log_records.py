"""A logging handler that keeps what it is given, for tests reading the
overlay's log lines (vLLM's loggers do not propagate to pytest's caplog)."""

from __future__ import annotations

import logging


class LogRecords(logging.Handler):
    """Keeps every record at ``level`` or above."""

    def __init__(self, level: int = logging.WARNING) -> None:
        super().__init__(level)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    @property
    def messages(self) -> list[str]:
        return [record.getMessage() for record in self.records]
