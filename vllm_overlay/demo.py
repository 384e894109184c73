"""The demo: what the overlay is for, on a model whose answer needs its KV.

``python -m vllm_overlay demo`` (``bash scripts/demo.sh``) runs real vLLM
0.11.2 with the overlay on ``eval/model/copy_llama``, a trained 2-layer Llama
that copies a random token sequence after a separator (an induction head:
the copy is right only if the KV of the sequence is right).  For each prompt:

* recompute: a cold prefill, nothing cached (OverlayOffloadingConnector
  stores the blocks to host memory in the background);
* device prefix hit: the same prompt again;
* host reload: the device prefix cache is reset (the KV is evicted from the
  device) and the prompt runs again: its KV comes back from host memory;
* the same host reload with the stock per-layer KV layout (patch CL-06
  skipped, a second process) for the copies per block;
* pool reload: a process with SharedKVPoolConnector fills a throwaway
  ``redis-server``, and another process, a fresh engine, loads the KV from
  it (skipped, with the reason, when ``redis-server`` is not on PATH).

Then one table: blocks and bytes moved (the connectors' own counters), copies
per block, whether the copy is still exact, and time to first token.
The engines start in parallel; their measurements run one at a time.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

SEQ_TOKENS = 64  # the copy model's sequence alphabet: t00 .. t63


def tiny_model_path() -> str:
    from vllm_overlay.models.build_tiny_llama import DEFAULT_DIR

    if not (DEFAULT_DIR / "model.safetensors").exists():
        from vllm_overlay.models.build_tiny_llama import build

        build(DEFAULT_DIR)
    return str(DEFAULT_DIR)


def copy_model_path() -> str:
    """eval/model/copy_llama of the source checkout (the overlay is
    installed editable in the harness), or $VLLM_OVERLAY_DEMO_MODEL."""
    path = os.environ.get("VLLM_OVERLAY_DEMO_MODEL") or str(
        pathlib.Path(__file__).resolve().parents[1] / "eval" / "model" / "copy_llama"
    )
    if not (pathlib.Path(path) / "model.safetensors").exists():
        raise SystemExit(
            f"demo: the copy model is not at {path} (run from a "
            "source checkout, or set VLLM_OVERLAY_DEMO_MODEL)"
        )
    return path


def cpu_defaults() -> None:
    """Environment for the CPU harness (no hub, small KV cache)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def copy_prompts(
    n: int, max_tokens: int, seed: int = 2
) -> tuple[list[str], list[list[str]]]:
    """Prompts built like eval/check_copy.py: a random sequence of 300-380
    tokens, the separator, its first 8-30 tokens; expected: what follows.
    (The model is not perfect: with seed 11 one prompt in 8 goes astray
    after 3 tokens, with or without the overlay.  Seed 2's first 8 prompts
    copy exactly.)"""
    rng = random.Random(seed)
    prompts, expected = [], []
    for _ in range(n):
        seq = [
            f"t{rng.randrange(SEQ_TOKENS):02d}" for _ in range(rng.randint(300, 380))
        ]
        k = rng.randint(8, 30)
        prompts.append(" ".join(seq) + " | " + " ".join(seq[:k]))
        expected.append(seq[k : k + max_tokens])
    return prompts, expected


# --- a throwaway redis-server -------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pong(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


def redis_server_command(port: int, workdir: str) -> list[str]:
    """redis-server on loopback PORT, no persistence (RDB nor AOF)."""
    return [
        "redis-server",
        "--port",
        str(port),
        "--bind",
        "127.0.0.1",
        "--save",
        "",
        "--appendonly",
        "no",
        "--dir",
        workdir,
    ]


@contextlib.contextmanager
def redis_server():
    """A redis-server on a free loopback port, no persistence; yields its
    URL and is killed on exit."""
    port = _free_port()
    workdir = tempfile.mkdtemp(prefix="vllm-overlay-demo-redis-")
    proc = subprocess.Popen(
        redis_server_command(port, workdir),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 10
        while not _pong(port):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"redis-server on port {port} did not start")
            time.sleep(0.05)
        yield f"redis://127.0.0.1:{port}"
    finally:
        proc.kill()
        proc.wait(timeout=10)
        shutil.rmtree(workdir, ignore_errors=True)


# --- engines in other processes -----------------------------------------


