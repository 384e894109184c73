"""The 0.32 chaos faults of the pool's identity (issue 39): what an engine
is, as the namespace names it, changes or differs on one pool.

* ``weights_update``: an RL loop's update under load.  At a quiesced point
  (no request in flight, stores landed) node ``src`` updates its weights in
  place (``load_weights`` on the token embeddings) and resets its caches
  (``reset_prefix_cache(reset_connector=True)``), and traffic resumes: for
  a while the two nodes run other weights, each request's reference is
  stock with its node's weights, and a fresh prefix computed by either
  node is loaded by the other not at all.  Then, quiesced again, ``dst``
  (and the layout node) take the same update; the pool-resumes check that
  follows every fault shows they share again.  After its update a node
  never asks the pool for a key of a namespace that was in the pool before
  it (``weight_problems``: the server's keys, read at the update, against
  the key names the node's tier asks for, counted in the node).
* ``layouts``: node ``c`` runs another KV cache layout (cross-layer
  ``BLHNC``; ``a`` and ``b`` the per-layer default) on the same pool.  A
  prefix computed by ``src`` is asked of ``c``, one computed by ``c`` is
  asked of ``dst``: neither loads a block; ``c``, its caches reset, loads
  its own prefix back from the pool.  Their namespaces differ (the factors
  that differ are reported), and over the whole run no node asks for a key
  of the other kind's namespaces (``layout_problems``).

Why not another attention backend: on vLLM 0.32's CPU platform every
backend asked for (``attention_backend="FLEX_ATTENTION"`` too) is answered
with CPU_ATTN (``CpuPlatform.get_attn_backend_cls``: "Cannot use ... on
CPU"), and this host's CPU_ATTN kernels (vec, vec16; no AMX) write
identical pages, so they share by design.  The cross-layer layout is the
other layout of KV bytes that runs here.

``stock_tokens_v032``: the stock node computes each request with its
node's weights at the time (grouped by weights, in update order).
"""

from __future__ import annotations

import time

from support.chaos_report import stock_results
from support.chaos_workload import BLOCK_TOKENS

SPLIT_S = 3.0  # traffic while only src has the new weights
FIRST_SEED = 3900  # an update's noise seed: this plus the node updates before it


class IdentityFaults:
    """Mixed into ``Episode032`` (``self.cluster`` a ``Cluster032``)."""

    def submit(self, req):
        sent = super().submit(req)
        self.versions[req.id] = self.cluster.weights[req.node]
        return sent

    def pool_namespaces(self) -> set[str]:
        """The namespace parts of every key in the pool now."""
        return {
            k.split(b":")[1].decode()
            for k in self.injector.pool_keys()
            if k.startswith(b"vkv:")
        }

    def update_weights(self, nodes: list[int], seed: int, before: set) -> list[dict]:
        """The update on ``nodes`` (quiesced), each marked for the check;
        ``before``: the pool's namespaces before the first node had the new
        weights (the old weights' namespaces)."""
        out = []
        for j in nodes:
            loaded = self.stats(j).get("loaded_ns", {})
            seeds = [*self.cluster.weights[j], seed]
            reply = self.nodes[j].request("weights", wait_s=120.0, seeds=seeds)
            self.cluster.weights[j] = tuple(reply["seeds"])
            self.cluster.weight_marks.append(
                {
                    "node": j,
                    "at": round(time.monotonic() - self.t0, 1),
                    "old_ns": sorted(before),
                    "loaded_at": loaded,
                }
            )
            out.append(
                {
                    "node": self.nodes[j].name,
                    "seeds": reply["seeds"],
                    "took_s": reply["took_s"],
                    "reset": reply["reset"],
                    "ns": [reply["ns_before"], reply["ns_after"]],
                    "new_ns_was_in_pool": reply["ns_part_after"] in before,
                    "namespaces_in_pool": len(before),
                }
            )
        return out

    def weights_fault(self, src: int, dst: int) -> dict:
        began = time.monotonic()
        seed = FIRST_SEED + len(self.cluster.weight_marks)
        self.quiet()
        old = self.pool_namespaces()
        first = self.update_weights([src], seed, old)
        self._traffic = True
        self.traffic(SPLIT_S)  # other weights side by side
        split = [self.probe(src, dst), self.probe(dst, src)]
        self.quiet()
        rest = [dst] + [j for j in range(2, len(self.nodes))]
        then = self.update_weights(rest, seed, old)
        self._traffic = True
        return {
            "began_at": round(began - self.t0, 1),
            "seed": seed,
            "updates": first + then,
            "split_probes": split,
        }

    def layouts_fault(self, src: int, dst: int) -> dict:
        began = time.monotonic()
        c = self.cluster.layout_node
        ident = {j: self.nodes[j].request("identity") for j in (src, dst, c)}
        theirs = set(ident[src]["factors"])
        # A prefix of the per-layer kind, asked of the cross-layer node.
        to_c = self.probe(src, c)
        # One of the cross-layer node, asked of the other kind, then of
        # itself with its device and host caches emptied (the pool only).
        family = self.workload.fresh_family()
        self.wait(self.submit(self.workload.member(family, c, "seed")))
        self.nodes[c].request("drain", wait_s=30.0, timeout_s=10.0)
        from_c = self.wait(self.submit(self.workload.member(family, dst))) or {}
        own, resets, end = {}, [], time.monotonic() + self.recovery_s
        while (own.get("cached_tokens") or 0) < BLOCK_TOKENS and (
            time.monotonic() < end
        ):
            resets.append(self.nodes[c].request("reset", wait_s=60.0).get("ok"))
            own = self.wait(self.submit(self.workload.member(family, c))) or {}
        return {
            "began_at": round(began - self.t0, 1),
            "ns": {self.nodes[j].name: ident[j]["ns"] for j in ident},
            "ns_parts": {self.nodes[j].name: ident[j]["ns_part"] for j in ident},
            "factors_of_c_not_src": [f for f in ident[c]["factors"] if f not in theirs],
            "to_c_cached": to_c["cached_tokens"],
            "from_c_cached": from_c.get("cached_tokens"),
            "c_resets": resets,
            "c_own_cached": own.get("cached_tokens"),
        }


