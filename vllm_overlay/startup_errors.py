"""A startup refusal reaches the user as its one line.

The overlay's refusals (an overlay feature on a release where it does not
run, a patch that did not apply, a bad offloading setting on 0.32) are
raised in the front end, inside ``EngineArgs.create_engine_config``; vLLM's
CLI lets them propagate, and Python would print them at the end of a
traceback of some 35 lines through vLLM's and the overlay's frames.  Their
message already says what was configured and the fix, so
``install_hook`` makes an uncaught one print as that line alone (exit
status 1, like any uncaught exception); every other exception goes to the
hook that was there before.  ``VLLM_LOGGING_LEVEL=DEBUG`` keeps the full
traceback.  Code that catches a refusal (``LLM(...)`` in a ``try``) gets
the exception as before.

A refusal is an exception whose class sets ``one_line_startup_error``.
"""

from __future__ import annotations

import os
import sys

_INSTALLED = "_vllm_overlay_one_line"


def is_refusal(exc: BaseException | None) -> bool:
    return getattr(type(exc), "one_line_startup_error", False) is True


def one_line(exc: BaseException) -> str:
    """What the hook prints for EXC (no newline)."""
    return f"{type(exc).__name__}: {exc}".replace("\n", " ")


def install_hook() -> None:
    """Install the hook in this process (once; re-entrant)."""
    previous = sys.excepthook
    if getattr(previous, _INSTALLED, False):
        return

    def hook(exc_type, exc, tb):
        debug = os.environ.get("VLLM_LOGGING_LEVEL", "").upper() == "DEBUG"
        if debug or not is_refusal(exc):
            return previous(exc_type, exc, tb)
        sys.stderr.write(one_line(exc) + "\n")
        sys.stderr.flush()
        return None

    setattr(hook, _INSTALLED, True)
    sys.excepthook = hook
