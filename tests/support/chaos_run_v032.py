"""A chaos episode on vLLM 0.32 (nodes: chaos_node_v032.py): chaos_run.py's
traffic, server and value faults and pool-resumes checks, plus two faults
of the node itself:

* ``reset_cache``: with the server's writes paused (``CLIENT PAUSE
  WRITE``, so a cascade stays under way), node ``src`` computes a fresh
  prefix and, as soon as its tiering manager has a job of the pool tier
  under way, ``reset_prefix_cache(reset_connector=True)``: what a weight
  update or ``pause_generation(clear_cache=True)`` does while stores
  cascade.  Upstream's tiering manager asks each tier to drain its jobs,
  then asserts that none is left; the reset must return, the host tier
  empty.
* ``failed_copy``: the overlay's CPU offloading worker fails one transfer
  (every attempt at its copies: the worker redoes one that raised, so one
  failed attempt alone is not a failure): a load on ``dst`` (a prefix
  ``src`` computed, promoted from the pool into ``dst``'s host memory,
  whose copy into its KV cache fails: the request must recompute, never
  run on unwritten KV) and a store on ``src`` (the chunk is not kept;
  nothing else changes).  The worker's own count of the jobs it gave up
  shows each failure happened.

* ``slow_reset``: node ``a`` resets (its host tier then hands chunks out
  from the first again), its link to the pool becomes slow and healthy
  (``SLOW_RATE``, through the cluster's proxy: each store well inside the
  pool's deadlines, the backlog not), it computes fresh prefixes whose
  cascades queue behind the link, and it resets
  (``reset_prefix_cache(reset_connector=True)``) while they are slow: the
  tier's drain gives the stores up.  Right after, ``a`` computes at once
  as many fresh prefixes as rewrite every host chunk those stores read
  (upstream reuses them from the first), then its link is fast again and
  node ``b`` asks for the prefixes whose stores were given up: misses or
  the right bytes (stock's tokens), never another prompt's.  (With the
  drain's stop of given-up stores undone, ``KVPool.cancel_stores`` a
  no-op, b loaded other prompts' KV under those keys: checked.)
* ``weights_update`` and ``layouts``: chaos_identity_v032.py.

Each is followed, as every fault, by the check that the pool serves again
both ways; ``problems_v032`` adds what the node faults must show.
"""

from __future__ import annotations

import time

from support.chaos_faults import KINDS
from support.chaos_identity_v032 import (
    IdentityFaults,
    identity_problems,
    layout_problems,
    weight_problems,
)
from support.chaos_run import Episode

NODE_FAULTS = ("reset_cache", "failed_copy", "weights_update", "slow_reset", "layouts")
WRITES_PAUSED_S = 1.5  # the reset's cascade: its stores wait this long
KINDS_V032 = KINDS + NODE_FAULTS
# slow_reset: 512 KiB/s: a 256 KiB chunk passes in 0.5 s (each wait for a
# reply within timeout_s, 1 s), a request's cascade (up to 4 chunks) in 2 s
# (node a's io_timeout_s: 5 s).  Fresh prefixes of 3 chunks are computed
# until SLOW_JOBS cascades are under way (12 s of stores at that rate), past
# the drain's 8 s, at most SLOW_FAMILIES of them.
SLOW_RATE = 512 << 10
SLOW_JOBS = 8
SLOW_FAMILIES = 12
SLOW_AFTER_S = 2.0  # traffic on the slow link after the reset
REUSE_MAX = 16  # fresh prefixes (3 chunks each) that rewrite the host chunks


