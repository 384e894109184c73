# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Block gather/scatter (vllm.v1.kv_offload.block_copy) against a plain
torch reference: cross-layer buffers and per-layer caches (K/V first or
blocks first), random block tables, odd sizes, round trips.  The Triton
kernel runs on a GPU, or on CPU in Triton's interpreter (TRITON_INTERPRET=1)
when Triton is installed; otherwise its cases are skipped."""

import importlib
import importlib.util
import os
import sys

import pytest
import torch

from vllm.v1.kv_offload.block_copy import (
    BlockTable,
    Segment,
    gather,
    scatter,
    segments_of,
)

KERNEL_MODULE = "vllm.v1.kv_offload.block_copy_triton"
METHODS = ["reference", "dma", "triton"]


@pytest.fixture
def device():
    return "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def method(request, monkeypatch):
    """The copy method; for "triton" without a GPU, the kernel module is
    loaded again with Triton's interpreter (vllm.triton_utils disables
    Triton when no GPU driver is active)."""
    name = request.param
    if name != "triton" or torch.cuda.is_available():
        from vllm.triton_utils import HAS_TRITON

        if name == "triton" and not HAS_TRITON:
            pytest.skip("Triton is not usable here")
        return name
    if importlib.util.find_spec("triton") is None:
        pytest.skip("Triton is not installed")
    import vllm.triton_utils as triton_utils

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(triton_utils, "triton", importlib.import_module("triton"))
    monkeypatch.setattr(triton_utils, "tl", importlib.import_module("triton.language"))
    monkeypatch.delitem(sys.modules, KERNEL_MODULE, raising=False)
    importlib.import_module(KERNEL_MODULE)
    assert os.environ["TRITON_INTERPRET"] == "1"
    return name


def expected_rows(tensors, blocks_dim, block_ids):
    """The packed bytes of BLOCK_IDS, computed with plain torch: each
    block's data, layer after layer, in the tensors' logical order (for K/V
    first caches: K then V)."""
    rows = []
    for b in block_ids:
        rows.append(
            torch.cat(
                [
                    t.select(blocks_dim, b).contiguous().view(-1).view(torch.uint8)
                    for t in tensors
                ]
            )
        )
    return torch.stack(rows)


def random_caches(kind, num_blocks, dtype, device, generator):
    """(tensors, blocks_dim): a cross-layer buffer or per-layer caches."""
    heads, tokens, head_size, layers = 1, 3, 5, 3  # odd sizes on purpose

    def rand(*shape):
        raw = torch.randint(0, 256, shape, generator=generator, dtype=torch.uint8)
        return raw.to(dtype).to(device)

    if kind == "cross_layer":
        return [rand(num_blocks, layers, 2, heads, tokens, head_size)], 0
    if kind == "kv_first":
        return [rand(2, num_blocks, heads, tokens, head_size) for _ in range(layers)], 1
    assert kind == "blocks_first"
    return [rand(num_blocks, 2, tokens, heads, head_size) for _ in range(layers)], 0


def test_segments_of_each_layout():
    cross = torch.zeros(10, 3, 2, 2, 4, 8)
    (seg,) = segments_of(cross, 0)
    block_bytes = 3 * 2 * 2 * 4 * 8 * 4
    assert (seg.offset, seg.stride, seg.length) == (0, block_bytes, block_bytes)

    kv_first = torch.zeros(2, 10, 2, 4, 8)
    k, v = segments_of(kv_first, 1)
    per_block = 2 * 4 * 8 * 4
    assert (k.offset, k.stride, k.length) == (0, per_block, per_block)
    assert (v.offset, v.stride, v.length) == (10 * per_block, per_block, per_block)

    table = BlockTable.from_tensors([torch.zeros(2, 10, 2, 4, 8)] * 3, 1)
    assert table.runs_per_block == 6
    assert table.block_bytes == 6 * per_block
    assert BlockTable.from_tensors([cross], 0).runs_per_block == 1


@pytest.mark.parametrize("method", METHODS, indirect=True)
@pytest.mark.parametrize("kind", ["cross_layer", "kv_first", "blocks_first"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.uint8])
def test_gather_scatter_match_torch(method, kind, dtype, device):
    generator = torch.Generator().manual_seed(hash((kind, str(dtype))) % 2**31)
    num_blocks = 13
    tensors, blocks_dim = random_caches(kind, num_blocks, dtype, device, generator)
    table = BlockTable.from_tensors(tensors, blocks_dim)
    block_ids = torch.randperm(num_blocks, generator=generator)[:7]
    want = expected_rows(tensors, blocks_dim, block_ids.tolist())

    # gather into rows 0..n-1, then into a shuffled set of rows of a larger
    # buffer
    packed = torch.zeros(7, table.block_bytes, dtype=torch.uint8, device=device)
    gather(table, block_ids, packed, method)
    assert torch.equal(packed.cpu(), want.cpu())

    rows = torch.randperm(11, generator=generator)[:7]
    spread = torch.zeros(11, table.block_bytes, dtype=torch.uint8, device=device)
    gather(table, block_ids, spread, method, packed_ids=rows)
    assert torch.equal(spread[rows.to(device)].cpu(), want.cpu())
    untouched = sorted(set(range(11)) - set(rows.tolist()))
    assert not spread[untouched].any()

    # scatter into zeroed caches: the same blocks, nothing else written
    targets = [torch.zeros_like(t) for t in tensors]
    target_table = BlockTable.from_tensors(targets, blocks_dim)
    scatter(target_table, block_ids, spread, method, packed_ids=rows)
    for source, target in zip(tensors, targets):
        for b in range(num_blocks):
            got = target.select(blocks_dim, b)
            if b in block_ids.tolist():
                assert torch.equal(got, source.select(blocks_dim, b))
            else:
                assert not got.any()


@pytest.mark.parametrize("method", METHODS, indirect=True)
def test_round_trip_through_another_block_order(method, device):
    """Blocks gathered from one cache land in other block ids of another,
    with a coarsened table (cache blocks of two kernel blocks)."""
    generator = torch.Generator().manual_seed(7)
    tensors, blocks_dim = random_caches(
        "kv_first", 12, torch.float16, device, generator
    )
    kernel_table = BlockTable.from_tensors(tensors, blocks_dim)
    table = kernel_table.coarsen(2)
    # consecutive kernel blocks of K (and of V) are adjacent: one longer run
    assert table.num_blocks == 6 and table.runs_per_block == 6
    assert table.block_bytes == 2 * kernel_table.block_bytes
    packed = torch.empty(3, table.block_bytes, dtype=torch.uint8, device=device)
    gather(table, torch.tensor([5, 0, 2]), packed, method)
    targets = [torch.zeros_like(t) for t in tensors]
    scatter(
        BlockTable.from_tensors(targets, blocks_dim).coarsen(2),
        torch.tensor([1, 3, 4]),
        packed,
        method,
    )
    for source, target in zip(tensors, targets):
        for src, dst in ((5, 1), (0, 3), (2, 4)):
            for j in range(2):  # both kernel blocks of the cache block
                assert torch.equal(target[:, 2 * dst + j], source[:, 2 * src + j])
        assert not target[:, 0:2].any() and not target[:, 4:6].any()


def test_dma_merges_consecutive_blocks_of_a_cross_layer_buffer():
    buffer = torch.arange(10 * 64, dtype=torch.float32).view(10, 64)
    table = BlockTable.from_tensors([buffer], 0)
    packed = torch.empty(5, table.block_bytes, dtype=torch.uint8)
    ids = torch.tensor([3, 4, 5, 8, 9])
    assert gather(table, ids, packed, "dma") == 2
    assert torch.equal(packed.view(torch.float32), buffer[ids])
    # a per-layer cache: one copy per run (2 per block and layer)
    per_layer = [torch.zeros(2, 10, 4, 4) for _ in range(3)]
    table = BlockTable.from_tensors(per_layer, 1)
    packed = torch.empty(5, table.block_bytes, dtype=torch.uint8)
    assert gather(table, ids, packed, "dma") == 5 * 6


def test_bad_transfers_are_refused():
    table = BlockTable.from_tensors([torch.zeros(8, 2, 16)], 0)
    packed = torch.zeros(2, table.block_bytes, dtype=torch.uint8)
    with pytest.raises(IndexError, match="block ids"):
        gather(table, torch.tensor([1, 8]), packed, "reference")
    with pytest.raises(ValueError, match="duplicate"):
        scatter(table, torch.tensor([3, 3]), packed, "reference")
    with pytest.raises(ValueError, match="int64"):
        gather(table, torch.tensor([1, 2], dtype=torch.int32), packed, "reference")
    with pytest.raises(ValueError, match="rows"):
        gather(table, torch.tensor([1, 2, 3]), packed, "reference")
    with pytest.raises(ValueError, match="contiguous rows"):
        gather(table, torch.tensor([1]), torch.zeros(100, dtype=torch.uint8), "dma")
    storage = torch.zeros(4).untyped_storage()
    with pytest.raises(ValueError, match="leaves its storage"):
        BlockTable((Segment(storage, 0, 8, 8),), 3, torch.device("cpu"))
