"""The shell steps of a recipe page (docs/see-it-work.md), for a test that
runs them verbatim: each step is the ```bash block right after an HTML
comment ``<!-- see-it-work: step N -->``, numbered 1, 2, ... in page order.

The steps, run one after the other each in its own ``bash -e`` (a new
session, so everything it starts can be found again), are what a reader
pastes into one terminal: a step reads the variables of step 1 from the
environment the test gives it."""

from __future__ import annotations

import contextlib
import os
import re
import signal

MARKER = re.compile(r"<!-- see-it-work: step (\d+) -->")
# The marker, blank lines, then a bash fence and its body.
STEP = re.compile(r"<!-- see-it-work: step (\d+) -->\s*\n```bash\n(.*?)\n```", re.S)


class RecipeError(ValueError):
    """The page's markers and blocks do not form steps 1..N."""


def recipe_steps(text: str) -> list[str]:
    """The bodies of the marked bash blocks, step 1 first.  Every marker
    must sit right above a ```bash block, and the numbers must run 1..N in
    page order (a reordered or lost step is an error, not a skipped step)."""
    markers = [int(m.group(1)) for m in MARKER.finditer(text)]
    steps = [(int(m.group(1)), m.group(2)) for m in STEP.finditer(text)]
    if not markers:
        raise RecipeError("no '<!-- see-it-work: step N -->' marker in the page")
    if len(steps) != len(markers):
        found = {n for n, _ in steps}
        lost = [n for n in markers if n not in found]
        raise RecipeError(f"marker(s) of step {lost} not followed by a ```bash block")
    numbers = [n for n, _ in steps]
    if numbers != list(range(1, len(numbers) + 1)):
        raise RecipeError(f"steps numbered {numbers}: expected 1..{len(numbers)}")
    for n, body in steps:
        if not body.strip():
            raise RecipeError(f"step {n}'s block is empty")
    return [body for _, body in steps]


def session_processes(sessions: set[int]) -> list[int]:
    """The live processes (not zombies) whose session id is in ``sessions``."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        # pid (comm) state ppid pgrp session ...; comm may hold spaces.
        fields = stat.rpartition(")")[2].split()
        if fields[0] != "Z" and int(fields[3]) in sessions:
            out.append(int(entry))
    return out


def kill_sessions(sessions: set[int]) -> list[int]:
    """SIGKILL every process left in ``sessions`` (the steps' own); the
    pids killed."""
    pids = session_processes(sessions)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return pids
