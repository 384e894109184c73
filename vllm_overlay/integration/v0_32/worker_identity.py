"""Measured in a worker, where the weights and the KV cache live: the
fingerprint of the weights and the in-page layout of the attention
backend (``kv_identity`` says why both are in the pool's namespace).

* ``weights_digest``: every parameter and buffer of the model, by name,
  dtype, shape and bytes.  Host tensors are hashed in place (BLAKE2b,
  several at a time: the hash releases the GIL); device tensors are
  reduced on the device to two 64-bit sums (``device_digest``), so no
  weights are copied off the GPU.
* ``page_layout``: each attention layer kind's own KV-cache write
  (``impl.do_kv_cache_update``) is run on probe tokens into a scratch
  cache of two blocks, and the bytes it wrote are hashed.  Two hosts whose
  kernels lay a page out alike (CPU_ATTN's vec and vec16 kernels: measured
  identical) get the same digest; a kernel that packs K or V otherwise
  (AMX) or a row-major GPU page gets another.  A backend without that
  method is named by its class, kernel ISA and cache shape instead.

``worker_identity`` runs in each worker through ``collective_rpc``.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import logging
import os

import torch

logger = logging.getLogger("vllm.overlay")

_CHUNK = 1 << 24  # elements a device reduction takes at a time


def device_digest(tensor: torch.Tensor) -> bytes:
    """Two sums mod 2**64 over the tensor's bytes as int32 words: plain, and
    each word times an odd multiplier of its position (a change of any one
    word changes the second).  Runs on the tensor's device."""
    flat = tensor.detach().reshape(-1).view(torch.uint8)
    pad = (-flat.numel()) % 4
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    words = flat.view(torch.int32)
    plain = torch.zeros((), dtype=torch.int64, device=words.device)
    mixed = torch.zeros((), dtype=torch.int64, device=words.device)
    for start in range(0, words.numel(), _CHUNK):
        part = words[start : start + _CHUNK].to(torch.int64)
        odd = torch.arange(start, start + part.numel(), device=part.device)
        odd = odd * 0x9E3779B1 * 2 + 1
        plain += part.sum()
        mixed += (part * odd).sum()
    return plain.cpu().numpy().tobytes() + mixed.cpu().numpy().tobytes()


def _host_bytes(tensor: torch.Tensor) -> memoryview:
    flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    return memoryview(flat.numpy())


def _tensor_digest(tensor: torch.Tensor) -> bytes:
    if tensor.device.type == "meta":
        return b"meta"
    if tensor.device.type == "cpu":
        return hashlib.blake2b(_host_bytes(tensor), digest_size=16).digest()
    return device_digest(tensor)


def weights_digest(model: torch.nn.Module) -> str:
    """Each tensor hashed on its own, several at a time (BLAKE2b releases
    the GIL), then the names, dtypes, shapes and digests in name order."""
    named = dict(model.named_parameters())
    named.update(model.named_buffers())
    names = sorted(named)
    threads = min(8, os.cpu_count() or 1)
    with concurrent.futures.ThreadPoolExecutor(threads, "kv-identity") as pool:
        digests = list(pool.map(_tensor_digest, (named[n] for n in names)))
    h = hashlib.blake2b(digest_size=16)
    for name, digest in zip(names, digests):
        tensor = named[name]
        h.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode() + digest)
    return h.hexdigest()


def probe_tokens(
    n: int, heads: int, size: int, dtype, device, salt: int
) -> torch.Tensor:
    """Deterministic, distinct values on every host (integer arithmetic, no
    random generator whose vector path could differ by ISA)."""
    index = torch.arange(n * heads * size, dtype=torch.float64)
    values = ((index * 2654435761 + salt) % 65521) / 65521.0 - 0.5
    return values.reshape(n, heads, size).to(dtype=dtype, device=device)


def _block_dim(kv_cache: torch.Tensor, num_blocks: int | None) -> int:
    dims = [d for d, size in enumerate(kv_cache.shape) if size == num_blocks]
    if not dims:  # the outermost in memory
        dims = range(kv_cache.dim())
    return max(dims, key=lambda d: kv_cache.stride(d))


def page_layout(layer, block_size: int, num_blocks: int | None, dtype) -> str:
    """The digest of what ``layer``'s backend writes into a page."""
    backend = layer.attn_backend.get_name()
    impl, cache = layer.impl, layer.kv_cache
    described = (
        f"{backend}:{type(impl).__name__}:isa={getattr(layer, 'isa', None)}"
        f":{cache.dtype}:{tuple(cache.shape[1:])}"
    )
    write = getattr(impl, "do_kv_cache_update", None)
    heads, size = (
        getattr(layer, "num_kv_heads", None),
        getattr(layer, "head_size", None),
    )
    if write is None or heads is None or size is None or cache.numel() == 0:
        return described
    shape = list(cache.shape)
    shape[_block_dim(cache, num_blocks)] = 2
    scratch = torch.zeros(shape, dtype=cache.dtype, device=cache.device)
    key = probe_tokens(block_size, heads, size, dtype, cache.device, 1)
    value = probe_tokens(block_size, heads, size, dtype, cache.device, 7)
    slots = torch.arange(block_size, 2 * block_size, device=cache.device)
    try:
        write(layer, key, value, scratch, slots)
    except Exception as e:  # named by its parts instead (logged)
        logger.warning(
            "vllm-overlay: the KV-cache write of %s could not be probed (%s); its "
            "page layout is named by backend, kernel and shape",
            backend,
            e,
        )
        return described
    digest = hashlib.blake2b(_host_bytes(scratch.cpu()), digest_size=8).hexdigest()
    return f"{backend}:{tuple(shape[1:])}:{digest}"


def _attention_layers(vllm_config) -> dict:
    context = vllm_config.compilation_config.static_forward_context
    return {
        name: layer
        for name, layer in context.items()
        if hasattr(layer, "kv_cache") and hasattr(layer, "attn_backend")
    }


def worker_identity(worker) -> dict:
    """This worker's weights fingerprint and page layouts (collective_rpc)."""
    worker = getattr(worker, "worker", worker)
    runner = worker.model_runner
    model = runner.get_model() if hasattr(runner, "get_model") else runner.model
    config = getattr(runner, "kv_cache_config", None)
    num_blocks = getattr(config, "num_blocks", None)
    block_size = worker.vllm_config.cache_config.block_size
    dtype = worker.vllm_config.model_config.dtype  # what the KV write takes
    pages = set()
    layouts: dict = {}
    for layer in _attention_layers(worker.vllm_config).values():
        spec = getattr(layer, "kv_cache_spec", None)
        key = (
            type(layer.impl),
            getattr(layer, "isa", None),
            tuple(layer.kv_cache.shape[1:]),
        )
        if key not in layouts:
            size = getattr(spec, "block_size", None) or block_size
            layouts[key] = page_layout(layer, size, num_blocks, dtype)
        pages.add(layouts[key])
    with torch.no_grad():
        weights = weights_digest(model)
    return {"weights": weights, "pages": sorted(pages)}
