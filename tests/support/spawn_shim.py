"""Test-only: the processes vLLM starts with ``multiprocessing``'s spawn
(EngineCore, its MultiprocExecutor workers) forked from a zygote that
imported vLLM once, instead of each a fresh interpreter importing it
(15-20 s of CPU each on this machine; the tests start about 80).

How it is switched on: tox sets ``OVERLAY_SPAWN_ZYGOTES`` (a folder per
tox environment) and ``OVERLAY_SPAWN_SHIM`` (this file);
``--install-pth`` writes a one-line ``.pth`` into a harness that runs
``install()`` at every interpreter start-up where both are set (and
``OVERLAY_TESTS_FORK`` is not ``0``).  Elsewhere (a user's install, a
plain ``pytest``) nothing changes.

``install()`` points ``multiprocessing``'s spawn executable at a wrapper
(this file, run by the harness's Python with ``-IS``).  The wrapper is
the spawned process as its parent sees it: it stays until the real child
ends and exits as it did (code or signal), and forwards SIGTERM, SIGINT,
SIGHUP, SIGQUIT, SIGUSR1 and SIGUSR2 to it.  It hands its command line,
environment, working directory and the descriptors spawn passed (stdio,
the resource tracker's, the pipe the parent writes the process object
to, and every other one: pickled Connections name theirs by number) to
a zygote (``spawn_zygote.py``), which forks the child; the child runs
``spawn_main`` as a fresh interpreter would.
A zygote serves the spawns whose start-up matches its own: the
interpreter and its flags, the variables the loader and native libraries
read (``LOADER_VARIABLES``), and every variable Python code read from
``os.environ`` while the zygote imported ``PRELOAD`` (recorded by the
zygote, set or not).  A spawn whose start-up differs gets a zygote of its
own (started by the first such wrapper, under a lock), so the child's
modules load as they would have.  The zygote preloads only modules that
every spawned child imports before vLLM loads its plugins (``PRELOAD``),
so the overlay patches the same modules at the same point as in a fresh
child.  Anything else (another command line, a zygote that could not
start or refused, ``MAX_ZYGOTES`` zygotes of one folder running) execs
the real interpreter: a fresh child, as without the shim.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import socket
import sys

PROGRAM = re.compile(
    r"from multiprocessing\.spawn import spawn_main; "
    r"spawn_main\(tracker_fd=(\d+), pipe_handle=(\d+)\)\Z"
)
# Every spawned child of vLLM 0.11.2 and 0.32 on CPU (EngineCore, its
# workers) has these in sys.modules before load_general_plugins runs
# (measured with an import hook in both harnesses, LLM() with and without
# the mp executor): preloading them changes nothing the overlay patches.
PRELOAD = ("vllm.v1.executor.multiproc_executor",)
# A ``vllm serve`` front end (the ``vllm`` console script) has these before
# AsyncEngineArgs.add_cli_args loads the plugins (same measurement,
# ``vllm serve --help``, both harnesses).
FRONT_END_PRELOAD = (
    "vllm.entrypoints.cli.main",
    "vllm.engine.arg_utils",
    "vllm.v1.executor.multiproc_executor",
)
# (tests/unit/test_spawn_shim.py runs the machinery without vLLM)
PRELOAD_VARIABLE = "OVERLAY_SPAWN_PRELOAD"
# Read by the loader, libc or native libraries when they load (not through
# os.environ): part of every key.  What Python code reads from os.environ
# while the zygote imports PRELOAD is recorded by the zygote (names-*.json).
LOADER_VARIABLES = re.compile(
    r"(PYTHON|LD_|OMP_|KMP_|GOMP_|MKL_|MALLOC|TCMALLOC|GLIBC_|OVERLAY_SPAWN_PRELOAD\Z)"
)
MAX_ZYGOTES = 6
START_S = 240.0
FORWARDED = (
    signal.SIGTERM,
    signal.SIGINT,
    signal.SIGHUP,
    signal.SIGQUIT,
    signal.SIGUSR1,
    signal.SIGUSR2,
)


def _enabled() -> str | None:
    folder = os.environ.get("OVERLAY_SPAWN_ZYGOTES")
    if not folder or os.environ.get("OVERLAY_TESTS_FORK", "1") == "0":
        return None
    return folder


def install() -> None:
    """At interpreter start-up (the ``.pth``): spawn runs the wrapper."""
    folder = _enabled()
    if not folder:
        return
    import multiprocessing.spawn

    os.makedirs(folder, exist_ok=True)
    tag = hashlib.sha256(sys.executable.encode()).hexdigest()[:12]
    wrapper = os.path.join(folder, f"python-{tag}")
    if not os.path.exists(wrapper):
        shim = os.path.abspath(__file__)
        text = (
            f"#!{sys.executable} -IS\n"
            f"import runpy\nrunpy.run_path({shim!r}, run_name='__main__')\n"
        )
        tmp = f"{wrapper}.{os.getpid()}"
        with open(tmp, "w") as out:
            out.write(text)
        os.chmod(tmp, 0o755)
        os.replace(tmp, wrapper)
    multiprocessing.spawn.set_executable(wrapper)
    argv = sys.argv
    if len(argv) > 1 and os.path.basename(argv[0]) == "vllm" and argv[1] == "serve":
        import subprocess

        flags = subprocess._args_from_interpreter_flags()  # type: ignore[attr-defined]
        modules = preload(FRONT_END_PRELOAD)
        # Returns only where no zygote takes it: this process then runs on.
        _delegate(folder, flags, modules, {"run": list(argv)}, lambda: None)


def install_pth() -> None:
    """Into this interpreter's site-packages (tox's commands_pre, per harness)."""
    import sysconfig

    line = (
        "import os; (p := os.environ.get('OVERLAY_SPAWN_SHIM')) and "
        "__import__('runpy').run_path(p)['install']()\n"
    )
    path = os.path.join(sysconfig.get_paths()["purelib"], "overlay_test_spawn.pth")
    with open(path, "a+") as out:
        out.seek(0)
        if out.read() != line:
            out.truncate(0)
            out.write(line)


def _digest(value) -> str:
    return hashlib.sha256(json.dumps(value).encode()).hexdigest()[:16]


def startup_key(flags: list[str], env: dict[str, str], names: list[str]) -> str:
    """What a zygote's imports depend on: the interpreter, its flags, the
    loader's variables and the ``names`` its imports read (set or not)."""
    loader = sorted((k, v) for k, v in env.items() if LOADER_VARIABLES.match(k))
    read = [(name, env.get(name)) for name in names]
    return _digest([sys.executable, flags, loader, read])