class Episode032(IdentityFaults, Episode):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.versions: dict[str, tuple] = {}  # request id -> its node's weights
        self.ends: dict[int, dict] = {}  # each pool node's stats at the end

    def fault(self, kind: str, duration_s: float, src: int, dst: int) -> dict:
        """The fault, and the requests sent while it ran (``requests``)."""
        before = len(self.sent)
        out = self._fault(kind, duration_s, src, dst)
        out["requests"] = list(self.sent)[before:]
        return out

    def _fault(self, kind: str, duration_s: float, src: int, dst: int) -> dict:
        if kind == "reset_cache":
            return self.reset_fault(src)
        if kind == "failed_copy":
            return self.copy_fault(src, dst)
        if kind == "weights_update":
            return self.weights_fault(src, dst)
        if kind == "slow_reset":
            return self.slow_reset_fault()
        if kind == "layouts":
            if self.cluster.layout_node is None:
                raise ValueError("the layouts fault needs Cluster032(layouts=True)")
            return self.layouts_fault(src, dst)
        return super().fault(kind, duration_s, src, dst)

    def run(self, schedule, tail_s: float = 5.0, min_s: float = 0.0) -> None:
        super().run(schedule, tail_s, min_s)
        self.ends = {j: self.stats(j) for j in range(len(self.nodes))}

    def slow_reset_fault(self) -> dict:
        """Node 0 (behind the proxy) resets while its stores crawl."""
        slow, other, proxy = 0, 1, self.cluster.proxy
        began = time.monotonic()
        first = self.nodes[slow].request("reset", wait_s=90.0)
        proxy.throttle(SLOW_RATE)
        try:
            families, jobs = [], 0
            while jobs < SLOW_JOBS and len(families) < SLOW_FAMILIES:
                families.append(self.workload.fresh_family())
                seed = self.submit(self.workload.member(families[-1], slow, "seed"))
                self.wait(seed)
                jobs = self.stats(slow)["pending"].get("manager_jobs", 0)
            reply = self.nodes[slow].request("reset", wait_s=90.0, after=seed.req.id)
            # Every host chunk the given-up stores read, rewritten at once
            # (upstream hands them out from the first again), the link slow.
            used = reply.get("host_chunks_before") or 0
            reuse = [
                self.submit(
                    self.workload.member(self.workload.fresh_family(), slow, "seed")
                )
                for _ in range(min(REUSE_MAX, used // 3 + 1))
            ]
            for sent in reuse:
                self.wait(sent)
            self.traffic(SLOW_AFTER_S)
        finally:
            proxy.free()
        asked = [
            (self.wait(self.submit(self.workload.member(f, other))) or {}).get(
                "cached_tokens"
            )
            for f in families
        ]
        return {
            "began_at": round(began - self.t0, 1),
            "node": self.nodes[slow].name,
            "rate_kib_s": SLOW_RATE >> 10,
            "reset": reply.get("ok"),
            "error": reply.get("error") or first.get("error"),
            "host_chunks_at_reset": reply.get("host_chunks_before"),
            "reuse_prefixes": len(reuse),
            "reset_took_s": reply.get("took_s"),
            "drain_gave_up": reply.get("drain_gave_up"),
            "jobs_at_reset": jobs,
            "under_way": reply.get("before"),
            "host_chunks_after": reply.get("host_chunks_after"),
            "other_cached_tokens": asked,
            "throttled_kib": proxy.throttled_bytes >> 10,
        }

    def reset_fault(self, node: int) -> dict:
        """Writes paused on the server (a cascade stays under way, its
        stores waiting on it, up to the pool's timeout), a fresh prefix
        computed, and the reset as soon as a cascade is under way."""
        began = time.monotonic()
        with self.injector.client() as c:
            c.execute_command("CLIENT", "PAUSE", int(WRITES_PAUSED_S * 1e3), "WRITE")
        family = self.workload.fresh_family()
        seed = self.submit(self.workload.member(family, node, "seed"))
        reply = self.nodes[node].request("reset", wait_s=60.0, after=seed.req.id)
        self.wait(seed)
        time.sleep(max(0.0, began + WRITES_PAUSED_S + 0.05 - time.monotonic()))
        return {
            "began_at": round(began - self.t0, 1),
            "node": self.nodes[node].name,
            "reset_at": round(reply["at"] - began, 2),
            "reset": reply.get("ok"),
            "error": reply.get("error"),
            "under_way": reply.get("before"),
            "host_chunks_after": reply.get("host_chunks_after"),
        }

    def _copies(self, node: int) -> dict:
        return self.nodes[node].request("fail_copies", wait_s=30.0)

    def copy_fault(self, src: int, dst: int) -> dict:
        began = time.monotonic()
        on_dst, on_src = self._copies(dst), self._copies(src)
        tries = on_dst["tries"]  # attempts of one job: all fail, it fails
        load0, store0 = on_dst["failed"]["load"], on_src["failed"]["store"]
        lost0 = on_dst["gave_up"]["load"], on_src["gave_up"]["store"]
        # A load on dst: probes (src computes, dst loads) until one of
        # dst's load jobs met every armed attempt.
        self.nodes[dst].request("fail_copies", load=tries)
        probes = []
        end = time.monotonic() + self.recovery_s
        while (
            self._copies(dst)["failed"]["load"] < load0 + tries
            and time.monotonic() < end
        ):
            probes.append(self.probe(src, dst))
        # A store on src: a fresh prefix it computes.
        self.nodes[src].request("fail_copies", store=tries)
        while (
            self._copies(src)["failed"]["store"] < store0 + tries
            and time.monotonic() < end
        ):
            family = self.workload.fresh_family()
            self.wait(self.submit(self.workload.member(family, src, "seed")))
            self.nodes[src].request("drain", wait_s=30.0, timeout_s=10.0)
        # Whatever was not met is disarmed (the stats reply counts both).
        left = {
            "load": self.nodes[dst].request("stats")["copies"]["armed"]["load"],
            "store": self.nodes[src].request("stats")["copies"]["armed"]["store"],
        }
        for node, kind in ((dst, "load"), (src, "store")):
            if left[kind]:
                self.nodes[node].request("fail_copies", **{kind: -left[kind]})
        on_dst, on_src = self._copies(dst), self._copies(src)
        return {
            "began_at": round(began - self.t0, 1),
            "src": self.nodes[src].name,
            "dst": self.nodes[dst].name,
            "tries": tries,
            "failed_load_attempts": on_dst["failed"]["load"] - load0,
            "failed_store_attempts": on_src["failed"]["store"] - store0,
            # Jobs the worker gave up (after all its attempts): a real failure.
            "failed_loads": on_dst["gave_up"]["load"] - lost0[0],
            "failed_stores": on_src["gave_up"]["store"] - lost0[1],
            "load_probes": probes,
        }


def problems_v032(episode: Episode032) -> list[str]:
    """What the node faults must show (chaos_report.problems: the rest)."""
    out = []
    if episode.ends:
        out += weight_problems(episode.cluster, episode.ends)
        out += layout_problems(episode.cluster, episode.ends)
    for fault in episode.faults:
        where = f"fault {fault['kind']} at {fault['began_at']} s"
        out += identity_problems(fault, episode.recovery_s)
        if fault["kind"] == "slow_reset":
            if fault["error"] or not fault["reset"]:
                out.append(
                    f"{where}: reset_prefix_cache(reset_connector=True) on node "
                    f"{fault['node']} returned {fault['reset']}, raised "
                    f"{fault['error']} (under way before: {fault['under_way']})"
                )
            if not fault["drain_gave_up"]:
                out.append(
                    f"{where}: the drain did not give a store up (reset took "
                    f"{fault['reset_took_s']} s, under way before: "
                    f"{fault['under_way']}): the fault was not injected"
                )
        if fault["kind"] == "reset_cache" and "manager_jobs" not in (
            fault["under_way"] or {}
        ):
            out.append(
                f"{where}: no cascade was under way when node {fault['node']} "
                f"reset (under way: {fault['under_way']}): the fault was not "
                "injected"
            )
        if fault["kind"] == "reset_cache" and fault["error"]:
            out.append(
                f"{where}: reset_prefix_cache(reset_connector=True) on node "
                f"{fault['node']} raised {fault['error']} (under way before: "
                f"{fault['under_way']})"
            )
        if fault["kind"] == "failed_copy":
            for kind in ("loads", "stores"):
                if fault[f"failed_{kind}"] < 1:
                    out.append(
                        f"{where}: no {kind[:-1]} job failed (the worker gave "
                        f"none up; attempts failed: "
                        f"{fault[f'failed_{kind[:-1]}_attempts']} of "
                        f"{fault['tries']} armed) within "
                        f"{episode.recovery_s:.0f} s (probes "
                        f"{fault['load_probes']}): the fault was not injected"
                    )
    return out