class _NodeProcess:
    """An engine in a forked child of this process.

    The parent has imported vLLM (the bulk of an engine's start-up on CPU)
    but not started an engine nor registered the overlay, so the child only
    builds its engine, and registers the overlay with its own environment
    (``env``: e.g. patches to skip).  The child builds its engine at once,
    writes ``<name>.json.ready``, waits for ``.go`` (the demo measures one
    engine at a time), runs its passes and writes ``<name>.json``.
    """

    def __init__(
        self, name: str, config: dict, workdir: str, env: dict[str, str] | None = None
    ) -> None:
        self.name = name
        self.out = os.path.join(workdir, f"{name}.json")
        self.log_path = os.path.join(workdir, f"{name}.log")
        self.returncode: int | None = None
        sys.stdout.flush()
        sys.stderr.flush()
        self.pid = os.fork()
        if self.pid == 0:  # the child never returns from here
            code = 1
            try:
                log = os.open(self.log_path, os.O_WRONLY | os.O_CREAT, 0o644)
                os.dup2(log, 1)
                os.dup2(log, 2)
                os.environ.update(env or {})
                from vllm_overlay.demo_node import Node, _wait_for

                node = Node(config)
                open(self.out + ".ready", "w").close()
                _wait_for(self.out + ".go")
                result = node.run_passes()
                with open(self.out + ".tmp", "w") as f:
                    json.dump(result, f)
                os.replace(self.out + ".tmp", self.out)
                code = 0
            except BaseException:  # noqa: BLE001
                import traceback

                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)  # no vLLM teardown, no parent atexit hooks

    def _poll(self) -> bool:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode is not None

    def _wait(self, path: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not os.path.exists(path):
            if self._poll() and not os.path.exists(path):
                raise RuntimeError(
                    self._failure(f"exited with status {self.returncode}")
                )
            if time.monotonic() > deadline:
                raise RuntimeError(self._failure("timed out"))
            time.sleep(0.05)

    def _failure(self, what: str) -> str:
        try:
            tail = pathlib.Path(self.log_path).read_text()[-3000:]
        except OSError:
            tail = ""
        return f"{self.name} engine {what} (log {self.log_path}):\n{tail}"

    def wait_ready(self, timeout_s: float = 300) -> None:
        self._wait(self.out + ".ready", timeout_s)

    def measure(self, timeout_s: float = 180) -> dict:
        open(self.out + ".go", "w").close()
        self._wait(self.out, timeout_s)
        return json.loads(pathlib.Path(self.out).read_text())

    def stop(self) -> None:
        if not self._poll():
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, 9)
            os.waitpid(self.pid, 0)
            self.returncode = -9


@contextlib.contextmanager
def _quiet(log_path: str | None):
    """Send this process's stdout/stderr (vLLM's and its C++ libraries'
    start-up chatter) to ``log_path``; on an error, show its tail."""
    if log_path is None:
        yield
        return
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    with open(log_path, "w") as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
        try:
            yield
        except BaseException:
            _restore(saved)
            print(pathlib.Path(log_path).read_text()[-4000:], file=sys.stderr)
            raise
        _restore(saved)


def _restore(saved: list[int]) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    for fd, copy in zip((1, 2), saved):
        os.dup2(copy, fd)
        os.close(copy)


# --- the report -----------------------------------------------------------


def _median_ms(values: list[float]) -> float:
    return 1000 * statistics.median(values)


def _ttft_values(entry: dict) -> list[float]:
    return [r["ttft_s"] if r["ttft_s"] else r["wall_s"] for r in entry["requests"]]


def _copy(entry: dict, reference: dict | None) -> dict:
    reqs = entry["requests"]
    correct = sum(r["correct"] for r in reqs)
    wanted = sum(r["wanted"] for r in reqs)
    same = reference is None or [r["tokens"] for r in reqs] == [
        r["tokens"] for r in reference["requests"]
    ]
    return {
        "accuracy": correct / wanted if wanted else 0.0,
        "exact": sum(r["exact"] for r in reqs),
        "prompts": len(reqs),
        "all_exact": all(r["exact"] for r in reqs),
        "same_tokens_as_recompute": same,
    }


def _row(
    path: str,
    source: str,
    entry: dict,
    info: dict | None,
    reference: dict | None,
    moved_in: tuple[int, int] | None,
) -> dict:
    reqs = entry["requests"]
    blocks, nbytes = moved_in if moved_in else (0, 0)
    return {
        "path": path,
        "kv_from": source,
        "cached_tokens": sum(r["cached_tokens"] for r in reqs),
        "prompt_tokens": sum(r["prompt_tokens"] for r in reqs),
        "blocks_in": blocks,
        "bytes_in": nbytes,
        "copies_per_block": (info["runs_per_block"] if moved_in and info else None),
        "ttft_ms": _median_ms(_ttft_values(entry)),
        "ttft_best_ms": 1000 * min(_ttft_values(entry)),
        "copy": _copy(entry, reference),
    }


def _fmt_bytes(n: int) -> str:
    if n >= 1 << 20:
        return f"{n / 2**20:.2f} MiB"
    if n >= 1 << 10:
        return f"{n / 2**10:.0f} KiB"
    return f"{n} B"


