"""What an engine did, on either release: the overlay's layout log line,
vLLM's own time to first token, a delta of counters."""

from __future__ import annotations

import logging

LAYOUT_MARK = "KV cache layout:"


class LayoutLines(logging.Handler):
    """Keeps the overlay's "KV cache layout: ..." log line(s)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        try:
            message = record.getMessage()
        except Exception:  # noqa: BLE001
            return
        if LAYOUT_MARK in message:
            self.lines.append(message)

    def attach(self) -> LayoutLines:
        """Listen on the overlay's logger (at INFO, even when vLLM logs only
        warnings).  Call after ``import vllm.logger``: vLLM's dictConfig
        resets child loggers of "vllm" when it runs."""
        overlay_logger = logging.getLogger("vllm.overlay")
        overlay_logger.addHandler(self)
        if overlay_logger.getEffectiveLevel() > logging.INFO:
            overlay_logger.setLevel(logging.INFO)
        return self

    def detach(self) -> None:
        logging.getLogger("vllm.overlay").removeHandler(self)


def enable_request_metrics(llm) -> bool:
    """Turn on the front end's per-request stats (RequestOutput.metrics).

    ``disable_log_stats=False`` would do it, but 0.11.2's stat logger asserts
    that no KV connector lives in the front-end process, which is the case
    with an in-process engine (VLLM_ENABLE_V1_MULTIPROCESSING=0).  The
    front end alone computes ``first_token_latency`` (arrival to the step
    that returns the first token); no stat logger is needed for it.
    """
    engine = llm.llm_engine
    processor = getattr(engine, "output_processor", None)
    if not hasattr(engine, "log_stats") or not hasattr(processor, "log_stats"):
        return False
    engine.log_stats = True
    processor.log_stats = True
    return True


def ttft(output) -> float | None:
    """vLLM's own time to first token of a request, in seconds."""
    metrics = getattr(output, "metrics", None)
    value = getattr(metrics, "first_token_latency", None)
    return float(value) if value else None


def delta(after, before):
    """after - before for the numbers of a (nested) stats dict."""
    if isinstance(after, dict):
        return {k: delta(v, (before or {}).get(k)) for k, v in after.items()}
    if isinstance(after, (int, float)) and not isinstance(after, bool):
        return after - (before or 0)
    return after


def add(total, part):
    """total + part for the numbers of a (nested) stats dict."""
    if isinstance(part, dict):
        total = dict(total or {})
        for k, v in part.items():
            total[k] = add(total.get(k), v)
        return total
    if isinstance(part, (int, float)) and not isinstance(part, bool):
        return (total or 0) + part
    return part
