"""The pool's namespace differs exactly where the page bytes differ (issue
39, 1), shown with vLLM 0.32's real CPU attention kernels.

The same K/V (random, not the probe's) is written into a page by each
CPU_ATTN kernel that runs on this host (``vec`` and ``vec16``: any x86 with
AVX2 or AVX-512), by vLLM's own ``CPUAttentionBackendImpl.do_kv_cache_update``
with the layer's ISA set as its metadata builder sets it, and by a row-major
reference (token after token in each head, as a GPU's page is).  The
namespace of each is the pool tier's, built with the page layout that
``worker_identity.page_layout`` measures for that kernel.  For every pair:
equal page bytes <=> equal namespace.  (On this host vec and vec16 write
the same bytes, so they share; the reference writes other bytes, so it
does not.  AMX needs AMX tiles and bfloat16, which this host lacks.)
"""

from __future__ import annotations

import itertools
import types
import unittest.mock

import pytest
import torch
from vllm.v1.attention.backends import cpu_attn
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)

from vllm_overlay.core.pool.keys import namespace_tag
from vllm_overlay.integration.v0_32.pool_tier import identity
from vllm_overlay.integration.v0_32.worker_identity import page_layout

HEADS, BLOCKS = 2, 3


class RowMajor:
    """A reference KV write: each head's page holds its tokens' K rows,
    then their V rows (``[blocks, heads, 2 * block_size, head_size]``
    filled row by row), as a row-major GPU page orders them."""

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping):
        block_size = kv_cache.shape[2]
        for t, slot in enumerate(slot_mapping.tolist()):
            b, i = divmod(slot, block_size)
            kv = kv_cache.view(kv_cache.shape[0], HEADS, 2 * block_size, -1)
            kv[b, :, i] = key[t]
            kv[b, :, block_size + i] = value[t]


def layer(writer: str, block_size: int, head_size: int, dtype):
    """An attention layer as vLLM 0.32's CPU model runner binds it: its
    backend, its impl, the ISA its metadata builder set, its KV cache
    (``[blocks, kv heads, block_size, 2 * head_size]``)."""
    if writer == "rowmajor":
        impl = RowMajor()
    else:
        # (its constructor reads the model's dtype from the current config)
        config = types.SimpleNamespace(model_config=types.SimpleNamespace(dtype=dtype))
        with unittest.mock.patch.object(
            cpu_attn, "get_current_vllm_config", lambda: config
        ):
            impl = cpu_attn.CPUAttentionBackendImpl(
                HEADS, head_size, 1.0, HEADS, None, None, "auto"
            )
    return types.SimpleNamespace(
        attn_backend=cpu_attn.CPUAttentionBackend,
        impl=impl,
        isa=None if writer == "rowmajor" else writer,
        kv_cache=torch.zeros(BLOCKS, HEADS, block_size, 2 * head_size, dtype=dtype),
        num_kv_heads=HEADS,
        head_size=head_size,
        _k_scale_float=1.0,
        _v_scale_float=1.0,
    )


def page_bytes(writer: str, block_size: int, head_size: int, dtype) -> bytes:
    """The pages after the same random K/V went through ``writer``."""
    gen = torch.Generator().manual_seed(3)
    n = 2 * block_size - 5  # a full block and a partial one
    key = torch.randn(n, HEADS, head_size, generator=gen).to(dtype)
    value = torch.randn(n, HEADS, head_size, generator=gen).to(dtype)
    target = layer(writer, block_size, head_size, dtype)
    target.impl.do_kv_cache_update(
        target, key, value, target.kv_cache, torch.arange(n, dtype=torch.int64)
    )
    return target.kv_cache.view(torch.uint8).numpy().tobytes()


def namespace(writer: str, block_size: int, head_size: int, dtype) -> bytes:
    pages = page_layout(
        layer(writer, block_size, head_size, dtype), block_size, BLOCKS, dtype
    )
    config = OffloadingConfig(
        groups=(OffloadingGroupConfig(block_size, ("l0",), 0),),
        worker_kv_bytes_per_block=2 * HEADS * block_size * head_size * dtype.itemsize,
        enable_kv_cache_events=False,
        extra_config={"kv_identity": ["model-hash=m", "weights=w"]},
        engine_id="e",
        model=OffloadingModelConfig("tiny", str(dtype)),
        cache=OffloadingCacheConfig(block_size, 1),
        parallel=OffloadingParallelConfig(0, 1, 1, 1, 1, 1, 0, 1, None, True),
    )
    return namespace_tag(
        identity.tier_factors(config, 4096, "", ["weights=w", "pages=" + pages])
    )


WRITERS = ("vec", "vec16", "rowmajor")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size, head_size", [(32, 64), (16, 128), (64, 32)])
def test_namespaces_differ_exactly_where_page_bytes_differ(
    block_size, head_size, dtype
):
    pages = {w: page_bytes(w, block_size, head_size, dtype) for w in WRITERS}
    spaces = {w: namespace(w, block_size, head_size, dtype) for w in WRITERS}
    for a, b in itertools.combinations(WRITERS, 2):
        assert (pages[a] == pages[b]) == (spaces[a] == spaces[b]), (a, b)
    # What that shows on this host: the two kernels share, the reference
    # (a row-major page) does not, though all three say "CPU_ATTN".
    assert pages["vec"] == pages["vec16"] and spaces["vec"] == spaces["vec16"]
    assert pages["vec"] != pages["rowmajor"] and spaces["vec"] != spaces["rowmajor"]


def test_a_backend_that_cannot_be_probed_is_named_by_its_parts():
    """No ``do_kv_cache_update`` (a backend writing KV inside its forward):
    the layout is named by backend, impl class, ISA and cache shape."""
    target = layer("vec", 32, 64, torch.float32)
    target.impl = types.SimpleNamespace()
    described = page_layout(target, 32, BLOCKS, torch.float32)
    assert described == "CPU_ATTN:SimpleNamespace:isa=vec:torch.float32:(2, 32, 128)"