def _print_table(rows: list[dict]) -> None:
    head = [
        "path",
        "KV from",
        "tokens from cache",
        "blocks in",
        "bytes in",
        "copies/block",
        "copy (acc, exact)",
        "TTFT ms (best)",
    ]
    body = []
    for r in rows:
        c = r["copy"]
        body.append(
            [
                r["path"],
                r["kv_from"],
                f"{r['cached_tokens']}/{r['prompt_tokens']}",
                str(r["blocks_in"]),
                _fmt_bytes(r["bytes_in"]) if r["bytes_in"] else "0",
                str(r["copies_per_block"]) if r["copies_per_block"] else "-",
                f"{c['accuracy']:.3f}, {'yes' if c['all_exact'] else 'NO'} "
                f"{c['exact']}/{c['prompts']}",
                f"{r['ttft_ms']:.1f} ({r['ttft_best_ms']:.1f})",
            ]
        )
    widths = [max(len(x) for x in col) for col in zip(head, *body)]
    line = (
        lambda cells: "| "
        + " | ".join(  # noqa: E731
            c.ljust(w) for c, w in zip(cells, widths)
        )
        + " |"
    )
    print(line(head))
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for cells in body:
        print(line(cells))


def _layout(result: dict) -> str:
    lines = result.get("layout_lines") or ["(no layout line logged)"]
    return lines[-1].replace("vllm-overlay: ", "")


