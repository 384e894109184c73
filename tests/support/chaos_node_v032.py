"""One chaos-test node on vLLM 0.32: chaos_node.py's node (commands,
replies, the final report) with 0.32's engine.  With a pool ``url`` it runs
upstream's ``OffloadingConnector`` with ``TieringOffloadingSpec``: host
memory (the primary tier, ``cpu_bytes`` of it) and the overlay's
``SharedPoolTier`` (the pool, ``pool``: its options) as the secondary tier,
and ``kv_load_failure_policy="recompute"`` (a failed load recomputes its
request); without one, stock vLLM 0.32 (the driver sets
``VLLM_OVERLAY_DISABLE=1``).

    python chaos_node_v032.py '{"name": "a", "url": "redis://...", "result_fd": 5}'

Its pool is the tier's one ``KVPool`` (role ``tier``).  ``drain`` steps the
engine until the connector has no transfer left (on 0.32 a chunk reaches
the pool only through the scheduler: host memory first, then the cascade).
Commands of its own (each replies with its name):

* ``{"op": "reset", "tag", "after"}``:
  ``reset_prefix_cache(reset_connector=True)`` between two steps, as a
  weight update or ``pause_generation`` would (with ``after``: once a job
  of the tier is under way); replies what was under way before and what
  the host tier holds after.
  An exception is a failure of the node (its final report lists it).
* ``{"op": "fail_copies", "tag", "store": n, "load": n}``: the next ``n``
  copy attempts of that direction by the overlay's CPU offloading worker
  raise (``CopyFaults``); replies the attempts failed so far, the attempts
  of one job (``tries``: the worker redoes a transfer that raised) and the
  jobs the worker gave up (``gave_up``, its own count).
* ``{"op": "weights", "tag", "seeds": [...]}``: the weights become the
  start-up weights plus, in order, each seed's noise on the token
  embeddings, through the model's ``load_weights`` (``LLM.apply_model``,
  as an RL loop updates a serving engine; only the seeds not applied yet,
  or from the start-up weights again), then
  ``reset_prefix_cache(reset_connector=True)``; replies the tier's
  namespace before and after.  The stock node takes it too (its reference
  for requests of those weights).
* ``{"op": "identity", "tag"}``: the tier's namespace and its factors.

Stats add the tier's namespace (``ns``; ``ns_part``: its part of the pool's
key names, ``ns_history``: every one it had), the key names it asked the
pool for, counted by namespace part (``loaded_ns``), and how often a drain
gave stores up (``drains_given_up``: ``KVPool.cancel_stores`` called).
"""

from __future__ import annotations

import functools
import sys
import threading
import time
import traceback

from chaos_node import Node, main
from chaos_weights_v032 import embeddings, perturb, restore

TIER_MODULE = "vllm_overlay.integration.v0_32.pool_tier"
HOST_BYTES = 64 * 2**20  # the primary tier: about 250 chunks of the tiny model
RESET_WAIT_S = 20.0


class CopyFaults:
    """Makes the worker's next copy attempts raise, before they move a byte
    (so a load reported as done would leave its KV blocks unwritten).
    Test-only: wraps ``_move`` (one attempt at a transfer's copies) of this
    engine's ``CPUPlatformOffloadingWorker`` instance, which runs it on its
    transfer thread and redoes a transfer that raised: ``tries`` attempts
    in a row fail one job.  The worker's code is unchanged."""

    def __init__(self, worker) -> None:
        from vllm_overlay.integration.v0_32.offload_worker import TRANSFER_RETRIES

        self.worker = worker
        self.tries = 1 + TRANSFER_RETRIES
        self.armed = {"store": 0, "load": 0}
        self.failed = {"store": 0, "load": 0}
        self._lock = threading.Lock()
        move = worker._move

        def failing(kind, ids, rows):
            with self._lock:
                fail = self.armed[kind] > 0
                if fail:
                    self.armed[kind] -= 1
                    self.failed[kind] += 1
            if fail:
                raise RuntimeError(
                    f"chaos: injected failure of a {kind} copy ({len(ids)} blocks)"
                )
            return move(kind, ids, rows)

        worker._move = failing

    def arm(self, store: int = 0, load: int = 0) -> dict:
        with self._lock:
            self.armed["store"] += store
            self.armed["load"] += load
            return {
                "armed": dict(self.armed),
                "failed": dict(self.failed),
                "tries": self.tries,
                "gave_up": dict(self.worker.failed),
            }


