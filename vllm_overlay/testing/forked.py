"""A function run in a forked child of this process, its output in a log.

The demo and the benchmarks build each engine in a forked child of a
process that has already imported vLLM (the bulk of an engine's start-up on
CPU), so the child only builds its engine.
"""

from __future__ import annotations

import os
import pathlib
import sys
from collections.abc import Callable


def fork_child(body: Callable[[], None], log_path: str) -> int:
    """Fork; the child writes its stdout and stderr to LOG_PATH, runs
    BODY and exits at once (status 0, or 1 with the traceback in the log
    if BODY raised): no vLLM teardown, no parent atexit hooks.  Returns
    the child's pid in the parent; never returns in the child."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        log = os.open(log_path, os.O_WRONLY | os.O_CREAT, 0o644)
        os.dup2(log, 1)
        os.dup2(log, 2)
        body()
        code = 0
    except BaseException:  # noqa: BLE001 - reported in the log
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def log_tail(path: str, chars: int = 3000) -> str:
    """The end of a child's log ("" if it has none): for its failure."""
    try:
        return pathlib.Path(path).read_text()[-chars:]
    except OSError:
        return ""
