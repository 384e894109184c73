"""The end of a forked child that stands in for a fresh interpreter (the
zygotes' children: ``run_zygote.py``, ``spawn_zygote.py``): run its
program as ``__main__`` runs, then leave as a process does."""

from __future__ import annotations

import atexit
import os
import sys
import threading
from collections.abc import Callable
from typing import NoReturn


def exit_code(value: object) -> int:
    """The status ``sys.exit(value)`` gives a process (a non-int is printed
    to stderr and gives 1)."""
    if value is None:
        return 0
    if isinstance(value, int):
        return value
    print(value, file=sys.stderr)
    return 1


def run_then_exit(program: Callable[[], object]) -> NoReturn:
    """``program()``, then the rest of an interpreter's exit: an uncaught
    exception goes to ``sys.excepthook`` (status 1), non-daemon threads are
    joined, the atexit hooks run (vLLM's engine shutdown, weakref
    finalizers); not the interpreter's teardown (seconds of it in a child of
    a process that imported vLLM).  Never returns."""
    code = 1
    try:
        program()
        code = 0
    except SystemExit as exc:
        code = exit_code(exc.code)
    except BaseException:  # noqa: BLE001 - reported as Python's top level does
        sys.excepthook(*sys.exc_info())
    try:
        threading._shutdown()  # type: ignore[attr-defined]
        atexit._run_exitfuncs()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
