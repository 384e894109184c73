"""The demo's flow on either release: start the engines (children forked
first, then this process's own), measure them one at a time, print the
release's table and notes."""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import shutil
import tempfile
import time

from vllm_overlay.demo import report
from vllm_overlay.demo.node import SEQ_TOKENS, Node, copy_prompts
from vllm_overlay.demo.procs import NodeProcess
from vllm_overlay.testing import copy_model_path, cpu_defaults, quiet

# The demo of each release (``vllm_overlay/demo/<module>.py``): what the
# overlay adds there, shown on the copy model.
RELEASE_MODULES = {"0.11.2": "v0_11_2", "0.32": "v0_32"}
# The newest supported release: what scripts/demo.sh runs without --vllm.
# Without --vllm, ``python -m vllm_overlay demo`` runs the release installed
# in its Python, whichever it is.
DEFAULT_RELEASE = "0.32"


def installed_release() -> str | None:
    """The demo release of the installed vLLM ("0.11.2", "0.32"), or None."""
    from vllm_overlay import version_gate

    entry = version_gate.release_entry(version_gate.installed_vllm_version())
    return None if entry is None else entry.removesuffix(".x")


def _plan_module(release: str | None):
    import importlib

    installed = installed_release()
    if installed is None:
        from vllm_overlay import version_gate

        raise SystemExit(
            f"demo: needs vLLM {' or '.join(RELEASE_MODULES)}; this Python has "
            f"vLLM {version_gate.installed_vllm_version()}"
        )
    if release is not None and release != installed:
        raise SystemExit(
            f"demo: --vllm {release} asked for, but this Python runs vLLM "
            f"{installed}: run `bash scripts/demo.sh --vllm {release}` (it "
            "picks that release's harness)"
        )
    return importlib.import_module(f"vllm_overlay.demo.{RELEASE_MODULES[installed]}")


def run_demo(
    release: str | None = None,
    pool: bool = True,
    stock_layout: bool = True,
    num_prompts: int = 4,
    max_tokens: int = 8,
    json_path: str | None = None,
    verbose: bool = False,
) -> int:
    """The demo on the installed vLLM (``release``: fail unless it is that
    one).  Returns the exit status: 0 when every row copied exactly."""
    started = time.perf_counter()
    cpu_defaults()
    if not verbose:  # before vLLM is first imported (it reads it then)
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    plan_module = _plan_module(release)
    try:
        model = copy_model_path()
    except FileNotFoundError as exc:
        raise SystemExit(f"demo: {exc}") from None
    prompts, expected = copy_prompts(num_prompts, max_tokens)
    base = {
        "release": plan_module.RELEASE,
        "prompts": prompts,
        "expected": expected,
        "max_tokens": max_tokens,
    }
    plan = plan_module.Plan(base, pool=pool, stock_layout=stock_layout)
    workdir = tempfile.mkdtemp(prefix="vllm-overlay-demo-")
    print(
        f"vllm-overlay demo on vLLM {plan_module.RELEASE}: starting the engines "
        f"(copy model {model}; {num_prompts} prompts)...",
        flush=True,
    )
    # Import vLLM once, here, before forking the other engines.
    with quiet(None if verbose else os.path.join(workdir, "import.log")):
        import vllm.logger  # noqa: F401
        from vllm import LLM  # noqa: F401
        from vllm.config import KVTransferConfig  # noqa: F401

    results: dict[str, dict] = {}
    errors: list[str] = []
    with contextlib.ExitStack() as stack:
        procs: dict[str, NodeProcess] = {}
        for name, config in plan.children(stack).items():
            procs[name] = NodeProcess(name, config, workdir)
            stack.callback(procs[name].stop)
        with quiet(None if verbose else os.path.join(workdir, "main.log")):
            main = Node(plan.main)
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
        for name, proc in ready.items():
            after = plan.needs.get(name)
            if after is not None and after not in results:
                continue
            try:
                results[name] = proc.measure()
                phases[f"{name}_measured"] = time.perf_counter() - started
            except RuntimeError as exc:
                errors.append(str(exc))

    main_r = results["main"]
    cold = main_r["passes"][0]
    if not main_r["evicted"]:
        errors.append("the device prefix cache could not be emptied before a reload")
    rows = plan.rows(results)
    lengths = [r["prompt_tokens"] for r in cold["requests"]]
    print(f"\n=== vllm-overlay demo, vLLM {plan_module.RELEASE} " + "=" * 44)
    print(
        f"model: copy_llama (2-layer Llama, copies a random sequence of "
        f"{SEQ_TOKENS} tokens after '|'); {num_prompts} prompts of "
        f"{min(lengths)}-{max(lengths)} tokens, {max_tokens} tokens generated "
        "greedily and compared with the sequence"
    )
    for line in plan.layout_lines(results):
        print(line)
    print()
    report.print_table(rows)
    print()
    print(plan.stores_line(results))
    source = (
        "vLLM's RequestOutput.metrics.first_token_latency (arrival to first token)"
        if main_r["ttft_source"] == "vllm"
        else f"wall time of the whole generate() ({max_tokens} tokens; "
        "vLLM's metrics were not available)"
    )
    print(
        f"TTFT: {source}, median (best) of {num_prompts} prompts, one request "
        "at a time; the CPU is shared, so expect noise."
    )
    by_path = {r["path"]: r for r in rows}
    print(
        report.speed_note(
            by_path["recompute (cold)"]["ttft_ms"],
            by_path["host reload"]["ttft_ms"],
            f"{min(lengths)}-{max(lengths)}",
        )
    )
    for note in plan.notes:
        print(note)
    for error in errors:
        print(f"ERROR: {error}")
    wall = time.perf_counter() - started
    print(
        f"wall time {wall:.0f} s "
        f"(engine start {main_r['engine_s']:.0f} s in this process)"
    )
    print("=" * 78, flush=True)
    ok = not errors and all(plan.row_ok(r) for r in rows)
    if json_path:
        summary = {
            "release": plan_module.RELEASE,
            "rows": rows,
            "notes": plan.notes,
            "pool_note": plan.pool_note,
            "errors": errors,
            "ok": ok,
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
    if ok:
        shutil.rmtree(workdir, ignore_errors=True)
    else:
        print(f"engine logs: {workdir}")
    return 0 if ok else 1
