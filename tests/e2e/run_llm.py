"""Run real vLLM (CPU build) once and print the results as JSON.

Each run is its own process, so "stock" really is vLLM without the overlay
(``VLLM_OVERLAY_DISABLE=1``).  Usage:

    python run_llm.py '{"dtype": "float32", "connector": "probe", ...}'

Config keys: ``dtype``; ``connector`` (null | "probe" | "probe-no-prefer");
``chunked`` (small token budget so long prompts prefill in chunks);
``multiprocess`` (EngineCore in its own process, the vLLM default).
The JSON printed after the ``RESULT:`` marker holds, per pass, each prompt's
token ids, logprobs and cached-token count, plus ``kv`` (what the worker
really holds, gathered with ``collective_rpc``).
"""

from __future__ import annotations

import json
import os
import sys

from prompt_words import WORDS
from result_out import records

from vllm_overlay.testing import cpu_defaults, tiny_engine_args
from vllm_overlay.testing.v0_11_2 import probe_connector


def prompts() -> list[str]:
    """Prompts of different lengths: within one block up to several blocks."""
    out = ["The cache", "One two three four five six seven eight nine ten"]
    for n in (150, 333, 520):
        out.append(" ".join(WORDS[(i * 7) % len(WORDS)] for i in range(n)))
    return out


def inspect_worker(worker) -> dict:
    """Runs in the worker: prove the layout from the tensors themselves."""
    import torch

    runner = worker.model_runner
    bound = {}
    for name, layer in runner.compilation_config.static_forward_context.items():
        cache = getattr(layer, "kv_cache", None)
        if cache and isinstance(cache[0], torch.Tensor) and cache[0].numel():
            bound[name] = cache[0]
    buffer = getattr(runner, "cross_layers_kv_cache", None)
    from vllm.distributed.kv_transfer import (
        get_kv_transfer_group,
        has_kv_transfer_group,
    )

    connector = get_kv_transfer_group() if has_kv_transfer_group() else None
    result = {
        "connector_registered": getattr(connector, "registered_mode", None),
        "num_layers": len(bound),
        "storages": len({t.untyped_storage().data_ptr() for t in bound.values()}),
        "layer_strides": {n: list(t.stride()) for n, t in bound.items()},
        "layer_shapes": {n: list(t.shape) for n, t in bound.items()},
        "cross_layer": buffer is not None,
    }
    if buffer is None:
        return result
    layout = runner.cross_layers_kv_layout.to_dict()
    result["layout"] = layout
    result["buffer_contiguous"] = buffer.is_contiguous()
    result["same_storage_as_buffer"] = all(
        t.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()
        for t in bound.values()
    )
    # Element indices of the buffer, viewed through each layer's strides:
    # block b of every layer must cover exactly [b*E, (b+1)*E).
    index = torch.arange(buffer.numel()).view(buffer.shape)
    blocks_dim = layout["logical_dims"].index("blocks")
    per_block = buffer.numel() // layout["shape"][0]
    contiguous = True
    for b in range(layout["shape"][0]):
        elements = torch.cat(
            [
                torch.as_strided(index, t.shape, t.stride(), t.storage_offset())
                .select(blocks_dim, b)
                .flatten()
                for t in (bound[n] for n in layout["layer_names"])
            ]
        )
        expected = torch.arange(b * per_block, (b + 1) * per_block)
        contiguous &= bool(torch.equal(elements.sort().values, expected))
    result["blocks_contiguous_all_layers"] = contiguous
    # The layout description matches the bytes the model wrote: layer l's K
    # of block b starts at b * block_bytes + layer_offsets[l] and is
    # kv_offsets[1] bytes long (layers and kv right after blocks).
    raw = buffer.view(torch.int8).flatten()
    used = [
        b
        for b in range(layout["shape"][0])
        if bool(raw[b * layout["block_bytes"] : (b + 1) * layout["block_bytes"]].any())
    ]
    kv_dim = layout["logical_dims"].index("kv")
    k_bytes = layout["kv_offsets"][1]
    match = bool(used)
    for b in used:
        for layer, name in enumerate(layout["layer_names"]):
            view = bound[name].select(blocks_dim, b)
            k = view.select(kv_dim - (kv_dim > blocks_dim), 0)
            start = b * layout["block_bytes"] + layout["layer_offsets"][layer]
            match &= bool(
                torch.equal(
                    k.contiguous().view(torch.int8).flatten(),
                    raw[start : start + k_bytes],
                )
            )
    result["used_blocks"] = len(used)
    result["layout_matches_written_bytes"] = match
    return result


def main(config: dict) -> dict:
    cpu_defaults()
    if not config.get("multiprocess", False):
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # collective_rpc fn
    from vllm import LLM, SamplingParams

    kv_transfer_config = None
    if config.get("connector"):
        kv_transfer_config = probe_connector(
            prefer=config["connector"] != "probe-no-prefer"
        )
    kwargs = {}
    if config.get("chunked"):
        kwargs.update(
            enable_chunked_prefill=True, max_num_batched_tokens=64, max_num_seqs=4
        )
    llm = LLM(
        **tiny_engine_args(
            dtype=config.get("dtype", "float32"),
            kv_transfer_config=kv_transfer_config,
            **kwargs,
        )
    )
    params = SamplingParams(temperature=0.0, max_tokens=16, logprobs=1)
    passes = []
    for _ in range(2):  # the second pass hits the prefix cache
        outs = llm.generate(prompts(), params, use_tqdm=False)
        passes.append(records(outs))
    kv = llm.collective_rpc(inspect_worker)[0]
    return {"passes": passes, "kv": kv}


if __name__ == "__main__":
    from result_out import emit

    result = main(json.loads(sys.argv[1]))
    emit(result)
