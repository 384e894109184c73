"""One vLLM engine of the demo (``vllm_overlay.demo``): the copy model, an
overlay KV connector, a few passes over the copy prompts, and what happened.

The demo builds one ``Node`` in its own process (the host-offload engine)
and the others in forked children (the pool writer and reader, the stock
per-layer layout with patch CL-06 skipped).  ``python -m
vllm_overlay.demo_node CONFIG_JSON OUT_JSON`` runs one on its own.

Config keys: ``connector`` ("offload" | "pool"), ``passes`` (a list of
"cold" | "hit" | "reload" | "pool"), ``prompts`` / ``expected`` (from
``copy_prompts``), ``max_tokens``, ``url`` / ``namespace`` (pool).

Pass kinds: ``cold`` computes every prompt from scratch (the connector
stores its blocks); ``hit`` runs them again (device prefix cache);
``reload`` first evicts the device cache (``reset_prefix_cache``) so the KV
comes back from host memory; ``pool`` is a fresh engine's first pass, whose
KV comes from the pool another process filled.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time

LAYOUT_MARK = "KV cache layout:"


class _LayoutLines(logging.Handler):
    """Keeps the overlay's "KV cache layout: ..." log line(s)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        try:
            message = record.getMessage()
        except Exception:  # noqa: BLE001
            return
        if LAYOUT_MARK in message:
            self.lines.append(message)


def _worker_info(worker) -> dict:
    """Runs in the worker (collective_rpc): the connector's own totals."""
    from vllm.distributed.kv_transfer import (
        get_kv_transfer_group,
        has_kv_transfer_group,
    )

    info = {
        "cross_layer": getattr(worker.model_runner, "cross_layers_kv_cache", None)
        is not None
    }
    if not has_kv_transfer_group():
        return info
    connector = get_kv_transfer_group()
    if hasattr(connector, "pool"):  # SharedKVPoolConnector
        connector.pool.drain()
        table = connector.connector_worker._table
        info.update(kind="pool", totals=connector.pool.cumulative())
    else:  # OverlayOffloadingConnector
        handler = connector.connector_worker.handler
        table = handler.mover.table
        info.update(
            kind="offload", totals=handler.cumulative(), method=handler.mover.method
        )
    info.update(runs_per_block=table.runs_per_block, block_bytes=table.block_bytes)
    return info


def _enable_request_metrics(llm) -> bool:
    """Turn on the front end's per-request stats (RequestOutput.metrics).

    ``disable_log_stats=False`` would do it, but 0.11.2's stat logger asserts
    that no KV connector lives in the front-end process, which is the case
    with an in-process engine (VLLM_ENABLE_V1_MULTIPROCESSING=0).  The
    front end alone computes ``first_token_latency`` (arrival to the step
    that returns the first token); no stat logger is needed for it.
    """
    engine = llm.llm_engine
    processor = getattr(engine, "output_processor", None)
    if not hasattr(engine, "log_stats") or not hasattr(processor, "log_stats"):
        return False
    engine.log_stats = True
    processor.log_stats = True
    return True


def _ttft(output) -> float | None:
    """vLLM's own time to first token of a request, in seconds."""
    metrics = getattr(output, "metrics", None)
    value = getattr(metrics, "first_token_latency", None)
    return float(value) if value else None


def _delta(after, before):
    """after - before for the numbers of a (nested) stats dict."""
    if isinstance(after, dict):
        return {k: _delta(v, (before or {}).get(k)) for k, v in after.items()}
    if isinstance(after, (int, float)) and not isinstance(after, bool):
        return after - (before or 0)
    return after


def _add(total, part):
    if isinstance(part, dict):
        total = dict(total or {})
        for k, v in part.items():
            total[k] = _add(total.get(k), v)
        return total
    if isinstance(part, (int, float)) and not isinstance(part, bool):
        return (total or 0) + part
    return part


