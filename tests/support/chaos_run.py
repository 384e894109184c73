"""One chaos episode: steady traffic to two pool nodes while faults are
injected, each fault followed by a check that the pool serves again.

The driver (this process) sends the workload's background requests at a
seeded pace (at most ``inflight`` per node at once).  For each fault of the
schedule: traffic for the gap before it; then

* a timed fault (``sigstop``, ``kill``, ``client_pause``, ``maxmemory``):
  begun, traffic meanwhile, ended;
* a value fault (``corrupt_*``): traffic paused; node ``src`` computes a
  fresh prefix (its stores land); those values, and a seeded share of the
  others, are overwritten; node ``dst``, which never saw the prefix, asks
  for it: it must refuse the values (its refusal counters grow) and
  recompute;

then the pool must serve again, in both directions: a fresh prefix
computed by one node is loaded by the other (its ``cached_tokens`` cover a
block or more) within ``recovery_s``.  At the end every request must have
completed within ``request_deadline_s``; the nodes then report their block
pools, pool threads and totals, and the stock node computes every prompt
sent (the reference tokens).  ``problems()`` lists what went wrong.
"""

from __future__ import annotations

import dataclasses
import random
import time

from support.chaos_faults import TIMED, FaultInjector
from support.chaos_workload import BLOCK_TOKENS, Request, Workload

ERROR_COUNTERS = (
    "errors",
    "lookup_timeouts",
    "lookups_skipped",
    "load_failures",
    "bad_signatures",
    "bad_keys",
    "dropped_stores",
    "limited_loads",
    "load_timeouts",
    "stuck",
    "internal_errors",
)


def pool_totals(totals: dict) -> dict:
    """A node's counters summed over its pools (``totals``: role -> the
    pool's ``cumulative()``; 0.11.2's nodes have a scheduler and a worker
    pool, 0.32's one tier pool)."""
    out: dict = {}
    for counters in totals.values():
        for k, v in counters.items():
            out[k] = out.get(k, 0) + v
    return out


@dataclasses.dataclass
class Sent:
    req: Request
    t: float  # monotonic, when sent
    result: dict | None = None
    timed_out: bool = False


