"""Where a reload's time goes, on vLLM 0.32 (``prefix_reuse_v032.py``'s
per-phase attribution): timestamps taken in the engine's process by
wrappers set on the pool tier's and the offloading worker's instances
(nothing in vLLM or the tier changes), and the tables printed from them."""

from __future__ import annotations

import pathlib
import resource
import statistics
import time

# A reload's timeline, in order: (event, the phase that ends with it).  A
# phase is the time since the previous event the request went through.
EVENTS = [
    ("arrival", "arrival (front end)"),
    ("lookup", "arrival -> first tier lookup"),
    ("answered", "lookup wait (tier lookups answered)"),
    ("tier_submit", "promotion queued (to the step's end)"),
    ("first_value", "load: the first value arriving"),
    ("read_done", "load thread: the rest read + checked"),
    ("promoted", "promotion to host reported"),
    ("h2d_submit", "host->device copy scheduled"),
    ("h2d_seen", "host->device copy (to reported done)"),
    ("first_token", "prefill of the rest + first token"),
]


class Phases:
    """Timestamps (``time.monotonic``, the engine core's clock) of each
    reload's steps, from wrappers set on the tier's and the offloading
    worker's instances in this process; ``steps``: the scheduler's steps
    (``schedule`` calls) since ``reset``."""

    def __init__(self, tier, worker, scheduler, server_pid: int | None = None) -> None:
        self.server_pid = server_pid
        self.t: dict[str, float] = {}
        self.h2d_s = 0.0
        self.steps = 0
        self.read_usage: dict[str, float] = {}
        self._read_start = None
        self._load_jobs: set[int] = set()
        self._wrap(scheduler, "schedule", self._step)
        if tier is not None:
            self._wrap(tier, "lookup", self._lookup)
            self._wrap(tier, "submit_load", self._first("tier_submit"))
            self._wrap(tier, "_into", self._first_value)
            self._wrap(tier, "_verdicts", self._read_done)
            self._wrap(tier, "get_finished_jobs", self._finished)
        if worker is not None:
            self._wrap(worker, "submit_load", self._h2d_submit)
            self._wrap(worker, "get_finished", self._h2d_done)

    def reset(self) -> None:
        self.t = {}
        self.h2d_s = 0.0
        self.steps = 0
        self.read_usage = {}
        self._read_start = None

    def _step(self, *args) -> None:
        self.steps += 1

    @staticmethod
    def _wrap(obj, name: str, after) -> None:
        inner = getattr(obj, name)

        def wrapped(*args, **kwargs):
            out = inner(*args, **kwargs)
            after(out, *args)
            return out

        setattr(obj, name, wrapped)

    def _first(self, event: str):
        return lambda out, *args: self.t.setdefault(event, time.monotonic())

    def _first_value(self, out, *args) -> None:
        # The load thread, its first value's buffers given: where its time,
        # its process's and the server's go until the last value is checked.
        if "first_value" not in self.t:
            self.t["first_value"] = time.monotonic()
            self._read_start = _usage(self.server_pid)

    def _read_done(self, out, *args) -> None:
        self.t["read_done"] = time.monotonic()
        if self._read_start is not None:
            end = _usage(self.server_pid)
            self.read_usage = {k: end[k] - v for k, v in self._read_start.items()}

    def _lookup(self, verdict, *args) -> None:
        now = time.monotonic()
        self.t.setdefault("lookup", now)
        if verdict.name == "HIT":
            self.t.setdefault("answered", now)

    def _finished(self, results, *args) -> None:
        if any(r.transfer_bytes for r in results if r.success):
            self.t.setdefault("promoted", time.monotonic())

    def _h2d_submit(self, ok, job_id, *args) -> None:
        self._load_jobs.add(job_id)
        self.t.setdefault("h2d_submit", time.monotonic())

    def _h2d_done(self, results, *args) -> None:
        for r in results:
            if r.job_id in self._load_jobs:
                self._load_jobs.discard(r.job_id)
                self.t["h2d_seen"] = time.monotonic()
                self.h2d_s += r.transfer_time or 0.0


def _schedstat(path: str) -> tuple[float, float]:
    """(seconds on a core, seconds runnable but waiting for one) of a task,
    from the scheduler's own accounting (ns)."""
    with open(path) as f:
        on, wait, _ = f.read().split()
    return int(on) / 1e9, int(wait) / 1e9


