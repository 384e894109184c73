"""The offloading workers' one copy step (core/offload/host_copy) writes and
reads the same bytes with every block_copy method, in both host layouts:
the packed one (vLLM 0.11.2's pool) and the tensor-major chunk (vLLM
0.32's), chunks entered part way, rows at a stride.  On CPU the Triton
kernel runs in its interpreter (conftest.py)."""

from __future__ import annotations

import os

import pytest
import torch

from vllm_overlay.core.offload.host_copy import HostBlocks, HostLayout
from vllm_overlay.core.ops.block_copy import BlockTable

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
BLOCKS = 12


def layouts(device: str):
    gen = torch.Generator().manual_seed(0)
    kv = [
        torch.randn(2, BLOCKS, 2, 16, generator=gen).to(device) for _ in range(2)
    ]  # K/V first: two runs per layer
    pages = [256, 128]
    rows = {
        0: torch.randn(BLOCKS, 64, generator=gen).view(torch.int8).to(device),
        1: torch.randn(BLOCKS, 32, generator=gen).view(torch.int8).to(device),
    }
    return {
        "packed": (HostLayout.packed(BlockTable.from_tensors(kv, 1)), kv),
        "tensor_major": (HostLayout.tensor_major(pages, rows, 2), list(rows.values())),
    }


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout_name", ["packed", "tensor_major"])
@pytest.mark.parametrize("method", ["reference", "triton"])
def test_every_method_moves_the_dma_bytes(device, layout_name, method):
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    if method == "triton" and device == "cpu" and not interpreted:
        pytest.fail(
            "Triton on CPU tensors needs TRITON_INTERPRET=1: run `tox -e kernels` "
            "(it sets it) or `TRITON_INTERPRET=1 pytest tests/kernels`",
            pytrace=False,
        )
    layout, tensors = layouts(device)[layout_name]
    places = torch.tensor([3, 0, 4, 5], dtype=torch.int64)
    blocks = torch.tensor([7, 2, 3, 4], dtype=torch.int64)
    hosts = {}
    for how in ("dma", method):
        host = torch.zeros(6, layout.row_bytes + 32, dtype=torch.uint8)
        if device == "cuda":
            host = host.pin_memory()
        host = host[:, : layout.row_bytes]  # rows at a stride
        HostBlocks(layout, host, how).copy(blocks, places, True)
        if device == "cuda":
            torch.cuda.synchronize()
        hosts[how] = host
    assert hosts["dma"].any()
    assert torch.equal(hosts[method], hosts["dma"])
    # Loads: the stored blocks come back into cleared caches.
    saved = [t.clone() for t in tensors]
    for t in tensors:
        t.zero_()
    HostBlocks(layout, hosts[method], method).copy(blocks, places, False)
    if device == "cuda":
        torch.cuda.synchronize()
    dim = 1 if layout_name == "packed" else 0
    for t, old in zip(tensors, saved):
        assert torch.equal(t.index_select(dim, blocks), old.index_select(dim, blocks))
        assert t.count_nonzero() == t.index_select(dim, blocks).count_nonzero()