class Episode:
    def __init__(
        self,
        cluster,
        workload: Workload,
        injector: FaultInjector | None,
        seed: int = 0,
        rate_per_s: float = 1.5,
        inflight: int = 3,
        request_deadline_s: float = 60.0,
        recovery_s: float = 30.0,
    ) -> None:
        self.cluster = cluster
        self.nodes = cluster.nodes
        self.workload = workload
        self.injector = injector
        self.rng = random.Random(seed)
        self.rate_per_s = rate_per_s
        self.inflight = inflight
        self.request_deadline_s = request_deadline_s
        self.recovery_s = recovery_s
        self.sent: dict[str, Sent] = {}
        self.outstanding: dict[str, Sent] = {}
        self.faults: list[dict] = []
        self.failures: list[str] = []
        self.t0 = time.monotonic()
        self._next_req: Request | None = None
        self._next_at = self.t0
        self._traffic = True

    # -- requests -------------------------------------------------------------
    def submit(self, req: Request) -> Sent:
        sent = Sent(req, time.monotonic())
        self.sent[req.id] = self.outstanding[req.id] = sent
        self.nodes[req.node].send(
            op="submit", id=req.id, prompt=req.prompt, max_tokens=req.max_tokens
        )
        return sent

    def pump(self) -> None:
        """Collect results; a request past its deadline is a failure (it is
        no longer waited for)."""
        now = time.monotonic()
        for req_id, sent in list(self.outstanding.items()):
            result = self.nodes[sent.req.node].done.get(req_id)
            if result is not None:
                sent.result = result
                del self.outstanding[req_id]
            elif now - sent.t > self.request_deadline_s:
                sent.timed_out = True
                del self.outstanding[req_id]
                self.failures.append(
                    f"request {req_id} ({sent.req.kind}) on node "
                    f"{self.nodes[sent.req.node].name} not done within "
                    f"{self.request_deadline_s:.0f} s (sent at "
                    f"{sent.t - self.t0:.1f} s)"
                )

    def _busy(self, node: int) -> int:
        return sum(1 for s in self.outstanding.values() if s.req.node == node)

    def traffic(self, seconds: float) -> None:
        """Background requests for ``seconds`` (none while paused)."""
        end = time.monotonic() + seconds
        while True:
            self.pump()
            now = time.monotonic()
            if now >= end:
                return
            if self._traffic and now >= self._next_at:
                if self._next_req is None:
                    self._next_req = self.workload.background()
                if self._busy(self._next_req.node) < self.inflight:
                    self.submit(self._next_req)
                    self._next_req = None
                    self._next_at = now + self.rng.expovariate(self.rate_per_s)
            time.sleep(0.02)

    def wait(self, sent: Sent) -> dict | None:
        """Traffic goes on until ``sent`` is done (or past its deadline)."""
        while sent.req.id in self.outstanding:
            self.traffic(0.05)
        return sent.result

    def quiet(self, timeout_s: float = 90.0) -> None:
        """Stop sending background requests; wait until none is under way
        and both nodes' stores have landed."""
        self._traffic = False
        end = time.monotonic() + timeout_s
        while self.outstanding and time.monotonic() < end:
            self.traffic(0.05)
        for node in self.nodes:
            node.request("drain", wait_s=30.0, timeout_s=10.0)

    # -- pool checks -----------------------------------------------------------
    def stats(self, node: int) -> dict:
        return self.nodes[node].request("stats", wait_s=30.0)

    def probe(self, src: int, dst: int) -> dict:
        """A fresh prefix computed by ``src``, then asked of ``dst``."""
        family = self.workload.fresh_family()
        seed = self.submit(self.workload.member(family, src, "seed"))
        self.wait(seed)
        self.nodes[src].request("drain", wait_s=30.0, timeout_s=3.0)
        member = self.submit(self.workload.member(family, dst))
        result = self.wait(member) or {}
        return {
            "src": self.nodes[src].name,
            "dst": self.nodes[dst].name,
            "cached_tokens": result.get("cached_tokens"),
            "at": round(time.monotonic() - self.t0, 1),
        }

    def resumes(self) -> dict:
        """Until ``recovery_s``: probes both ways until each direction loads
        a block or more from the pool."""
        start = time.monotonic()
        probes, served = [], set()
        while len(served) < 2 and time.monotonic() - start < self.recovery_s:
            for src, dst in ((0, 1), (1, 0)):
                if (src, dst) in served:
                    continue
                p = self.probe(src, dst)
                probes.append(p)
                if (p["cached_tokens"] or 0) >= BLOCK_TOKENS:
                    served.add((src, dst))
            if len(served) < 2:
                self.traffic(0.5)
        return {
            "resumed": len(served) == 2,
            "resumed_after_s": round(time.monotonic() - start, 1),
            "probes": probes,
        }

    # -- faults ----------------------------------------------------------------
    def timed_fault(self, kind: str, duration_s: float) -> dict:
        began = time.monotonic()
        self.injector.begin(kind, duration_s)
        self.traffic(duration_s)
        self.injector.end(kind)
        return {"began_at": round(began - self.t0, 1), "lasted_s": round(duration_s, 1)}

    def value_fault(self, kind: str, src: int, dst: int) -> dict:
        self.quiet()
        before_keys = self.injector.pool_keys()
        family = self.workload.fresh_family()
        seed = self.submit(self.workload.member(family, src, "seed"))
        self.wait(seed)
        self.nodes[src].request("drain", wait_s=30.0, timeout_s=10.0)
        new = self.injector.pool_keys() - before_keys
        targets = new | self.injector.sample(before_keys, 0.3)
        began = time.monotonic()
        overwritten = self.injector.overwrite(kind, targets, honest=new)
        stats_before = self.stats(dst)
        victim = self.submit(self.workload.member(family, dst, "victim"))
        result = self.wait(victim) or {}
        self.nodes[dst].request("drain", wait_s=30.0, timeout_s=10.0)
        stats_after = self.stats(dst)
        self._traffic = True
        worker = [pool_totals(s["totals"]) for s in (stats_before, stats_after)]
        refusals = {
            reason: n - stats_before["refusals"].get(reason, 0)
            for reason, n in stats_after["refusals"].items()
            if n - stats_before["refusals"].get(reason, 0)
        }
        return {
            "began_at": round(began - self.t0, 1),
            "src": self.nodes[src].name,
            "dst": self.nodes[dst].name,
            "prefix_values": len(new),
            "overwritten": overwritten,
            "victim_cached_tokens": result.get("cached_tokens"),
            "load_failures": worker[1].get("load_failures", 0)
            - worker[0].get("load_failures", 0),
            "bad_signatures": worker[1].get("bad_signatures", 0)
            - worker[0].get("bad_signatures", 0),
            "refusals": refusals,
        }

    def fault(self, kind: str, duration_s: float, src: int, dst: int) -> dict:
        """Inject one fault (a subclass adds kinds); what it did."""
        if kind in TIMED:
            return self.timed_fault(kind, duration_s)
        return self.value_fault(kind, src, dst)

    def run(self, schedule, tail_s: float = 5.0, min_s: float = 0.0) -> None:
        """``schedule``: (gap, kind, duration) per fault; [] for a
        fault-free run.  Traffic goes on for ``tail_s`` after the last
        fault, longer if the episode would last less than ``min_s``."""
        for i, (gap, kind, duration) in enumerate(schedule):
            self.traffic(gap)
            src, dst = (0, 1) if i % 2 == 0 else (1, 0)
            fault = {"kind": kind, **self.fault(kind, duration, src, dst)}
            fault.update(self.resumes())
            fault["threads"] = {
                node.name: self.stats(j)["threads"] for j, node in enumerate(self.nodes)
            }
            self.faults.append(fault)
        self.traffic(max(tail_s, min_s - (time.monotonic() - self.t0)))
        self.quiet(self.request_deadline_s + 30.0)
        self.pump()
