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

Each is followed, as every fault, by the check that the pool serves again
both ways; ``problems_v032`` adds what the node faults must show.
"""

from __future__ import annotations

import time

from support.chaos_faults import KINDS
from support.chaos_run import Episode

NODE_FAULTS = ("reset_cache", "failed_copy")
WRITES_PAUSED_S = 1.5  # the reset's cascade: its stores wait this long
KINDS_V032 = KINDS + NODE_FAULTS


class Episode032(Episode):
    def fault(self, kind: str, duration_s: float, src: int, dst: int) -> dict:
        if kind == "reset_cache":
            return self.reset_fault(src)
        if kind == "failed_copy":
            return self.copy_fault(src, dst)
        return super().fault(kind, duration_s, src, dst)

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
    for fault in episode.faults:
        where = f"fault {fault['kind']} at {fault['began_at']} s"
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
