"""Spawns processes through tests/support/spawn_shim.py and prints one JSON
line of what each case saw (tests/unit/test_spawn_shim.py reads it).

    python run_spawn_shim.py CASE
"""

from __future__ import annotations

import json
import multiprocessing
import os
import pathlib
import runpy
import signal
import sys
import time

SHIM = pathlib.Path(__file__).parents[1] / "support" / "spawn_shim.py"


def report(conn, code):
    """The child: who it is, and what came through its pickled Connection."""
    with open(f"/proc/{os.getppid()}/cmdline", "rb") as cmdline:
        parent = cmdline.read().decode()
    conn.send(
        {
            "pid": os.getpid(),
            "ppid": os.getppid(),
            "parent_cmdline": parent,
            "marker": os.environ.get("CASE_MARKER"),
            "runtime_variable": os.environ.get("LATER"),
            "cwd": os.getcwd(),
            "got": conn.recv(),
        }
    )
    sys.exit(code)


def sleeper(conn):
    conn.send(os.getpid())
    time.sleep(60)


def parent_of_a_sleeper(conn):
    """Spawns a sleeper of its own and reports its real pid."""
    runpy.run_path(str(SHIM))["install"]()
    context = multiprocessing.get_context("spawn")
    mine, theirs = context.Pipe()
    proc = context.Process(target=sleeper, args=(theirs,))
    proc.start()
    conn.send(mine.recv())
    proc.join()


def fails():
    raise RuntimeError("raised in the spawned child")


def gone(pid: int, deadline_s: float = 10.0) -> bool:
    """Whether PID is gone (or a zombie) within DEADLINE_S."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        try:
            with open(f"/proc/{pid}/stat") as stat:
                if stat.read().split()[2] == "Z":
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


def main() -> None:
    case = sys.argv[1]
    runpy.run_path(str(SHIM))["install"]()  # what the harness's .pth does
    context = multiprocessing.get_context("spawn")
    out: dict = {}
    if case in ("exit", "fresh"):
        parent, child = context.Pipe()
        proc = context.Process(target=report, args=(child, 7))
        proc.start()
        parent.send("sent through the pipe")
        out = parent.recv()
        proc.join(30)
        out.update(wrapper_pid=proc.pid, exitcode=proc.exitcode)
    elif case in ("terminate", "kill"):
        parent, child = context.Pipe()
        proc = context.Process(target=sleeper, args=(child,))
        proc.start()
        real = parent.recv()
        getattr(proc, case)()
        proc.join(30)
        if not gone(real):
            os.kill(real, signal.SIGKILL)
            real = f"{real} still running"
        out = {"exitcode": proc.exitcode, "real": real, "wrapper_pid": proc.pid}
    elif case == "cascade":  # SIGKILL a child's wrapper: its own child goes too
        parent, child = context.Pipe()
        proc = context.Process(target=parent_of_a_sleeper, args=(child,))
        proc.start()
        grandchild = parent.recv()
        proc.kill()
        proc.join(30)
        out = {"grandchild": grandchild, "gone": gone(grandchild)}
    elif case == "raises":
        proc = context.Process(target=fails)
        proc.start()
        proc.join(30)
        out = {"exitcode": proc.exitcode}
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
