"""Test-only: the zygote ``spawn_shim.py``'s wrappers hand spawned
processes to (see that file).  Started by the first wrapper whose
start-up has none:

    python [FLAGS] spawn_zygote.py READY_FD FOLDER FLAGS_JSON MODULE...

It forks at once and its first process exits (the zygote is no child of
the wrapper that started it); it writes ``1`` to READY_FD once it listens.

It imports MODULE..., recording which variables Python code reads from
``os.environ`` meanwhile (written to FOLDER's names file if it has none),
then listens on the socket ``spawn_shim.socket_path`` names for its
start-up key (created under a temporary name, then renamed: it exists
once the zygote is ready).  For each connection it reads one request: a
4-byte length, JSON {targets, env, cwd, and "spawn": {tracker_fd,
pipe_handle} or "run": ARGV}, and the descriptors ``targets`` names (in
that order).  A request whose start-up differs from the zygote's (its
environment as started) in any variable the imports read or the loader
reads is refused (closed: the wrapper starts a fresh child).  Otherwise
it forks a child (a process group of its own) that takes those
descriptors at those numbers, the environment and the working directory,
and runs ``spawn_main`` as ``python -c ... --multiprocessing-fork`` would,
or the script ARGV[0] as ``python ARGV`` would; it answers
``{"pid": N}``, then ``{"rc": N}`` (``os.waitstatus_to_exitcode``) when
the child ends.  A connection that closes first (the wrapper was killed)
gets its child's group SIGKILLed: the child, and the wrappers of the
processes it started, whose zygotes kill those in turn.  The zygote is
single-threaded (checked after the imports) and exits when it has had no
child for ``IDLE_S``; its children die with it (``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import json
import os
import runpy
import select
import signal
import socket
import sys
import threading
import time

import spawn_shim as shim  # this folder: sys.path[0], removed below
from forked_exit import run_then_exit  # this folder too

IDLE_S = 300.0


def _log(message: str) -> None:
    print(f"spawn_zygote {os.getpid()}: {message}", file=sys.stderr, flush=True)


def _read_request(conn: socket.socket) -> tuple[dict, list[int]]:
    conn.settimeout(10.0)
    data, fds, _flags, _addr = socket.recv_fds(conn, 1 << 16, 64)
    if len(data) < 4:
        raise OSError("short request")
    size = int.from_bytes(data[:4], "big")
    data = data[4:]
    while len(data) < size:
        more = conn.recv(size - len(data))
        if not more:
            raise OSError("request cut short")
        data += more
    conn.settimeout(None)
    return json.loads(data), fds


def _taken(targets: list[int], own: list[int]) -> list[int]:
    """Target descriptors a module of this process holds open (the child
    would lose them); none after the imports measured here."""
    taken = []
    for fd in targets:
        if fd > 2 and fd not in own:
            try:
                os.fstat(fd)
                taken.append(fd)
            except OSError:
                pass
    return taken


def _child(request: dict, fds: list[int], zygote_fds: list[int]) -> None:
    """In the forked child: never returns."""

    def program() -> None:
        for fd in zygote_fds:
            os.close(fd)
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        high = [fcntl.fcntl(fd, fcntl.F_DUPFD, 1000) for fd in fds]
        for fd in fds:
            os.close(fd)
        for source, target in zip(high, request["targets"]):
            os.dup2(source, target)
        for source in high:
            os.close(source)
        os.setpgid(0, 0)  # its own group: killed with what it started
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        if "spawn" in request:
            sys.argv = ["-c", "--multiprocessing-fork"]
            from multiprocessing.spawn import spawn_main

            spawn_main(**request["spawn"])
        else:  # a script, as ``python SCRIPT ARGS`` runs it
            sys.argv = list(request["run"])
            sys.path.insert(0, os.path.dirname(os.path.abspath(sys.argv[0])))
            runpy.run_path(sys.argv[0], run_name="__main__")

    run_then_exit(program)


def _import_recording(modules: list[str]) -> list[str]:
    """Import ``modules``; the names Python code read from os.environ."""
    read: set[str] = set()
    environ_class = type(os.environ)

    walked: set[str] = set()  # names a walk over the whole environment yields

    class Recording(environ_class):  # get() and ``in`` go through here too
        def __iter__(self):
            # dict(os.environ), .items(), .copy(): a snapshot of everything
            # (for the processes a library starts, or a prefix scan), which
            # reads no variable in particular; the reads that follow are its.
            names = list(super().__iter__())
            walked.clear()
            walked.update(names)
            return iter(names)

        def __getitem__(self, name):
            name_ = name if isinstance(name, str) else os.fsdecode(name)
            if name_ in walked:
                walked.discard(name_)
            else:
                read.add(name_)
            return super().__getitem__(name)

    os.environ.__class__ = Recording
    try:
        for module in modules:
            __import__(module)
    finally:
        os.environ.__class__ = environ_class
    return sorted(read)


def _mismatch(env: dict[str, str], mine: dict[str, str], names: list[str]) -> list[str]:
    loader = [n for n in {*env, *mine} if shim.LOADER_VARIABLES.match(n)]
    return sorted(n for n in {*names, *loader} if env.get(n) != mine.get(n))


def _serve(
    conn: socket.socket, start_env: dict, names: list[str], own: list[int]
) -> int:
    """Read one request and fork its child (its pid); raises to refuse."""
    request, fds = _read_request(conn)
    try:
        if len(fds) != len(request["targets"]):
            raise OSError("descriptors missing")
        differ = _mismatch(request["env"], start_env, names)
        if differ:
            raise OSError(f"start-up differs in {differ}")
        mine = [*own, conn.fileno()]
        taken = _taken(request["targets"], mine + fds)
        if taken:
            raise OSError(f"descriptors {taken} are open here")
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _child(request, fds, mine)
    finally:
        for fd in fds:
            os.close(fd)
    with contextlib.suppress(OSError):
        conn.sendall((json.dumps({"pid": pid}) + "\n").encode())
    return pid


def main() -> None:
    ready = int(sys.argv[1])
    folder, flags, modules = sys.argv[2], json.loads(sys.argv[3]), sys.argv[4:]
    start_env = dict(os.environ)  # the imports below may add to it
    if os.fork():
        # Out of the starting wrapper's process tree (vLLM kills an engine
        # core's whole tree); the wrapper waits on ``ready`` instead.
        os._exit(0)
    running = shim.running_mark(folder, os.getpid())  # counted by shim.running()
    open(running, "w").close()
    sys.path.pop(0)  # this script's folder: not the children's
    os.dup2(2, 1)  # vLLM logs to stdout
    started = time.monotonic()
    names = _import_recording(modules)
    if threading.active_count() != 1:
        _log(f"threads after the imports: {threading.enumerate()}; not forking")
        sys.exit(3)
    shared = shim.names_path(folder, flags, modules)
    if not os.path.exists(shared):
        with open(f"{shared}.{os.getpid()}", "w") as out:
            json.dump(names, out)
        os.replace(f"{shared}.{os.getpid()}", shared)
    with open(shared) as given:
        key = shim.startup_key(flags, start_env, json.load(given))
    path = shim.socket_path(folder, key)
    took = time.monotonic() - started
    _log(
        f"key {key}: {', '.join(modules)} imported in {took:.1f} s; "
        f"{len(names)} variables read"
    )

    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(f"{path}.tmp")
    listener.listen(64)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    os.replace(f"{path}.tmp", path)
    os.write(ready, b"1")
    os.close(ready)

    children: dict[int, socket.socket | None] = {}  # pid -> its wrapper's connection
    by_conn: dict[socket.socket, int] = {}
    idle_since = time.monotonic()
    while children or time.monotonic() - idle_since < IDLE_S:
        readable, _, _ = select.select([listener, wake_r, *by_conn], [], [], 1.0)
        if listener in readable:
            conn, _ = listener.accept()
            own = [listener.fileno(), wake_r, wake_w, *(c.fileno() for c in by_conn)]
            try:
                pid = _serve(conn, start_env, names, own)
            except Exception as exc:  # noqa: BLE001 - one request, not the zygote
                _log(f"refused a request (the wrapper starts a fresh child): {exc!r}")
                conn.close()
            else:
                children[pid] = conn
                by_conn[conn] = pid
        if wake_r in readable:
            with contextlib.suppress(BlockingIOError):
                while os.read(wake_r, 512):
                    pass
        for conn in [c for c in readable if c in by_conn]:
            try:
                gone = not conn.recv(1)
            except OSError:
                gone = True
            if gone:  # the wrapper was killed: so is its child, and the
                # wrappers of what it started (its group), whose zygotes then
                # kill their children in turn
                pid = by_conn.pop(conn)
                children[pid] = None
                conn.close()
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(pid, signal.SIGKILL)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        while children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            conn = children.pop(pid, None)
            if conn is not None:
                by_conn.pop(conn, None)
                rc = os.waitstatus_to_exitcode(status)
                with contextlib.suppress(OSError):
                    conn.sendall((json.dumps({"rc": rc}) + "\n").encode())
                conn.close()
            if not children:
                idle_since = time.monotonic()
    os.unlink(path)
    os.unlink(running)
    _log("idle: exiting")


if __name__ == "__main__":
    main()
