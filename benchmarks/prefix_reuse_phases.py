"""Where a reload's time goes, on vLLM 0.32 (``prefix_reuse_v032.py``'s
per-phase attribution): timestamps taken in the engine's process by
wrappers set on the pool tier's and the offloading worker's instances
(nothing in vLLM or the tier changes), and the tables printed from them."""

from __future__ import annotations

import time

from prefix_reuse_report import median_cells

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

    def __init__(self, tier, worker, scheduler) -> None:
        self.t: dict[str, float] = {}
        self.h2d_s = 0.0
        self.steps = 0
        self._load_jobs: set[int] = set()
        self._wrap(scheduler, "schedule", self._step)
        if tier is not None:
            self._wrap(tier, "lookup", self._lookup)
            self._wrap(tier, "submit_load", self._first("tier_submit"))
            self._wrap(tier, "_into", self._first("first_value"))
            self._wrap(tier, "_verdicts", self._last("read_done"))
            self._wrap(tier, "get_finished_jobs", self._finished)
        if worker is not None:
            self._wrap(worker, "submit_load", self._h2d_submit)
            self._wrap(worker, "get_finished", self._h2d_done)

    def reset(self) -> None:
        self.t = {}
        self.h2d_s = 0.0
        self.steps = 0

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

    def _last(self, event: str):
        return lambda out, *args: self.t.__setitem__(event, time.monotonic())

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
        """One line, left out where nothing was measured."""
        cells = median_cells(keys, runs, value, fmt)
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
    row("(engine steps, arrival to the last token)", lambda r: r.get("steps", 0), ".0f")
    row("TTFT (front end)", lambda res: ms(res["ttft_s"]))


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
