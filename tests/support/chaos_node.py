"""One chaos-test node: a vLLM engine (CPU build, tiny model, engine core
in this process) driven by JSON lines on stdin; results go as JSON lines
to the file descriptor ``result_fd`` (vLLM's own logs stay on
stdout/stderr).

    python chaos_node.py '{"name": "a", "url": "redis://...", "result_fd": 5}'

Config: ``name``, ``url`` (null: stock vLLM, no connector), ``pool``
(extra connector options: ``namespace``, ``secret_file``, timeouts),
``num_blocks``, ``result_fd``, ``logprobs`` (top-2 logprobs, to report
the margin between the greedy token and the runner-up).

Commands: ``{"op": "submit", "id", "prompt", "max_tokens"}``;
``{"op": "stats", "tag"}`` (both pools' totals and the pool threads);
``{"op": "drain", "tag", "timeout_s"}`` (wait until the worker's queued
stores and loads are done); ``{"op": "finish", "timeout_s"}`` (finish
every request, let the connector report its last stores, then report
the block pool, the scheduler, the pool threads and the totals, and exit).
Replies: ``ready``, ``done`` (per request: tokens, TTFT, cached tokens),
``stats``, ``drained``, ``final``.
"""

from __future__ import annotations

import json
import os
import queue
import sys
import threading
import time
import traceback

POOL_THREAD_PREFIX = "vllm-overlay-pool-"


