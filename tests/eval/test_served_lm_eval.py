"""lm-eval against a served model: ``vllm serve`` + ``local-completions``.

Starts ``vllm serve eval/model/copy_llama`` with the overlay loaded (the
plugin entry point; the stock KV path, same engine arguments as
eval/configs/copy-llama.yaml) on a free loopback port, then runs the
``lm_eval`` command line from a temporary directory (not the repository,
not eval/tasks) with ``--include_path`` pointing at eval/tasks.  The served
model must reach the suite's values: acc 1.0 on copy_mc (loglikelihood
through the completions API: echo + logprobs) and exact_match 1.0 on
copy_gen.  The server is always stopped.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "eval"))
from check_suite import DEFAULT_CONFIG, expected_problems  # noqa: E402
from run_eval import load_config  # noqa: E402

CONFIG = load_config(DEFAULT_CONFIG)
MODEL = ROOT / CONFIG["model_name"]
TASKS = ROOT / CONFIG["include_path"]
SERVED_NAME = "copy_llama"
BIN = pathlib.Path(sys.executable).parent


def serve_flags(config: dict) -> list[str]:
    """The config's engine arguments as ``vllm serve`` flags."""
    flags = []
    for key, value in config["model_args"].items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            flags.append(flag)
        elif value is not False and value is not None:
            flags += [flag, str(value)]
    return flags


def serve_command(port: int) -> list[str]:
    vllm = BIN / "vllm"
    cli = (
        [str(vllm)]
        if vllm.exists()
        else [sys.executable, "-m", "vllm.entrypoints.cli.main"]
    )
    return cli + [
        "serve",
        str(MODEL),
        "--served-model-name",
        SERVED_NAME,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        *serve_flags(CONFIG),
    ]


def lm_eval_command(port: int, output: pathlib.Path) -> list[str]:
    lm_eval = BIN / "lm_eval"
    cli = [str(lm_eval)] if lm_eval.exists() else [sys.executable, "-m", "lm_eval"]
    model_args = ",".join(
        [
            f"model={SERVED_NAME}",
            f"base_url=http://127.0.0.1:{port}/v1/completions",
            f"tokenizer={MODEL}",
            "tokenizer_backend=huggingface",
            "tokenized_requests=True",
            "max_retries=1",
        ]
    )
    tasks = ",".join(task["name"] for task in CONFIG["tasks"])
    return cli + [
        "--model",
        "local-completions",
        "--model_args",
        model_args,
        "--tasks",
        tasks,
        "--include_path",
        str(TASKS),
        "--batch_size",
        "16",
        "--output_path",
        str(output),
    ]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def harness_env() -> dict:
    env = dict(os.environ)
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("HF_DATASETS_OFFLINE", "1")
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.pop("VLLM_OVERLAY_DISABLE", None)  # the overlay must be loaded
    return env


def tail(path: pathlib.Path, chars: int = 6000) -> str:
    return path.read_text(errors="replace")[-chars:] if path.exists() else ""


@contextlib.contextmanager
def served_model(log: pathlib.Path, startup_s: float = 240.0):
    """``vllm serve`` on a free loopback port until /health answers."""
    port = free_port()
    with open(log, "w") as out:
        proc = subprocess.Popen(
            serve_command(port),
            env=harness_env(),
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=log.parent,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + startup_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(
                    f"vllm serve exited ({proc.returncode}):\n{tail(log)}"
                )
            try:
                with urllib.request.urlopen(
                    f"http://127.0.0.1:{port}/health", timeout=2
                ) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"vllm serve not healthy after {startup_s:.0f} s:\n{tail(log)}"
                )
            time.sleep(1.0)
        yield port
    finally:
        stop(proc)


def stop(proc: subprocess.Popen) -> None:
    """SIGINT the server's process group (EngineCore included), then kill."""
    if proc.poll() is not None:
        return
    for sig, wait_s in ((signal.SIGINT, 30), (signal.SIGKILL, 10)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def results_file(output: pathlib.Path) -> dict:
    found = sorted(output.rglob("results_*.json"))
    assert found, f"no results_*.json under {output}"
    return json.loads(found[-1].read_text())


def test_served_model_reaches_the_suite_values(tmp_path):
    workdir = tmp_path / "elsewhere"  # neither the repository nor eval/tasks
    workdir.mkdir()
    log = tmp_path / "serve.log"
    output = tmp_path / "lm_eval_out"
    with served_model(log) as port:
        proc = subprocess.run(
            lm_eval_command(port, output),
            cwd=workdir,
            env=harness_env(),
            capture_output=True,
            text=True,
            timeout=300,
        )
    server_log = log.read_text(errors="replace")
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    assert "vllm-overlay 0.1.0 applied to vLLM 0.11.2" in server_log
    results = results_file(output)["results"]
    metrics = {
        task: {k: v for k, v in values.items() if isinstance(v, (int, float))}
        for task, values in results.items()
    }
    assert expected_problems(CONFIG, {"metrics": metrics}) == []
    assert metrics["copy_mc"]["acc,none"] == 1.0
    assert metrics["copy_gen"]["exact_match,none"] == 1.0
