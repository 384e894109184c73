"""One temporary folder per test session: every temporary file the tests and
what they start make (vLLM's ipc sockets and process-group files, the pool
servers' folders, engines' logs) goes there (``TMPDIR``, inherited by every
child process), and it is removed when the session ends, unless a test
failed: then it stays and its path is printed, with every log in it."""

from __future__ import annotations

import os
import shutil
import tempfile

SESSION_TMP = tempfile.mkdtemp(prefix="vllm-overlay-tests-")
os.environ["TMPDIR"] = SESSION_TMP
tempfile.tempdir = None  # gettempdir() reads TMPDIR again


def pytest_sessionfinish(session, exitstatus) -> None:
    if exitstatus == 0:
        shutil.rmtree(SESSION_TMP, ignore_errors=True)


def pytest_terminal_summary(terminalreporter, exitstatus) -> None:
    if exitstatus != 0 and os.path.isdir(SESSION_TMP):
        terminalreporter.write_line(f"temporary files kept: {SESSION_TMP}")