def preload(default: tuple[str, ...] = PRELOAD) -> list[str]:
    return os.environ.get(PRELOAD_VARIABLE, ",".join(default)).split(",")


def names_path(folder: str, flags: list[str], modules: list[str]) -> str:
    """Where the first zygote of this interpreter, flags and imports writes
    the names its imports read."""
    return os.path.join(
        folder, f"names-{_digest([sys.executable, flags, modules])}.json"
    )


def socket_path(folder: str, key: str) -> str:
    path = os.path.join(folder, f"{key}.sock")
    if len(path) > 100:  # a socket's path has at most 107 bytes
        short = hashlib.sha256(folder.encode()).hexdigest()[:12]
        path = os.path.join("/tmp", f"overlay-spawn-{short}-{key}.sock")
    return path


RUNNING = "running-"


def running_mark(folder: str, pid: int) -> str:
    """The file a running zygote keeps in ``folder`` until it exits."""
    return os.path.join(folder, f"{RUNNING}{pid}")


def running(folder: str) -> list[int]:
    """The zygotes of ``folder`` that are running (each keeps its
    ``running_mark`` until it exits; a killed one leaves a stale mark)."""
    pids = []
    for name in os.listdir(folder):
        if name.startswith(RUNNING):
            pid = int(name[len(RUNNING) :])
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                continue
            except PermissionError:
                pass
            pids.append(pid)
    return pids


def _connect(path: str) -> socket.socket | None:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(path)
        return sock
    except OSError:
        sock.close()
        return None