def run_demo(
    pool: bool = True,
    stock_layout: bool = True,
    num_prompts: int = 4,
    max_tokens: int = 8,
    json_path: str | None = None,
    verbose: bool = False,
) -> int:
    started = time.perf_counter()
    cpu_defaults()
    if not verbose:
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    prompts, expected = copy_prompts(num_prompts, max_tokens)
    base = {"prompts": prompts, "expected": expected, "max_tokens": max_tokens}
    workdir = tempfile.mkdtemp(prefix="vllm-overlay-demo-")
    pool_note = None
    if pool and shutil.which("redis-server") is None:
        pool_note = (
            "pool reload row skipped: redis-server is not on PATH "
            "(scripts/setup_env.sh installs it)"
        )
    elif not pool:
        pool_note = "pool reload row skipped: --no-pool"
    print(
        "vllm-overlay demo: starting the engines (copy model "
        f"{copy_model_path()}; {num_prompts} prompts)...",
        flush=True,
    )

    from vllm_overlay.demo_node import Node

    # Import vLLM once, here, before forking the other engines.
    with _quiet(None if verbose else os.path.join(workdir, "import.log")):
        import vllm.logger  # noqa: F401
        from vllm import LLM  # noqa: F401
        from vllm.config import KVTransferConfig  # noqa: F401

    results: dict[str, dict] = {}
    errors: list[str] = []
    with contextlib.ExitStack() as stack:
        procs: dict[str, _NodeProcess] = {}
        if pool_note is None:
            url = stack.enter_context(redis_server())
            pool_cfg = {**base, "connector": "pool", "url": url, "namespace": "demo"}
            procs["writer"] = _NodeProcess(
                "pool-writer", {**pool_cfg, "passes": ["cold"]}, workdir
            )
            procs["reader"] = _NodeProcess(
                "pool-reader", {**pool_cfg, "passes": ["pool"]}, workdir
            )
        if stock_layout:
            procs["stock"] = _NodeProcess(
                "stock-layout",
                {**base, "connector": "offload", "passes": ["cold", "reload"]},
                workdir,
                env={"VLLM_OVERLAY_SKIP_PATCHES": "CL-06"},
            )
        for proc in procs.values():
            stack.callback(proc.stop)
        with _quiet(None if verbose else os.path.join(workdir, "main.log")):
            main = Node(
                {**base, "connector": "offload", "passes": ["cold", "hit", "reload"]}
            )
        phases = {"main_engine_up": time.perf_counter() - started}
        ready = {}
        for name, proc in procs.items():
            try:
                proc.wait_ready()
                ready[name] = proc
            except RuntimeError as exc:
                errors.append(str(exc))
        phases["all_engines_up"] = time.perf_counter() - started
        # One measurement at a time, every engine already up.
        results["main"] = main.run_passes()
        phases["main_measured"] = time.perf_counter() - started
        for name in ("stock", "writer", "reader"):
            if name not in ready or (name == "reader" and "writer" not in results):
                continue
            try:
                results[name] = ready[name].measure()
                phases[f"{name}_measured"] = time.perf_counter() - started
            except RuntimeError as exc:
                errors.append(str(exc))

    main_r = results["main"]
    cold, hit, reload = main_r["passes"]
    info = main_r["info"]
    rows = [
        _row("recompute (cold)", "prefill", cold, info, None, None),
        _row("device prefix hit", "device cache", hit, info, cold, None),
        _row(
            "host reload",
            "host memory",
            reload,
            info,
            cold,
            (reload["moved"]["load"]["blocks"], reload["moved"]["load"]["bytes"]),
        ),
    ]
    if "stock" in results:
        s = results["stock"]
        s_reload = s["passes"][1]
        rows.append(
            _row(
                "host reload, stock layout",
                "host memory",
                s_reload,
                s["info"],
                cold,
                (
                    s_reload["moved"]["load"]["blocks"],
                    s_reload["moved"]["load"]["bytes"],
                ),
            )
        )
    if "reader" in results:
        r = results["reader"]
        r_pass = r["passes"][0]
        rows.append(
            _row(
                "pool reload (2nd process)",
                "Redis",
                r_pass,
                r["info"],
                cold,
                (r_pass["moved"]["loaded_blocks"], r_pass["moved"]["bytes_in"]),
            )
        )

    print("\n=== vllm-overlay demo " + "=" * 56)
    print(
        f"model: copy_llama (2-layer Llama, copies a random sequence of "
        f"{SEQ_TOKENS} tokens after '|'); {num_prompts} prompts of "
        f"{min(r['prompt_tokens'] for r in cold['requests'])}-"
        f"{max(r['prompt_tokens'] for r in cold['requests'])} tokens, "
        f"{max_tokens} tokens generated greedily and compared with the "
        "sequence"
    )
    print(f"KV cache layout (offload engine): {_layout(main_r)}")
    if "stock" in results:
        print(
            "KV cache layout (stock-layout engine, CL-06 skipped): "
            f"{_layout(results['stock'])}"
        )
    print()
    _print_table(rows)
    print()
    st = cold["moved"]["store"]
    print(
        f"stores in the cold pass: offload {st['blocks']} blocks, "
        f"{_fmt_bytes(st['bytes'])} to host, {st['copy_calls']} copy calls "
        f"({info['runs_per_block']} per block, {info['block_bytes']} B per "
        "block)",
        end="",
    )
    if "stock" in results:
        s_st = results["stock"]["passes"][0]["moved"]["store"]
        print(
            f"; stock layout {s_st['blocks']} blocks, "
            f"{s_st['copy_calls']} copy calls "
            f"({results['stock']['info']['runs_per_block']} per block)",
            end="",
        )
    if "writer" in results:
        w = results["writer"]["passes"][0]["moved"]
        print(
            f"; pool writer {w['stored_blocks']} blocks, "
            f"{_fmt_bytes(w['bytes_out'])} to Redis",
            end="",
        )
    print()
    n = num_prompts
    source = (
        "vLLM's RequestOutput.metrics.first_token_latency (arrival to first token)"
        if main_r["ttft_source"] == "vllm"
        else f"wall time of the whole generate() ({max_tokens} tokens; "
        "vLLM's metrics were not available)"
    )
    print(
        f"TTFT: {source}, median (best) of {n} prompts, one request at a "
        "time; the CPU is shared, so expect noise."
    )
    rec, rel = rows[0]["ttft_ms"], rows[2]["ttft_ms"]
    print(
        f"* Recompute can beat a reload here (this run: recompute {rec:.1f} "
        f"ms, host reload {rel:.1f} ms): on CPU a 2-layer, 64-wide model "
        "prefills ~400 tokens in milliseconds, and a reload is an "
        "asynchronous load that costs the scheduler extra steps. Reloading "
        "pays off when prefill is expensive (big models, long prompts); "
        "this demo shows what moves and that the copy stays exact, not "
        "speed."
    )
    if pool_note:
        print(pool_note)
    for error in errors:
        print(f"ERROR: {error}")
    wall = time.perf_counter() - started
    print(
        f"wall time {wall:.0f} s "
        f"(engine start {main_r['engine_s']:.0f} s in this process)"
    )
    print("=" * 78, flush=True)
    if json_path:
        summary = {
            "rows": rows,
            "pool_note": pool_note,
            "errors": errors,
            "wall_s": wall,
            "ttft_source": main_r["ttft_source"],
            "layout_lines": {k: v.get("layout_lines") for k, v in results.items()},
            "runs_per_block": {
                k: v["info"].get("runs_per_block") for k, v in results.items()
            },
            "phases": phases,
            "raw": results,
        }
        pathlib.Path(json_path).write_text(json.dumps(summary, indent=1))
    ok = not errors and all(r["copy"]["all_exact"] for r in rows)
    if ok:
        shutil.rmtree(workdir, ignore_errors=True)
    else:
        print(f"engine logs: {workdir}")
    return 0 if ok else 1
