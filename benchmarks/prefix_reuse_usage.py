"""Where the pool reload's read goes, on either release: the kernel's own
accounting of the load thread (time on a core, runnable but waiting for
one, page faults), of the engine's process and of the pool server, taken
around each ``KVPool._load`` (GETs sent to the last value read and
checked) by a wrapper set on the class in the engine's process (nothing in
the pool changes), and the table printed from it."""

from __future__ import annotations

import gc
import pathlib
import resource
import threading
import time

from prefix_reuse_report import median_cells

# (field, row label, format) of the table; ms unless said.
ROWS = [
    ("wall_ms", "the read (GETs sent to the last value checked)", ".1f"),
    ("cpu_ms", "the load thread on a core", ".1f"),
    ("runq_ms", "the load thread runnable, waiting for a core", ".1f"),
    ("blocked_ms", "the load thread blocked (socket or GIL)", ".1f"),
    ("others_ms", "the engine's other threads on a core", ".1f"),
    ("server_ms", "the pool server on a core (all its threads)", ".1f"),
    ("gc_ms", "garbage collection in the engine's process (any thread)", ".1f"),
    ("minflt", "the load thread's minor page faults (count)", ".0f"),
]


def _schedstat(path: str) -> tuple[float, float]:
    """(seconds on a core, seconds runnable but waiting for one) of a task,
    from the scheduler's own accounting (ns)."""
    with open(path) as f:
        on, wait, _ = f.read().split()
    return int(on) / 1e9, int(wait) / 1e9


def _thread() -> dict[str, float]:
    """The calling (load) thread's time on a core (its CPU clock: exact,
    where schedstat's figure for a running task lags by up to a tick), its
    time waiting for one (schedstat, current once the task runs) and its
    minor page faults."""
    _, wait = _schedstat("/proc/thread-self/schedstat")
    faults = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    return {"cpu_s": time.thread_time(), "runq_s": wait, "minflt": faults}


def _others(server_pid: int | None) -> dict[str, float]:
    """This process's CPU (every thread) and the pool server's (all its
    threads)."""
    proc = resource.getrusage(resource.RUSAGE_SELF)
    out = {"process_cpu_s": proc.ru_utime + proc.ru_stime}
    if server_pid:
        try:
            tasks = pathlib.Path(f"/proc/{server_pid}/task").iterdir()
            out["server_cpu_s"] = sum(_schedstat(f"{t}/schedstat")[0] for t in tasks)
        except OSError:  # the server is gone
            pass
    return out


class LoadUsage:
    """Wraps ``KVPool._load`` (the load thread's job) in this process; the
    differences of those figures over every load since the last ``take``."""

    def __init__(self, server_pid: int | None) -> None:
        from vllm_overlay.core.pool.pool import KVPool

        self._lock = threading.Lock()
        self._total: dict[str, float] = {}
        self._gc_s = 0.0  # this process's collections, cumulative
        self._gc_start = 0.0
        gc.callbacks.append(self._collecting)
        inner = KVPool._load

        def _load(pool, client, job):
            # Nested spans: the others' figures outside the wall clock's,
            # the wall clock's outside the thread's own (so the thread's
            # time on a core never exceeds the read's wall time, even for
            # a load as short as the reads of /proc themselves).
            before = _others(server_pid)
            before["gc_s"] = self._gc_s
            start = time.monotonic()
            before.update(_thread())
            try:
                return inner(pool, client, job)
            finally:
                after = _thread()
                wall = time.monotonic() - start
                after.update(_others(server_pid), gc_s=self._gc_s)
                self._add(wall, before, after)

        KVPool._load = _load

    def _collecting(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_start = time.perf_counter()
        else:
            self._gc_s += time.perf_counter() - self._gc_start

    def _add(self, wall: float, before: dict, after: dict) -> None:
        with self._lock:
            total = self._total
            total["wall_s"] = total.get("wall_s", 0.0) + wall
            # which thread (for a profiler: perf record --tid)
            total["load_tid"] = threading.get_native_id()
            for key, value in after.items():
                if key in before:
                    total[key] = total.get(key, 0) + value - before[key]

    def take(self) -> dict[str, float]:
        with self._lock:
            out, self._total = self._total, {}
        return out


def read_usage(res: dict) -> dict[str, float]:
    """A run's read split by where the load thread was (on a core, waiting
    for one, blocked) and what else ran meanwhile (ms)."""
    u = res.get("read_usage") or {}
    if "wall_s" not in u:
        return {}
    out = {
        "wall_ms": 1e3 * u["wall_s"],
        "cpu_ms": 1e3 * u["cpu_s"],
        "runq_ms": 1e3 * u["runq_s"],
        "blocked_ms": 1e3 * (u["wall_s"] - u["cpu_s"] - u["runq_s"]),
        "others_ms": 1e3 * (u["process_cpu_s"] - u["cpu_s"]),
        "minflt": u["minflt"],
    }
    if "server_cpu_s" in u:
        out["server_ms"] = 1e3 * u["server_cpu_s"]
    if "gc_s" in u:
        out["gc_ms"] = 1e3 * u["gc_s"]
    return out


def print_read_usage(paths: list, runs: list[dict]) -> None:
    """The table, for the paths whose runs read from the pool."""
    keys = [
        p[0]
        for p in paths
        if any(read_usage(run["paths"].get(p[0], {})) for run in runs)
    ]
    if not keys:
        return
    labels = {p[0]: p[1] for p in paths}
    print()
    print(
        "| where the pool read's time went (ms, median over rounds; the "
        "kernel's accounting) | " + " | ".join(labels[k] for k in keys) + " |"
    )
    print("|---|" + "---|" * len(keys))
    for field, label, fmt in ROWS:
        cells = median_cells(
            keys, runs, lambda res, f=field: read_usage(res).get(f), fmt
        )
        print(f"| {label} | " + " | ".join(cells) + " |")