class Node:
    def __init__(self, config: dict) -> None:
        self.config = config
        self.trace = None
        self.out_fd = config["result_fd"]
        self.commands: queue.Queue = queue.Queue()
        self.thread_errors: list[dict] = []
        self.refusals: dict[str, int] = {}
        self.loads: dict[str, int] = {}  # request id -> loads started
        self.pending: dict[str, dict] = {}  # request id -> its record
        self.errors: list[str] = []  # what a command found wrong (final)
        self._install_excepthook()

    # -- output ----------------------------------------------------------
    def emit(self, kind: str, **fields) -> None:
        line = json.dumps({"kind": kind, **fields}) + "\n"
        os.write(self.out_fd, line.encode())

    def _install_excepthook(self) -> None:
        """Record any exception that ends a thread (a pool thread that
        dies is a failure the final report names)."""
        previous = threading.excepthook

        def hook(args) -> None:
            self.thread_errors.append(
                {
                    "thread": args.thread.name if args.thread else None,
                    "error": "".join(
                        traceback.format_exception(
                            args.exc_type, args.exc_value, args.exc_traceback
                        )
                    )[-3000:],
                }
            )
            previous(args)

        threading.excepthook = hook

    # -- engine ------------------------------------------------------------
    def start(self) -> None:
        from vllm_overlay.testing import (
            cpu_defaults,
            in_process_engine,
            tiny_engine_args,
        )
        from vllm_overlay.testing.v0_11_2 import pool_connector

        cpu_defaults()
        in_process_engine(rpc=False)
        from vllm import LLM

        kv = None
        if self.config.get("url"):
            kv = pool_connector(self.config["url"], **self.config.get("pool", {}))
        self.llm = LLM(
            **tiny_engine_args(
                num_gpu_blocks_override=self.config.get("num_blocks", 64),
                kv_transfer_config=kv,
            )
        )
        self.engine = self.llm.llm_engine
        self.scheduler = self.engine.engine_core.engine_core.scheduler
        self.connector = self.scheduler.connector if kv is not None else None
        self.worker_connector = None
        if kv is not None:
            from vllm.distributed.kv_transfer import get_kv_transfer_group

            # The uniprocess executor: the worker's connector is this
            # process's transfer group.
            self.worker_connector = get_kv_transfer_group()
            self._count_refusals()
            self._count_loads()
        self.trace = None
        if os.environ.get("CHAOS_TRACE_KV") == "1" and kv is not None:
            from chaos_trace import KVTrace

            self.trace = KVTrace(self.scheduler, self.worker_connector)

    def _count_refusals(self) -> None:
        """Count the worker's refusals by reason (its log is rate-limited)."""
        worker = getattr(self.worker_connector, "connector_worker", None)
        log = getattr(worker, "_log_refusal", None)
        if log is None:
            return

        def counted(key, exc, _log=log):
            reason = str(exc).split(" (")[0]
            self.refusals[reason] = self.refusals.get(reason, 0) + 1
            return _log(key, exc)

        worker._log_refusal = counted

    def _count_loads(self) -> None:
        """Count the loads the worker starts for each request (a request
        that loads its prefix again and again is a retry loop)."""
        connector = self.worker_connector
        start = connector.start_load_kv

        def counted(forward_context, **kwargs):
            for req_id in connector._get_connector_metadata().loads:
                self.loads[req_id] = self.loads.get(req_id, 0) + 1
            return start(forward_context, **kwargs)

        connector.start_load_kv = counted

    def params(self, max_tokens: int):
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        return SamplingParams(
            temperature=0.0,
            max_tokens=max_tokens,
            ignore_eos=True,
            logprobs=2 if self.config.get("logprobs") else None,
            output_kind=RequestOutputKind.DELTA,
        )

    def submit(self, cmd: dict) -> None:
        self.pending[cmd["id"]] = {
            "id": cmd["id"],
            "tokens": [],
            "margin": None,
            "margins": [],  # per generated token (with logprobs)
            "t0": time.perf_counter(),
            "ttft": None,
        }
        self.engine.add_request(
            cmd["id"], cmd["prompt"], self.params(cmd["max_tokens"])
        )

    def step(self) -> None:
        outs = self.engine.step()
        if self.trace is not None:
            self.trace.after_step()
        now = time.perf_counter()
        for out in outs:
            rec = self.pending.get(out.request_id)
            if rec is None:
                continue
            completion = out.outputs[0]
            if completion.token_ids and rec["ttft"] is None:
                rec["ttft"] = now - rec["t0"]
            rec["tokens"].extend(completion.token_ids)
            for lp in completion.logprobs or ():
                top = sorted((v.logprob for v in lp.values()), reverse=True)
                m = top[0] - top[1] if len(top) > 1 else None
                rec["margins"].append(m)
                if m is not None:
                    old = rec["margin"]
                    rec["margin"] = m if old is None else min(old, m)
            if out.finished:
                del self.pending[out.request_id]
                self.emit(
                    "done",
                    id=rec["id"],
                    tokens=rec["tokens"],
                    ttft=rec["ttft"],
                    e2e=now - rec["t0"],
                    prompt_tokens=len(out.prompt_token_ids or ()),
                    cached_tokens=out.num_cached_tokens or 0,
                    margin=rec["margin"],
                    margins=rec["margins"],
                )

    # -- pool --------------------------------------------------------------
    def pools(self) -> dict:
        if self.connector is None:
            return {}
        return {"scheduler": self.connector.pool, "worker": self.worker_connector.pool}

    def pool_threads(self) -> dict:
        """Pool thread name -> alive, per pool (``KVPool.threads_alive``
        where the pool has it), and every live pool thread of the process."""
        out: dict = {
            "process": sorted(
                t.name
                for t in threading.enumerate()
                if t.name.startswith(POOL_THREAD_PREFIX)
            )
        }
        for role, pool in self.pools().items():
            alive = getattr(pool, "threads_alive", None)
            if alive is not None:
                out[role] = dict(alive())
            else:  # before KVPool.threads_alive: its own thread list
                out[role] = {
                    t.name: t.is_alive() for t in getattr(pool, "_threads", ())
                }
        return out

    def totals(self) -> dict:
        return {role: pool.cumulative() for role, pool in self.pools().items()}

    def state(self) -> dict:
        return {
            role: pool.state()
            for role, pool in self.pools().items()
            if hasattr(pool, "state")
        }

    # -- loop --------------------------------------------------------------
    def read_commands(self) -> None:
        for line in sys.stdin:
            if line.strip():
                self.commands.put(json.loads(line))
        self.commands.put({"op": "finish", "timeout_s": 30.0, "eof": True})

    def run(self) -> None:
        threading.Thread(
            target=self.read_commands, name="chaos-commands", daemon=True
        ).start()
        self.start()
        self.emit("ready", pid=os.getpid())
        while True:
            busy = self.busy()
            try:
                cmd = self.commands.get(block=not busy, timeout=None if busy else 0.05)
            except queue.Empty:
                cmd = None
            if cmd is not None:
                op = cmd["op"]
                if op == "submit":
                    self.submit(cmd)
                elif op == "stats":
                    self.emit("stats", tag=cmd.get("tag"), **self.stats())
                elif op == "drain":
                    ok = self.drain(cmd.get("timeout_s", 5.0))
                    self.emit("drained", tag=cmd.get("tag"), ok=ok)
                elif op == "finish":
                    self.finish(cmd.get("timeout_s", 60.0))
                    return
                else:  # a subclass's command: its reply is named after it
                    self.emit(op, tag=cmd.get("tag"), **self.command(cmd))
                continue
            if busy:
                self.step()

    def busy(self) -> bool:
        """Whether the engine has a step to run now."""
        return self.engine.has_unfinished_requests()

    def stats(self) -> dict:
        return dict(
            totals=self.totals(),
            threads=self.pool_threads(),
            state=self.state(),
            refusals=dict(self.refusals),
            thread_errors=self.thread_errors,
        )

    def drain(self, timeout_s: float) -> bool:
        """Wait until the worker's queued stores and loads are done."""
        pool = self.pools().get("worker")
        return pool.drain(timeout_s) if pool else True

    def command(self, cmd: dict) -> dict:
        raise ValueError(f"chaos node: unknown command {cmd['op']!r}")

    def finish(self, timeout_s: float) -> None:
        """Finish what runs, then report whether every block came back."""
        deadline = time.monotonic() + timeout_s
        while self.engine.has_unfinished_requests() and time.monotonic() < deadline:
            self.step()
        unfinished = sorted(self.pending)
        free = total = None
        bp = self.scheduler.kv_cache_manager.block_pool
        total = bp.num_gpu_blocks - 1  # the null block is never free
        # A request whose stores are under way holds its blocks until the
        # connector reports it finished sending: short requests (no full
        # block, nothing to store) run the steps that report it.
        settle = time.monotonic() + min(20.0, max(1.0, deadline - time.monotonic()))
        n = 0
        while True:
            self.drain(1.0)
            self.submit({"id": f"settle-{n}", "prompt": "hello", "max_tokens": 2})
            n += 1
            while self.engine.has_unfinished_requests():
                if time.monotonic() > settle:
                    break
                self.step()
            self.drain(1.0)  # what the settle request left to the connector
            free = bp.get_num_free_blocks()
            if free == total or time.monotonic() > settle:
                break
            time.sleep(0.1)
        self.pending.clear()
        self.emit(
            "final",
            unfinished=unfinished,
            free_blocks=free,
            total_blocks=total,
            scheduler_requests=sorted(self.scheduler.requests),
            connector_requests=self._connector_requests(),
            threads=self.pool_threads(),
            state=self.state(),
            totals=self.totals(),
            refusals=dict(self.refusals),
            thread_errors=self.thread_errors,
            loads_per_request=self.loads,
            errors=self.errors,
        )

    def _connector_requests(self) -> dict:
        """Requests the scheduler's connector still tracks (storing, loading)."""
        sched = getattr(self.connector, "connector_scheduler", None)
        out = {}
        for name in ("_storing", "_loading", "_pending", "_requests"):
            table = getattr(sched, name, None)
            if table:
                out[name] = sorted(table)
        return out


def main(node_class=Node, config: str | None = None) -> None:
    node = node_class(json.loads(config if config is not None else sys.argv[1]))
    try:
        node.run()
    except BaseException as exc:  # reported, then the process ends
        node.emit("error", error=repr(exc), traceback=traceback.format_exc()[-6000:])
        raise
    finally:
        # Do not wait on vLLM's shutdown or non-daemon threads: the
        # driver has what it needs.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


if __name__ == "__main__":
    main()