def _usage(server_pid: int | None) -> dict[str, float]:
    """The calling (load) thread's time on a core and waiting for one, its
    minor page faults, the whole process's CPU, and the pool server's CPU
    (all its threads)."""
    on, wait = _schedstat("/proc/thread-self/schedstat")
    thread = resource.getrusage(resource.RUSAGE_THREAD)
    proc = resource.getrusage(resource.RUSAGE_SELF)
    out = {
        "cpu_s": on,
        "runq_s": wait,
        "minflt": thread.ru_minflt,
        "process_cpu_s": proc.ru_utime + proc.ru_stime,
    }
    if server_pid:
        try:
            tasks = pathlib.Path(f"/proc/{server_pid}/task").iterdir()
            out["server_cpu_s"] = sum(_schedstat(f"{t}/schedstat")[0] for t in tasks)
        except OSError:  # the server is gone
            pass
    return out


# -- extra report ----------------------------------------------------------------
def print_phases(paths: list, loads: tuple, runs: list[dict]) -> None:
    """Hits by source per path, and each reload's per-phase attribution
    (ms, median over rounds)."""
    print()
    print("hits by source (vLLM's CacheHitSource, the connector's hit stats):")
    for key, label, _src, _engine in paths:
        seen = sorted(
            {
                ", ".join(
                    f"{k} {v}"
                    for k, v in run["paths"][key].get("hits_by_source", {}).items()
                )
                or "none"
                for run in runs
                if key in run["paths"]
            }
        )
        print(f"  {label}: {' / '.join(seen)}")
    keys = [k for k in loads if any(k in run["paths"] for run in runs)]
    if not keys:
        return
    print()
    print(
        "| reload phase (ms, median over rounds) | "
        + " | ".join(dict((p[0], p[1]) for p in paths)[k] for k in keys)
        + " |"
    )
    print("|---|" + "---|" * len(keys))

    def row(label: str, value, fmt: str = ".1f") -> None:
        """One line: per path, the median over rounds of ``value(run's
        result)`` (None: not measured); left out where nothing was."""
        cells = []
        for key in keys:
            seen = [value(run["paths"][key]) for run in runs if key in run["paths"]]
            seen = [x for x in seen if x is not None]
            cells.append(f"{statistics.median(seen):{fmt}}" if seen else "-")
        if any(c != "-" for c in cells):
            print(f"| {label} | " + " | ".join(cells) + " |")

    def ms(x):
        return None if x is None else 1e3 * x

    for event, label in EVENTS[1:]:
        row(label, lambda res, e=event: ms(phases(res).get(e)))
    row(
        "(host->device copy itself, worker thread)",
        lambda res: ms(res.get("h2d_copy_s", 0.0)),
    )
    for field, label, fmt in READ_USAGE:
        row(f"({label})", lambda res, f=field: read_usage(res).get(f), fmt)
    row("(engine steps, arrival to the last token)", lambda r: r.get("steps", 0), ".0f")
    row("TTFT (front end)", lambda res: ms(res["ttft_s"]))


# Where the load thread's read went (first value to last checked), per run.
READ_USAGE = [
    ("cpu_ms", "read: the load thread on a core", ".1f"),
    ("runq_ms", "read: the load thread runnable, waiting for a core", ".1f"),
    ("blocked_ms", "read: the load thread blocked (socket or GIL)", ".1f"),
    ("others_ms", "read: the engine's other threads on a core", ".1f"),
    ("server_ms", "read: the pool server on a core", ".1f"),
    ("minflt", "read: the load thread's minor page faults (count)", ".0f"),
]


def read_usage(res: dict) -> dict[str, float]:
    """The read's span split by where the load thread was (on a core,
    waiting for one, blocked), and what else ran meanwhile (ms)."""
    u, ev = res.get("read_usage") or {}, res.get("events") or {}
    if "cpu_s" not in u or "read_done" not in ev or "runq_s" not in u:
        return {}
    span = ev["read_done"] - ev["first_value"]
    out = {
        "cpu_ms": 1e3 * u["cpu_s"],
        "runq_ms": 1e3 * u["runq_s"],
        "blocked_ms": 1e3 * (span - u["cpu_s"] - u["runq_s"]),
        "others_ms": 1e3 * (u["process_cpu_s"] - u["cpu_s"]),
        "minflt": u["minflt"],
    }
    if "server_cpu_s" in u:
        out["server_ms"] = 1e3 * u["server_cpu_s"]
    return out


def phases(res: dict) -> dict[str, float]:
    """Seconds of each phase of a run, by the event that ends it."""
    seen = res.get("events") or {}
    out, last = {}, None
    for event, _label in EVENTS:
        if event in seen:
            if last is not None:
                out[event] = seen[event] - seen[last]
            last = event
    return out