def stock_tokens_v032(stock, cluster, episodes) -> dict[str, dict]:
    """Every prompt the episodes sent, computed by the stock node with the
    weights its node had when it was sent (the updates in order)."""
    groups: dict[tuple, list] = {}
    for ep in episodes:
        for req_id, sent in ep.sent.items():
            groups.setdefault(ep.versions.get(req_id, ()), []).append(sent)
    out = {}
    for seeds in sorted(groups, key=len):  # each extends the one before
        stock.request("weights", wait_s=120.0, seeds=list(seeds))
        out.update(stock_results(stock, groups[seeds]))
    return out


def weight_problems(cluster, ends: dict[int, dict]) -> list[str]:
    """After its update a node asks the pool for no key of a namespace the
    pool held before it (``ends``: each node's stats at the end)."""
    out = []
    for mark in cluster.weight_marks:
        j = mark["node"]
        now = ends[j].get("loaded_ns", {})
        old = {
            part: n - mark["loaded_at"].get(part, 0)
            for part, n in now.items()
            if part in mark["old_ns"] and n > mark["loaded_at"].get(part, 0)
        }
        if old:
            out.append(
                f"node {cluster.nodes[j].name}: after its weight update at "
                f"{mark['at']} s it asked the pool for keys of namespaces stored "
                f"under the old weights: {old}"
            )
    return out


def layout_problems(cluster, ends: dict[int, dict]) -> list[str]:
    """No node asks for a key of the other layout's namespaces."""
    c = cluster.layout_node
    if c is None:
        return []
    out = []
    kinds = {j: set(ends[j].get("ns_history", ())) for j in ends}
    for j in ends:
        others = [kinds[i] for i in ends if i != c] if j == c else [kinds[c]]
        other = set().union(*others)
        shared = other & kinds[j]
        if shared:
            out.append(
                f"node {cluster.nodes[j].name} had a namespace of the other "
                f"KV layout: {sorted(shared)}"
            )
        asked = {p: n for p, n in ends[j].get("loaded_ns", {}).items() if p in other}
        if asked:
            out.append(
                f"node {cluster.nodes[j].name} asked the pool for keys of the "
                f"other KV layout's namespaces: {asked}"
            )
    return out


def identity_problems(fault: dict, recovery_s: float) -> list[str]:
    """What one ``weights_update`` or ``layouts`` fault must show."""
    where = f"fault {fault['kind']} at {fault['began_at']} s"
    out = []
    if fault["kind"] == "weights_update":
        for u in fault["updates"]:
            if not u["reset"] or u["ns"][0] == u["ns"][1] or u["new_ns_was_in_pool"]:
                out.append(
                    f"{where}: node {u['node']}'s update did not move it to a new "
                    f"namespace (reset {u['reset']}, namespace {u['ns']}, already "
                    f"in the pool: {u['new_ns_was_in_pool']})"
                )
        for p in fault["split_probes"]:
            if p["cached_tokens"]:
                out.append(
                    f"{where}: node {p['dst']} (other weights) loaded "
                    f"{p['cached_tokens']} tokens of a prefix node {p['src']} "
                    "computed"
                )
    if fault["kind"] == "layouts":
        ns = fault["ns_parts"]
        if ns["c"] in (v for k, v in ns.items() if k != "c"):
            out.append(f"{where}: node c's namespace is another layout's: {ns}")
        for key in ("to_c_cached", "from_c_cached"):
            if fault[key]:
                out.append(
                    f"{where}: {fault[key]} tokens loaded across the two KV "
                    f"layouts ({key})"
                )
        if (fault["c_own_cached"] or 0) < BLOCK_TOKENS:
            out.append(
                f"{where}: node c, its caches reset, loaded "
                f"{fault['c_own_cached']} tokens of its own prefix from the "
                f"pool (a block or more expected within {recovery_s:.0f} s)"
            )
    return out
