"""The engine side of ``bench_prefix_reuse.py`` (and ``decode_release.py``):
one vLLM engine in a forked child of the driver, driven over two pipes with
JSON lines.  ``EngineServer`` is what both releases' engines share (build,
generate, flush, reset, one measured run); each release's subclass says
how its connector is configured and what its counters are
(``prefix_reuse_v0112.EngineServer`` for 0.11.2,
``prefix_reuse_v032.EngineServer`` for 0.32)."""

from __future__ import annotations

import contextlib
import json
import os
import random
import sys
import time

from vllm_overlay.testing.forked import fork_child, log_tail

FLUSH_PROMPT = [5]  # one token: a step that completes pending stores


def prompt_ids(seed: int, n: int, vocab: int) -> list[int]:
    """n random token ids (special tokens 0-2 left out), one prompt per seed."""
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(n)]


# -- engine side (a forked child) ---------------------------------------------
class EngineServer:
    """One engine, in-process (no engine-core process: the driver's calls
    reach the scheduler and worker directly).  Subclasses give
    ``before_engine`` (set-up that must precede the engine; returns its
    ``kv_transfer_config``), ``after_engine``, ``_counters``, ``describe``
    and, where a run records more, ``before_run``/``after_run``."""

    def __init__(self, spec: dict) -> None:
        from vllm_overlay.testing import in_process_engine

        in_process_engine()  # worker in this process; collective_rpc allowed
        os.environ.update(spec.get("env") or {})

        import torch
        import vllm.logger  # noqa: F401  (configures vLLM's loggers first)

        from vllm_overlay.testing.observe import enable_request_metrics

        torch.set_num_threads(spec["threads"])
        if spec.get("switch_interval_ms"):  # the GIL's (a diagnostic)
            sys.setswitchinterval(spec["switch_interval_ms"] / 1e3)
        self.spec = spec
        self.load_usage = None
        if spec.get("url") and spec.get("connector") in ("pool", "tier"):
            from prefix_reuse_usage import LoadUsage

            self.load_usage = LoadUsage(spec.get("server_pid"))
        kv = self.before_engine()

        from vllm import LLM

        started = time.perf_counter()
        self.llm = LLM(
            model=spec["model"],
            dtype="float32",
            max_model_len=spec["max_model_len"],
            num_gpu_blocks_override=spec["num_blocks"],
            enforce_eager=True,
            seed=0,
            kv_transfer_config=kv,
        )
        self.engine_s = time.perf_counter() - started
        if not enable_request_metrics(self.llm):
            raise RuntimeError("vLLM's request metrics could not be enabled")
        self.scheduler = self.llm.llm_engine.engine_core.engine_core.scheduler
        self.block_size = self.llm.llm_engine.vllm_config.cache_config.block_size
        self.after_engine()

    # -- what a release's subclass gives ---------------------------------
    def before_engine(self):
        return None

    def after_engine(self) -> None:
        pass

    def _counters(self) -> dict:
        return {}

    def before_run(self) -> None:
        pass

    def after_run(self, res: dict, metrics) -> None:
        pass

    def _reset_prefix_cache(self) -> bool:
        return bool(self.llm.reset_prefix_cache())

    def describe(self) -> dict:
        raise NotImplementedError

    # -- shared --------------------------------------------------------------
    def _generate(self, ids: list[int], max_tokens: int):
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        return self.llm.generate(
            [TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False
        )[0]

    def flush(self) -> dict:
        """One more step completes the finished requests' stores and frees
        their blocks (cascades to a tier, drains the pool's write queue)."""
        self._generate(FLUSH_PROMPT, 1)
        return self._counters()

    def reset(self) -> bool:
        """Empty the device prefix cache, stepping while blocks are held."""
        for _ in range(5):
            if self._reset_prefix_cache():
                return True
            self._generate(FLUSH_PROMPT, 1)
        return False

    def run(self, cmd: dict) -> dict:
        ids = prompt_ids(cmd["seed"], cmd["n"], cmd["vocab"])
        reset_ok = None
        if cmd.get("flush"):
            self.flush()
        if cmd.get("reset"):
            reset_ok = self.reset()
        before = self._counters()
        if self.load_usage is not None:
            self.load_usage.take()  # what came before this run
        self.before_run()
        t0 = time.perf_counter()
        out = self._generate(ids, cmd["max_tokens"])
        wall = time.perf_counter() - t0
        after = self._counters()
        m = out.metrics
        n_gen = m.num_generation_tokens
        decode_s = m.last_token_ts - m.first_token_ts
        res = {
            "tokens": list(out.outputs[0].token_ids),
            "prompt_tokens": len(out.prompt_token_ids),
            "cached_tokens": out.num_cached_tokens or 0,
            "ttft_s": m.first_token_latency,
            "generation_tokens": n_gen,
            "decode_s": decode_s,
            "decode_tok_s": (n_gen - 1) / decode_s if decode_s > 0 else None,
            "wall_s": wall,
            "reset_ok": reset_ok,
            "moved": {k: after[k] - before.get(k, 0) for k in after},
        }
        if self.load_usage is not None:
            res["read_usage"] = self.load_usage.take()
        self.after_run(res, m)
        return res

    def handle(self, op: str, cmd: dict):
        if op == "run":
            return self.run(cmd)
        if op == "flush":
            return self.flush()
        if op == "describe":
            return self.describe()
        raise ValueError(f"unknown op {op!r}")


def serve(server, rfile, wfile) -> None:
    """Answer the driver's JSON-line commands with ``server.handle(op, cmd)``
    until "quit" (or the pipe closes); an error is a reply, not an exit."""
    for line in rfile:
        cmd = json.loads(line)
        op = cmd["op"]
        if op == "quit":
            return
        try:
            reply = {"ok": True, "result": server.handle(op, cmd)}
        except Exception as exc:  # noqa: BLE001 - reported to the driver
            import traceback

            traceback.print_exc()
            reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        wfile.write(json.dumps(reply) + "\n")
        wfile.flush()


# -- driver side ---------------------------------------------------------------
class Engine:
    """An engine in a forked child of this process, driven over two pipes
    (JSON lines); its stdout/stderr go to a log file.  ``server`` builds
    the child's side from ``spec`` (an object with ``handle(op, cmd)``)."""

    def __init__(self, name: str, spec: dict, workdir: str, server) -> None:
        self.name = name
        self.log_path = os.path.join(workdir, f"{name}.log")
        cmd_r, cmd_w = os.pipe()
        res_r, res_w = os.pipe()

        def child() -> None:
            os.close(cmd_w)
            os.close(res_r)
            with os.fdopen(cmd_r) as rfile, os.fdopen(res_w, "w") as wfile:
                server_ = server(spec)
                wfile.write(json.dumps({"ok": True, "result": "ready"}) + "\n")
                wfile.flush()
                serve(server_, rfile, wfile)

        self.pid = fork_child(child, self.log_path)
        os.close(cmd_r)
        os.close(res_w)
        self.wfile = os.fdopen(cmd_w, "w")
        self.rfile = os.fdopen(res_r)

    def _reply(self):
        line = self.rfile.readline()
        if not line:
            raise RuntimeError(self._failure("exited"))
        reply = json.loads(line)
        if not reply["ok"]:
            raise RuntimeError(self._failure(reply["error"]))
        return reply["result"]

    def _failure(self, what: str) -> str:
        tail = log_tail(self.log_path)
        return f"engine {self.name}: {what} (log {self.log_path}):\n{tail}"

    def wait_ready(self) -> None:
        self._reply()

    def call(self, op: str, **kwargs):
        self.wfile.write(json.dumps({"op": op, **kwargs}) + "\n")
        self.wfile.flush()
        return self._reply()

    def stop(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            self.wfile.write(json.dumps({"op": "quit"}) + "\n")
            self.wfile.flush()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            pid, _ = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                return
            time.sleep(0.05)
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, 9)
        os.waitpid(self.pid, 0)


def check_layouts(engines: dict, info: dict, got) -> list[str]:
    """Each engine that names a layout has it; ``got(info)``: what an
    engine's description says it has (for the message)."""
    out = []
    for name, spec in engines.items():
        if name not in info or "layout" not in spec:
            continue
        want = spec["layout"] == "cross-layer"
        if info[name].get("cross_layer") is not want:
            out.append(
                f"engine {name}: expected the {spec['layout']} KV layout, "
                f"got {got(info[name])}"
            )
    return out
