"""The test session's side of tests/support/run_zygote.py: a zygote (this
interpreter, so this harness's vLLM) per ``PYTHONPATH`` the runs ask for
(a patched vLLM tree is imported from it), started on first use and
killed when the session ends.  ``forked_run`` sends one run to it and
waits for its exit status."""

from __future__ import annotations

import atexit
import json
import os
import pathlib
import subprocess
import sys
import tempfile

ZYGOTE = pathlib.Path(__file__).parent / "run_zygote.py"
DEADLINE_S = 300

_zygotes: dict[str, subprocess.Popen] = {}


def _stop() -> None:
    for zygote in _zygotes.values():
        if zygote.poll() is None:
            zygote.kill()
            zygote.wait()


def _start(pythonpath: str) -> subprocess.Popen:
    errors = pathlib.Path(tempfile.gettempdir()) / "run_zygote.log"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    with open(errors, "a") as zygote_log:  # the child keeps its own copy
        zygote = subprocess.Popen(
            [sys.executable, str(ZYGOTE)],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=zygote_log,
            text=True,
        )
    ready = zygote.stdout.readline()
    if ready.strip() != '{"ready": true}':
        zygote.kill()
        zygote.wait()
        raise AssertionError(f"run_zygote.py did not start (see {errors})")
    return zygote


def forked_run(
    script: str,
    argv: list[str],
    env: dict[str, str],
    log: pathlib.Path,
    deadline_s: float = DEADLINE_S,
    cwd: pathlib.Path | None = None,
) -> int:
    """``script`` run as ``__main__`` with ``argv`` and ``env`` (its whole
    environment) in a forked child of the zygote, its output in ``log``;
    its exit status (-9: killed past ``deadline_s``); it runs in ``cwd``
    if given (else the test session's working directory).  The zygote is the
    one started with ``env``'s ``PYTHONPATH``."""
    pythonpath = env.get("PYTHONPATH", "")
    zygote = _zygotes.get(pythonpath)
    if zygote is None or zygote.poll() is not None:
        if not _zygotes:
            atexit.register(_stop)
        zygote = _zygotes[pythonpath] = _start(pythonpath)
    request = {
        "script": script,
        "argv": argv,
        "env": env,
        "log": str(log),
        "deadline_s": deadline_s,
        "cwd": str(cwd) if cwd else None,
    }
    zygote.stdin.write(json.dumps(request) + "\n")
    zygote.stdin.flush()
    answer = zygote.stdout.readline()
    assert answer, "run_zygote.py exited (see run_zygote.log in the session's TMPDIR)"
    return json.loads(answer)["rc"]


def enabled() -> bool:
    """Whether runs fork (``OVERLAY_TESTS_FORK=0``: each a process of its
    own)."""
    return os.environ.get("OVERLAY_TESTS_FORK", "1") != "0"


def runner():
    """``forked_run``, or None (a process of its own) when forks are off:
    for helpers that take a ``runner``."""
    return forked_run if enabled() else None
