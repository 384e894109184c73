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
* ``failed_copy``: the overlay's CPU offloading worker fails one copy: a
  load on ``dst`` (a prefix ``src`` computed, promoted from the pool into
  ``dst``'s host memory, whose copy into its KV cache fails: the request
  must recompute, never run on unwritten KV) and a store on ``src`` (the
  chunk is not kept; nothing else changes).

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

    def _failed(self, node: int) -> dict:
        return self.nodes[node].request("fail_copies", wait_s=30.0)["failed"]

    def copy_fault(self, src: int, dst: int) -> dict:
        began = time.monotonic()
        load0, store0 = self._failed(dst)["load"], self._failed(src)["store"]
        # A load on dst: probes (src computes, dst loads) until one of
        # dst's loads met the armed failure.
        self.nodes[dst].request("fail_copies", load=1)
        probes = []
        end = time.monotonic() + self.recovery_s
        while self._failed(dst)["load"] == load0 and time.monotonic() < end:
            probes.append(self.probe(src, dst))
        # A store on src: a fresh prefix it computes.
        self.nodes[src].request("fail_copies", store=1)
        while self._failed(src)["store"] == store0 and time.monotonic() < end:
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
        return {
            "began_at": round(began - self.t0, 1),
            "src": self.nodes[src].name,
            "dst": self.nodes[dst].name,
            "failed_loads": self._failed(dst)["load"] - load0,
            "failed_stores": self._failed(src)["store"] - store0,
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
                        f"{where}: no {kind[:-1]} copy met the injected "
                        f"failure within {episode.recovery_s:.0f} s (probes "
                        f"{fault['load_probes']}): the fault was not injected"
                    )
    return out
