"""Keep log lines out of ``doctor``'s report: held, then listed at its end."""

from __future__ import annotations

import contextlib
import logging


class _HoldHandler(logging.Handler):
    def __init__(self, held: list[str]) -> None:
        super().__init__(logging.WARNING)
        self.held = held

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.held.append(f"{record.levelname} {record.name}: {record.getMessage()}")
        except Exception:  # noqa: BLE001 - never break the report
            self.handleError(record)


@contextlib.contextmanager
def held_logs(held: list[str], deep: bool):
    """Keep vLLM's (and everyone's) log lines out of the report.

    vLLM configures its ``vllm`` logger (a stdout handler, no propagation)
    and torch its ``torch`` logger when first imported; with ``deep`` that
    happens during the checks, so they are imported first and their
    handlers swapped for one that keeps WARNING and above for the end of
    the report.  The root logger and Python warnings are held the same way.
    """
    import warnings

    import vllm_overlay.patches.v0_11_2  # noqa: F401  (imports torch)

    if deep:
        # vLLM missing or broken: the report says so further on.
        with contextlib.suppress(Exception):
            import vllm.logger  # noqa: F401  (configures the "vllm" logger)
    handler = _HoldHandler(held)
    saved = []
    for name in ("vllm", "torch", ""):
        log = logging.getLogger(name)
        saved.append((log, log.handlers[:], log.propagate))
        log.handlers[:] = [handler]
        log.propagate = False
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("default")
            yield
        held.extend(f"{w.category.__name__}: {w.message}" for w in caught)
    finally:
        for log, handlers, propagate in saved:
            log.handlers[:] = handlers
            log.propagate = propagate
