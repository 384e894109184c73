"""What every engine of the tests, benchmarks, eval suites and demo shares,
on either release: environment defaults, model paths, engine arguments."""

from __future__ import annotations

import contextlib
import os
import pathlib
import sys

# The copy model (eval/model/copy_llama) is not shipped with the package:
# it lives in the source checkout, or wherever this variable says.
COPY_MODEL_ENV = "VLLM_OVERLAY_COPY_MODEL"
_CHECKOUT_COPY_MODEL = (
    pathlib.Path(__file__).resolve().parents[2] / "eval" / "model" / "copy_llama"
)


def cpu_defaults() -> None:
    """Environment for the CPU harness (no hub, no thread pinning, 1 GiB of
    KV cache unless an engine sets its own); what is set already stays."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def in_process_engine(rpc: bool = True) -> None:
    """EngineCore and worker in this process (deterministic batches; the
    runners reach the scheduler and the connectors directly); ``rpc``: allow
    ``collective_rpc`` with a function (pickled)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if rpc:
        os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"


def tiny_model_path() -> str:
    """The tiny Llama shipped in vllm_overlay/models (built on first use)."""
    from vllm_overlay.models.build_tiny_llama import DEFAULT_DIR

    if not (DEFAULT_DIR / "model.safetensors").exists():
        from vllm_overlay.models.build_tiny_llama import build

        build(DEFAULT_DIR)
    return str(DEFAULT_DIR)


def tiny_deepseek_path() -> str:
    """The tiny DeepSeek-V2-shaped MLA model shipped in vllm_overlay/models
    (built on first use)."""
    from vllm_overlay.models.build_tiny_deepseek import DEFAULT_DIR

    if not (DEFAULT_DIR / "model.safetensors").exists():
        from vllm_overlay.models.build_tiny_deepseek import build

        build(DEFAULT_DIR)
    return str(DEFAULT_DIR)


def copy_model_path() -> str:
    """The trained copy model: ``$VLLM_OVERLAY_COPY_MODEL`` when set, else
    eval/model/copy_llama of the source checkout this package runs from.
    An error naming both when neither holds the model."""
    configured = os.environ.get(COPY_MODEL_ENV)
    path = pathlib.Path(configured) if configured else _CHECKOUT_COPY_MODEL
    if not (path / "model.safetensors").exists():
        where = (
            f"${COPY_MODEL_ENV}={configured}"
            if configured
            else f"{path} (this package is not run from a source checkout)"
        )
        raise FileNotFoundError(
            f"the copy model (copy_llama: config.json, model.safetensors, "
            f"tokenizer) is not at {where}: run from a source checkout of "
            f"vllm-overlay, or set {COPY_MODEL_ENV} to a copy of its "
            "eval/model/copy_llama"
        )
    return str(path)


def tiny_engine_args(**overrides) -> dict:
    """``LLM(...)`` arguments of the tests' engines: the tiny Llama in
    float32, 1024 tokens, 48 KV blocks of 128 tokens, eager, seed 0.
    ``overrides`` replace or add arguments (``num_gpu_blocks_override=None``:
    vLLM sizes the cache itself)."""
    return {
        "model": tiny_model_path(),
        "dtype": "float32",
        "max_model_len": 1024,
        "num_gpu_blocks_override": 48,
        "enforce_eager": True,
        "seed": 0,
        **overrides,
    }


def tiny_mla_engine_args(**overrides) -> dict:
    """``tiny_engine_args`` for the tiny DeepSeek (MLA): KV blocks of 16
    tokens (the CPU platform sets that size for MLA), 160 of them."""
    return tiny_engine_args(
        model=tiny_deepseek_path(), num_gpu_blocks_override=160, **overrides
    )


@contextlib.contextmanager
def quiet(log_path: str | None):
    """Send this process's stdout/stderr (vLLM's and its C++ libraries'
    start-up chatter) to ``log_path``; on an error, show its tail.
    ``None``: change nothing."""
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