def _zygote(
    folder: str, flags: list[str], env: dict[str, str], modules: list[str]
) -> socket.socket | None:
    """A connection to the zygote for this start-up, started if there is none."""
    import fcntl
    import select
    import subprocess

    def current() -> tuple[str | None, socket.socket | None]:
        try:
            with open(names_path(folder, flags, modules)) as names:
                key = startup_key(flags, env, json.load(names))
        except (OSError, ValueError):
            return None, None
        return key, _connect(socket_path(folder, key))

    key, sock = current()
    if sock is not None:
        return sock
    base = os.path.basename(names_path(folder, flags, modules))[
        len("names-") : -len(".json")
    ]
    with open(os.path.join(folder, f"{base}.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one start at a time
        key, sock = current()
        failed = os.path.join(folder, f"{key or base}.failed")
        if sock is not None or os.path.exists(failed):
            return sock
        if len(running(folder)) >= MAX_ZYGOTES:
            return None
        logs = [n for n in os.listdir(folder) if n.endswith(".log")]
        zygote = os.path.join(
            os.path.dirname(os.path.abspath(__file__)), "spawn_zygote.py"
        )
        ready_r, ready_w = os.pipe()
        with open(os.path.join(folder, f"zygote-{len(logs)}.log"), "ab") as log:
            subprocess.run(
                [
                    sys.executable,
                    *flags,
                    zygote,
                    str(ready_w),
                    folder,
                    json.dumps(flags),
                ]
                + modules,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                cwd=folder,
                pass_fds=(ready_w,),
                start_new_session=True,  # a test's killpg is not the zygote's
                check=False,
            )  # returns at once: the zygote runs on in a forked child
        os.close(ready_w)
        ok = select.select([ready_r], [], [], START_S)[0] and os.read(ready_r, 1)
        os.close(ready_r)
        key, sock = current()
        if ok == b"1" and sock is not None:
            return sock
        open(os.path.join(folder, f"{key or base}.failed"), "w").close()
        return None


def _fresh(argv: list[str]) -> None:
    os.execv(sys.executable, [sys.executable, *argv])


def _exit_as(rc: int) -> None:
    if rc < 0:
        signal.signal(-rc, signal.SIG_DFL)
        os.kill(os.getpid(), -rc)
    os._exit(rc if rc >= 0 else 1)


def _delegate(folder, flags, modules, what: dict, fresh) -> None:
    """Have a zygote fork this process's work (``what``: ``{"spawn": ...}``
    or ``{"run": argv}``) and become its stand-in: forward signals, exit as
    it exits.  ``fresh()`` where no zygote takes it."""
    # Every descriptor this process has: spawn passes more than the two on
    # its command line (pickled Connections name theirs by number).
    targets = []
    for name in os.listdir("/proc/self/fd"):
        try:
            os.fstat(int(name))
            targets.append(int(name))
        except OSError:
            pass  # listdir's own
    if len(targets) > 60:  # more than one message carries here
        return fresh()
    env = dict(os.environ)
    sock = _zygote(folder, flags, env, modules)
    if sock is None:
        return fresh()
    request = json.dumps(
        {"targets": targets, "env": env, "cwd": os.getcwd(), **what}
    ).encode()
    try:
        socket.send_fds(sock, [len(request).to_bytes(4, "big") + request], targets)
        replies = sock.makefile("r")
        first = replies.readline()
    except OSError:
        first = ""
    if not first:  # refused, or the zygote ended before it forked
        sock.close()
        return fresh()
    child = json.loads(first)["pid"]
    for signum in FORWARDED:
        signal.signal(signum, lambda signum, _frame: os.kill(child, signum))
    for fd in targets:
        if fd > 2:
            os.close(fd)  # the child has its own
    last = replies.readline()
    _exit_as(json.loads(last)["rc"] if last else 1)


def wrapper(argv: list[str]) -> None:
    folder = _enabled()
    if "-c" not in argv or not folder:
        _fresh(argv)
    at = argv.index("-c")
    flags, rest = argv[:at], argv[at:]
    forking = len(rest) == 3 and rest[2] == "--multiprocessing-fork"
    found = forking and PROGRAM.match(rest[1])
    if not found:
        _fresh(argv)
    spawn = {"tracker_fd": int(found[1]), "pipe_handle": int(found[2])}
    _delegate(folder, flags, preload(), {"spawn": spawn}, lambda: _fresh(argv))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--install-pth"]:
        install_pth()
    else:
        wrapper(sys.argv[1:])
