"""A real ``vllm serve`` of an lm-eval config's model, for tests: started on
a free loopback port with this interpreter's vLLM (the harness it runs in),
healthy within a deadline, always stopped with one (SIGINT to its process
group, EngineCore included, then SIGKILL)."""

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
BIN = pathlib.Path(sys.executable).parent
SERVED_NAME = "copy_llama"


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


def serve_command(
    config: dict, port: int, extra: list[str] = (), bin_dir: pathlib.Path = BIN
) -> list[str]:
    """``bin_dir``: the harness whose vLLM serves (default: this one's)."""
    vllm = bin_dir / "vllm"
    cli = (
        [str(vllm)]
        if vllm.exists()
        else [
            sys.executable if bin_dir == BIN else str(bin_dir / "python"),
            "-m",
            "vllm.entrypoints.cli.main",
        ]
    )
    return [
        *cli,
        "serve",
        str(ROOT / config["model_name"]),
        "--served-model-name",
        SERVED_NAME,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        *serve_flags(config),
        *extra,
    ]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def harness_env(**overrides: str | None) -> dict:
    """The CPU harness environment with the overlay loaded; ``overrides``
    set variables (``None`` removes one)."""
    env = dict(os.environ)
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("HF_DATASETS_OFFLINE", "1")
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.pop("VLLM_OVERLAY_DISABLE", None)  # the overlay must be loaded
    for key, value in overrides.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env


def tail(path: pathlib.Path, chars: int = 6000) -> str:
    return path.read_text(errors="replace")[-chars:] if path.exists() else ""


@contextlib.contextmanager
def served_model(
    config: dict,
    log: pathlib.Path,
    extra: list[str] = (),
    env: dict | None = None,
    startup_s: float = 240.0,
    bin_dir: pathlib.Path = BIN,
):
    """``vllm serve`` on a free loopback port until /health answers; yields
    the port."""
    port = free_port()
    with open(log, "w") as out:
        proc = subprocess.Popen(
            serve_command(config, port, list(extra), bin_dir),
            env=env or harness_env(),
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


def post(port: int, path: str, body: dict | None = None, timeout: float = 120):
    """POST JSON to the server; the decoded JSON answer."""
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}",
        data=json.dumps(body or {}).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    with urllib.request.urlopen(request, timeout=timeout) as r:
        return json.loads(r.read() or b"null")


def complete(port: int, prompt: str, max_tokens: int = 12) -> dict:
    """One greedy completion over HTTP: its text, token ids, logprobs and
    the prompt's cached-token count (``--enable-prompt-tokens-details``)."""
    answer = post(
        port,
        "/v1/completions",
        {
            "model": SERVED_NAME,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "logprobs": 1,
            "return_tokens_as_token_ids": True,
        },
    )
    choice = answer["choices"][0]
    details = answer["usage"].get("prompt_tokens_details") or {}
    return {
        "text": choice["text"],
        "tokens": [int(t.split(":")[1]) for t in choice["logprobs"]["tokens"]],
        "logprobs": choice["logprobs"]["token_logprobs"],
        "cached_tokens": details.get("cached_tokens") or 0,
    }
