"""Runs the test suites' runner scripts as forked children of one process
that imported vLLM once (about 14 s of CPU per runner process saved here).

Started by tests/e2e/conftest.py (``LLMRun``) with the harness's Python.
It imports vLLM, registers nothing and starts no engine, then reads one
request per line on stdin, JSON:

    {"script": PATH, "argv": [...], "env": {...}, "log": PATH, "deadline_s": S,
     "cwd": PATH (optional)}

and answers one line, JSON ``{"rc": N}``, once that run is over (its
stdout carries only the answers; its own logs go to stderr).  Each
run's child starts a session of its own (its engine's processes with it),
takes ``env`` as its whole environment (read by vLLM and the overlay when
the engine starts and the overlay registers), writes its stdout and stderr
to ``log`` and runs ``script`` as ``__main__`` (an exception it does not
catch goes to ``sys.excepthook``, as at a process's top level), then exits
as a process does (atexit hooks: vLLM's shutdown), less the interpreter's
teardown.
Past ``deadline_s`` the session is killed (rc -9); after a run, whatever
the session left running is killed.
Variables Python reads only at start-up (``PYTHON*``) cannot be given: the
caller runs those scripts as processes of their own.
"""

from __future__ import annotations

import contextlib
import json
import os
import runpy
import signal
import sys
import time

from forked_exit import run_then_exit  # this script's folder: sys.path[0]


def child(request: dict) -> None:
    """In the forked child: never returns."""

    def program() -> None:
        os.setsid()
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)  # the requests' pipe is the parent's
        log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.environ.clear()
        os.environ.update(request["env"])
        if request.get("cwd"):
            os.chdir(request["cwd"])
        script = request["script"]
        sys.argv = [script, *request["argv"]]
        sys.path[0] = os.path.dirname(script)
        runpy.run_path(script, run_name="__main__")

    run_then_exit(program)


def wait(pid: int, deadline_s: float) -> int:
    end = time.monotonic() + deadline_s
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            rc = os.waitstatus_to_exitcode(status)
            break
        if time.monotonic() > end:
            rc = -9
            break
        time.sleep(0.02)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)  # the run's session: what it left
    if rc == -9:
        os.waitpid(pid, 0)
    return rc


def main() -> None:
    # The answers go to the stdout this process was given; whatever else
    # prints (vLLM logs to stdout) goes to stderr.
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    import vllm  # noqa: F401 - the bulk of a runner's start-up
    import vllm.engine.arg_utils  # noqa: F401

    answers.write(json.dumps({"ready": True}) + "\n")
    answers.flush()
    for line in sys.stdin:
        request = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            answers.close()
            child(request)
        rc = wait(pid, float(request["deadline_s"]))
        answers.write(json.dumps({"rc": rc}) + "\n")
        answers.flush()


if __name__ == "__main__":
    main()
