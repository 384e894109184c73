"""The demo: vLLM with the overlay on the built-in tiny model.

Runs vLLM exactly as a user would (``LLM(...)`` with a ``kv_transfer_config``
naming the overlay's CrossLayerProbeConnector), then prints which KV layout
the worker chose, what the single buffer looks like, and the generated text.
"""

from __future__ import annotations

import json
import os
import pathlib
import tempfile

PROMPTS = [
    "The cache of the model",
    "One two three four five six seven eight nine ten block layer key value",
    "Red green blue river stone cloud light dark north south east west " * 6,
]


def tiny_model_path() -> str:
    from vllm_overlay.models.build_tiny_llama import DEFAULT_DIR

    if not (DEFAULT_DIR / "model.safetensors").exists():
        from vllm_overlay.models.build_tiny_llama import build

        build(DEFAULT_DIR)
    return str(DEFAULT_DIR)


def cpu_defaults() -> None:
    """Environment for the CPU harness (no hub, small KV cache)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def run_demo(dtype: str = "float32", max_tokens: int = 24) -> int:
    cpu_defaults()
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    report = pathlib.Path(tempfile.mkdtemp(prefix="vllm-overlay-demo-")) / "kv.json"
    llm = LLM(
        model=tiny_model_path(),
        dtype=dtype,
        max_model_len=1024,
        num_gpu_blocks_override=32,
        enforce_eager=True,
        kv_transfer_config=KVTransferConfig(
            kv_connector="CrossLayerProbeConnector",
            kv_role="kv_both",
            kv_connector_extra_config={"report_path": str(report)},
        ),
    )
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0.0,
                                                   max_tokens=max_tokens))
    info = json.loads(report.read_text())
    print("\n=== vllm-overlay demo " + "=" * 40)
    print(f"KV layout chosen by the worker: {info['mode']}")
    if info["layout"]:
        layout = info["layout"]
        dims = ", ".join(f"{d}={n}" for d, n in zip(layout["dims"],
                                                      layout["shape"]))
        print(f"  one buffer [{dims}] {layout['dtype']} "
              f"(attention backend {info['attn_backend']})")
        print(f"  one block = {layout['block_bytes']} contiguous bytes for "
              f"{len(layout['layer_names'])} layers; layer offsets "
              f"{layout['layer_offsets']}")
        storages = {v["storage_ptr"] for v in info["bound_layers"].values()}
        print(f"  attention layers bound to it: {len(info['bound_layers'])} "
              f"views, {len(storages)} storage")
    for prompt, output in zip(PROMPTS, outputs):
        print(f"\nprompt ({len(output.prompt_token_ids)} tokens): "
              f"{prompt[:60]!r}")
        print(f"  -> {output.outputs[0].text!r}")
    print("=" * 62)
    return 0
