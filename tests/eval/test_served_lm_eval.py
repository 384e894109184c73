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

import json
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "eval"))
sys.path.insert(0, str(ROOT / "tests"))
from check_suite import DEFAULT_CONFIG, expected_problems  # noqa: E402
from run_eval import load_config  # noqa: E402
from support.served_vllm import (  # noqa: E402
    BIN,
    SERVED_NAME,
    harness_env,
    served_model,
)

CONFIG = load_config(DEFAULT_CONFIG)
MODEL = ROOT / CONFIG["model_name"]
TASKS = ROOT / CONFIG["include_path"]


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


def results_file(output: pathlib.Path) -> dict:
    found = sorted(output.rglob("results_*.json"))
    assert found, f"no results_*.json under {output}"
    return json.loads(found[-1].read_text())


def test_served_model_reaches_the_suite_values(tmp_path):
    workdir = tmp_path / "elsewhere"  # neither the repository nor eval/tasks
    workdir.mkdir()
    log = tmp_path / "serve.log"
    output = tmp_path / "lm_eval_out"
    with served_model(CONFIG, log) as port:
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