class Node032(Node):
    def start(self) -> None:
        from vllm_overlay.testing import (
            cpu_defaults,
            in_process_engine,
            tiny_engine_args,
        )

        cpu_defaults()
        in_process_engine(rpc=False)
        from vllm import LLM
        from vllm.config import KVTransferConfig

        kv = None
        if self.config.get("url"):
            tier = {
                "type": "SharedPoolTier",
                "module_path": TIER_MODULE,
                "url": self.config["url"],
                **self.config.get("pool", {}),
            }
            kv = KVTransferConfig(
                kv_connector="OffloadingConnector",
                kv_role="kv_both",
                # A load that fails (a failed copy) recomputes its request;
                # upstream's default ends the request with an error.
                kv_load_failure_policy="recompute",
                kv_connector_extra_config={
                    "cpu_bytes_to_use": self.config.get("cpu_bytes", HOST_BYTES),
                    "spec_name": "TieringOffloadingSpec",
                    "secondary_tiers": [tier],
                },
            )
        self.llm = LLM(
            **tiny_engine_args(
                num_gpu_blocks_override=self.config.get("num_blocks", 64),
                kv_transfer_config=kv,
            )
        )
        self.engine = self.llm.llm_engine
        self.scheduler = self.engine.engine_core.engine_core.scheduler
        self.connector = self.scheduler.connector if kv is not None else None
        self.tier = self.copy_faults = None
        if kv is not None:
            from vllm.distributed.kv_transfer import get_kv_transfer_group

            manager = self.connector.connector_scheduler.manager
            (self.tier,) = manager.secondary_tiers
            # The uniprocess executor: the worker's connector is this
            # process's transfer group.
            self.worker_connector = get_kv_transfer_group().connector_worker
            self.copy_faults = CopyFaults(self.worker_connector.worker)
            self._count_refusals()
            self._count_loads()
            self._count_pool()
        self.seeds: list[int] = []  # the weight updates applied, in order
        self._base = None  # the start-up embeddings (once updated)
        self.ns_history: list[str] = []

    def _count_refusals(self) -> None:
        """Count the tier's refusals by reason (its log is rate-limited)."""
        log = self.tier._refusal_log.log

        def counted(level, topic, msg, *args, _log=log, **kw):
            if topic == "refused" and len(args) > 1:
                reason = str(args[1]).split(" (")[0]
                self.refusals[reason] = self.refusals.get(reason, 0) + 1
            return _log(level, topic, msg, *args, **kw)

        self.tier._refusal_log.log = counted

    def _count_pool(self) -> None:
        """Count the key names the tier asks the pool for, by namespace
        part, and the drains that gave stores up."""
        pool = self.tier.pool
        self.loaded_ns: dict[str, int] = {}
        self.drains_given_up = 0
        submit, cancel = pool.submit_load, pool.cancel_stores

        def counted(job_id, names, *args, **kwargs):
            for name in names:
                part = name.split(b":")[1].decode()
                self.loaded_ns[part] = self.loaded_ns.get(part, 0) + 1
            return submit(job_id, names, *args, **kwargs)

        def given_up(*args, **kwargs):
            self.drains_given_up += 1
            return cancel(*args, **kwargs)

        pool.submit_load, pool.cancel_stores = counted, given_up

    def ns_part(self) -> str:
        """The tier's namespace as its key names carry it (keyed by the
        shared secret): ``vkv:<this>:r0:<block>``."""
        part = self.tier._name(bytes(32)).split(b":")[1].decode()
        if part not in self.ns_history:
            self.ns_history.append(part)
        return part

    def identity(self) -> dict:
        if self.tier is None:
            return {"seeds": self.seeds}
        return {
            "seeds": self.seeds,
            "ns": self.tier.ns.hex()[:12],
            "ns_part": self.ns_part(),
            "factors": self.tier._identity_of(self.tier._engine.factors()),
        }

    def _count_loads(self) -> None:
        """Count the host-to-KV-cache loads started for each request (a
        request that loads its prefix again and again is a retry loop)."""
        worker = self.worker_connector
        start = worker.start_kv_transfers

        def counted(metadata, _start=start):
            for job in metadata.load_jobs.values():
                self.loads[job.req_id] = self.loads.get(job.req_id, 0) + 1
            return _start(metadata)

        worker.start_kv_transfers = counted

    # -- pool ----------------------------------------------------------------
    def pools(self) -> dict:
        return {"tier": self.tier.pool} if self.tier is not None else {}

    def under_way(self) -> dict:
        """What the connector still has under way (empty: nothing)."""
        if self.connector is None:
            return {}
        sched = self.connector.connector_scheduler
        manager = sched.manager
        out = {
            "connector_jobs": len(sched._jobs),
            "manager_jobs": len(manager._jobs),
            "tier_pending_work": self.tier.has_pending_work(),
        }
        return {k: v for k, v in out.items() if v}

    def drain(self, timeout_s: float) -> bool:
        """Step until the connector has nothing under way (its stores are
        in host memory and, cascaded, in the pool) and the scheduler has
        no finished request left to clear (the connector forgets one at
        the step after it finished), or ``timeout_s``."""
        if self.connector is None:
            return True
        deadline = time.monotonic() + timeout_s
        while (
            self.connector.has_pending_push_work()
            or self.scheduler.has_finished_requests()
        ):
            if time.monotonic() > deadline:
                return False
            self.step()  # steps with no request too: the scheduler has work
        return True

    def busy(self) -> bool:
        # As 0.32's engine core loop: it steps while the scheduler has work,
        # requests or not (a finished request's stores and their cascade).
        return self.engine.has_unfinished_requests() or self.scheduler.has_requests()

    def step(self) -> None:
        super().step()
        if not self.engine.has_unfinished_requests():
            time.sleep(0.001)  # only the connector's work: its threads run

    def stats(self) -> dict:
        out = super().stats()
        if self.copy_faults is not None:
            out["copies"] = self.copy_faults.arm()
        out["pending"] = self.under_way()
        if self.tier is not None:
            out.update(
                ns=self.tier.ns.hex()[:12],
                ns_part=self.ns_part(),
                ns_history=list(self.ns_history),
                loaded_ns=dict(self.loaded_ns),
                drains_given_up=self.drains_given_up,
            )
        out["seeds"] = self.seeds
        return out

    def _connector_requests(self) -> dict:
        """Requests and jobs the connector, its manager and the tier still
        track."""
        if self.connector is None:
            return {}
        sched = self.connector.connector_scheduler
        out = {
            "req_status": sorted(sched._req_status),
            "manager_requests": sorted(sched.manager._req_state),
        }
        out = {k: v for k, v in out.items() if v}
        out.update(self.under_way())
        return out

    # -- commands ------------------------------------------------------------
    def command(self, cmd: dict) -> dict:
        if cmd["op"] == "reset":
            return self.reset(cmd.get("after"))
        if cmd["op"] == "fail_copies":
            return self.copy_faults.arm(cmd.get("store", 0), cmd.get("load", 0))
        if cmd["op"] == "weights":
            return self.set_weights([int(s) for s in cmd["seeds"]])
        if cmd["op"] == "identity":
            return self.identity()
        return super().command(cmd)

    def set_weights(self, seeds: list[int]) -> dict:
        """Between two steps, no request running (the driver quiesced the
        node): the update, then the reset an RL loop does before it
        resumes."""
        before, start = self.identity(), time.monotonic()
        if self._base is None:
            (self._base,) = self.llm.apply_model(embeddings)
        if seeds[: len(self.seeds)] != self.seeds:
            self.llm.apply_model(functools.partial(restore, base=self._base))
            self.seeds = []
        changed = []
        for seed in seeds[len(self.seeds) :]:
            (changed,) = self.llm.apply_model(functools.partial(perturb, seed=seed))
            self.seeds.append(seed)
        if self.connector is not None:
            ok = self.llm.reset_prefix_cache(reset_connector=True)
        else:
            ok = self.llm.reset_prefix_cache()
        if not ok:
            self.errors.append(
                f"reset_prefix_cache after the weight update to {seeds} returned "
                f"{ok} (a request still running?)"
            )
        after = self.identity()
        return {
            "seeds": self.seeds,
            "changed": changed,
            "reset": ok,
            "took_s": round(time.monotonic() - start, 2),
            "ns_before": before.get("ns"),
            "ns_after": after.get("ns"),
            "ns_part_before": before.get("ns_part"),
            "ns_part_after": after.get("ns_part"),
        }

    def reset(self, after: str | None = None) -> dict:
        """The reset, between two steps; with ``after`` (a request id, sent
        before), once the tiering manager has a job of the tier under way
        (chunks cascading to the pool: that request's, or others'), within
        ``RESET_WAIT_S``."""
        manager = self.connector.connector_scheduler.manager
        deadline = time.monotonic() + RESET_WAIT_S
        while after is not None and time.monotonic() < deadline:
            if manager._jobs:
                break
            if self.busy():
                self.step()
            else:
                time.sleep(0.001)
        before, at = self.under_way(), time.monotonic()
        given_up = self.drains_given_up
        primary = manager.primary_tier
        # Host chunks handed out since the last reset (reused from 0 after it).
        used = getattr(primary, "_num_allocated_chunks", None)
        try:
            ok = self.llm.reset_prefix_cache(reset_connector=True)
        except Exception as exc:  # noqa: BLE001 - reported, the node goes on
            self.errors.append(
                f"reset_prefix_cache(reset_connector=True) raised (under way "
                f"before: {before}):\n{traceback.format_exc()[-3000:]}"
            )
            return {"ok": None, "error": repr(exc), "before": before, "at": at}
        host = getattr(primary, "_num_allocated_chunks", None)
        if host:
            self.errors.append(
                f"reset_prefix_cache(reset_connector=True) returned {ok} but "
                f"the host tier still holds {host} chunk(s)"
            )
        return {
            "ok": ok,
            "before": before,
            "host_chunks_after": host,
            "host_chunks_before": used,
            "at": at,
            "took_s": round(time.monotonic() - at, 2),
            "drain_gave_up": self.drains_given_up - given_up,
        }


if __name__ == "__main__":
    main(Node032, sys.argv[1])