class Node:
    """One engine; built in __init__, measured by run_passes()."""

    def __init__(self, config: dict) -> None:
        from vllm_overlay.demo import copy_model_path, cpu_defaults

        cpu_defaults()
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # worker in-process
        os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # collective_rpc
        self.config = config
        import vllm.logger  # noqa: F401  (vLLM's dictConfig resets child
        # loggers of "vllm" when it runs, so configure ours after it)

        self.layout_lines = _LayoutLines()
        overlay_logger = logging.getLogger("vllm.overlay")
        overlay_logger.addHandler(self.layout_lines)
        if overlay_logger.getEffectiveLevel() > logging.INFO:
            overlay_logger.setLevel(logging.INFO)  # the layout line, even quiet

        from vllm import LLM
        from vllm.config import KVTransferConfig

        if config["connector"] == "offload":
            kv = KVTransferConfig(
                kv_connector="OverlayOffloadingConnector",
                kv_role="kv_both",
                kv_connector_extra_config={"num_cpu_blocks": 64},
            )
        else:
            kv = KVTransferConfig(
                kv_connector="SharedKVPoolConnector",
                kv_role="kv_both",
                kv_connector_extra_config={
                    "url": config["url"],
                    "namespace": config["namespace"],
                    "timeout_s": 5.0,
                    "connect_timeout_s": 2.0,
                },
            )
        started = time.perf_counter()
        self.llm = LLM(
            model=copy_model_path(),
            dtype="float32",
            max_model_len=1024,
            num_gpu_blocks_override=64,
            enforce_eager=True,
            seed=0,
            kv_transfer_config=kv,
        )
        self.engine_s = time.perf_counter() - started
        self.vllm_ttft = _enable_request_metrics(self.llm)

    def _totals(self):
        return self.llm.collective_rpc(_worker_info)[0].get("totals")

    def run_passes(self) -> dict:
        """For each prompt in turn, each pass kind in turn (so the kinds are
        timed next to each other, under the same load on a shared machine)."""
        from vllm import SamplingParams

        llm, config = self.llm, self.config
        params = SamplingParams(temperature=0.0, max_tokens=config["max_tokens"])
        kinds = config["passes"]
        passes = {k: {"kind": k, "requests": [], "moved": None} for k in kinds}
        for prompt, want in zip(config["prompts"], config["expected"]):
            for kind in kinds:
                if kind == "reload":
                    # Stores finish asynchronously; one more step completes
                    # them and frees the blocks, so the reset really empties
                    # the device cache (the host pool keeps its copies).
                    llm.generate(["t00"], SamplingParams(max_tokens=1), use_tqdm=False)
                    # LLM.reset_prefix_cache returns None in 0.11.2; the
                    # reload's cached tokens and loaded blocks show it worked.
                    llm.reset_prefix_cache()
                before = self._totals()
                t0 = time.perf_counter()
                out = llm.generate([prompt], params, use_tqdm=False)[0]
                wall = time.perf_counter() - t0
                moved = _delta(self._totals(), before)
                got = out.outputs[0].text.split()
                entry = passes[kind]
                entry["moved"] = _add(entry["moved"], moved)
                entry["requests"].append(
                    {
                        "prompt_tokens": len(out.prompt_token_ids),
                        "cached_tokens": out.num_cached_tokens or 0,
                        "tokens": list(out.outputs[0].token_ids),
                        "correct": sum(a == b for a, b in zip(got, want)),
                        "wanted": len(want),
                        "exact": got[: len(want)] == want,
                        "ttft_s": _ttft(out),
                        "wall_s": wall,
                    }
                )
        info = llm.collective_rpc(_worker_info)[0]
        logging.getLogger("vllm.overlay").removeHandler(self.layout_lines)
        return {
            "passes": [passes[k] for k in kinds],
            "info": info,
            "engine_s": self.engine_s,
            "layout_lines": self.layout_lines.lines,
            "ttft_source": "vllm"
            if self.vllm_ttft
            and all(r["ttft_s"] for p in passes.values() for r in p["requests"])
            else "wall",
        }


def _wait_for(path: str, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {path} after {timeout_s} s")
        time.sleep(0.05)


if __name__ == "__main__":
    # CONFIG_JSON OUT_JSON: build the engine, run the passes, write OUT_JSON.
    result = Node(json.loads(sys.argv[1])).run_passes()
    with open(sys.argv[2], "w") as f:
        json.dump(result, f)
    sys.stdout.flush()
    os._exit(0)  # skip vLLM's slow teardown
