"""The one copy step of both offloading workers (core/offload/host_copy)
against plain torch: the packed layout (vLLM 0.11.2's host pool) is
block_copy's packed block; the tensor-major layout (vLLM 0.32's chunk) puts
each KV tensor's pages of a chunk back to back, tensor after tensor, a
tensor left out keeping its place; rows at a stride; runs that cross rows
only when the rows lie back to back; counts; bad layouts and memory
refused.  No vLLM."""

from __future__ import annotations

import random

import pytest
import torch

from vllm_overlay.core.offload.host_copy import HostBlocks, HostLayout, HostPart
from vllm_overlay.core.ops.block_copy import BlockTable, reference_copy

BLOCKS = 20


def ids(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def rand_bytes(*shape, seed=0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(-128, 127, shape, dtype=torch.int8, generator=gen)


@pytest.mark.parametrize("cache", ["kv_first", "cross_layer"])
@pytest.mark.parametrize("seed", [0, 1])
def test_packed_layout_is_block_copys_packed_block(cache, seed):
    """vLLM 0.11.2's host pool: host row h is one block packed as the
    table describes it, byte for byte what block_copy's reference writes."""
    gen = torch.Generator().manual_seed(seed)
    if cache == "kv_first":  # two runs (K, V) per layer and block
        tensors = [torch.randn(2, BLOCKS, 4, 8, generator=gen) for _ in range(3)]
        table = BlockTable.from_tensors(tensors, 1)
    else:  # one run per block
        tensors = [torch.randn(BLOCKS, 3, 2, 4, 8, generator=gen)]
        table = BlockTable.from_tensors(tensors, 0)
    rng = random.Random(seed)
    n = rng.randint(2, 8)
    blocks, places = ids(rng.sample(range(BLOCKS), n)), ids(rng.sample(range(10), n))
    layout = HostLayout.packed(table)
    host = torch.zeros(10, layout.row_bytes, dtype=torch.uint8)
    expect = torch.zeros_like(host)
    stats = HostBlocks(layout, host, "dma").copy(blocks, places, True)
    reference_copy(table, blocks, expect, True, places)
    assert torch.equal(host, expect) and host.any()
    assert (stats.jobs, stats.blocks, stats.bytes) == (1, n, n * table.block_bytes)
    if cache == "kv_first":  # one copy per run and block
        assert stats.copy_calls == 6 * n
    else:  # blocks consecutive on both sides merge into one copy
        pairs = list(zip(blocks.tolist(), places.tolist()))
        breaks = sum(
            (b1, p1) != (b0 + 1, p0 + 1) for (b0, p0), (b1, p1) in zip(pairs, pairs[1:])
        )
        assert stats.copy_calls == 1 + breaks
    # Back into other blocks: the same bytes as the reference load.
    before = [t.clone() for t in tensors]
    dst = ids(rng.sample([b for b in range(BLOCKS) if b not in blocks.tolist()], n))
    HostBlocks(layout, host, "dma").copy(dst, places, False)
    after = [t.clone() for t in tensors]
    for t, old in zip(tensors, before):
        t.copy_(old)
    reference_copy(table, dst, expect, False, places)
    assert all(torch.equal(a, t) for a, t in zip(after, tensors))


def tensor_major_reference(rows, pages, per, blocks, places, num_rows):
    """The chunk of vLLM 0.32's worker, built by hand: row ``p // per``;
    tensor ``i`` at ``per * sum(pages[:i])``, its block ``p % per`` one page
    further each; a tensor not in ``rows`` left zero."""
    out = torch.zeros(num_rows, per * sum(pages), dtype=torch.int8)
    for b, p in zip(blocks, places):
        offset = 0
        for i, page in enumerate(pages):
            if i in rows:
                at = offset + (p % per) * page
                out[p // per, at : at + page] = rows[i][b]
            offset += per * page
    return out


@pytest.mark.parametrize("per", [1, 2, 4])
@pytest.mark.parametrize("padded", [False, True])  # rows at a stride
def test_tensor_major_layout_matches_the_hand_built_chunk(per, padded):
    pages = [96, 40, 200]
    rows = {i: rand_bytes(BLOCKS, pages[i], seed=i) for i in (0, 2)}  # 1 unused
    layout = HostLayout.tensor_major(pages, rows, per)
    assert layout.row_bytes == per * 336 and layout.block_bytes == 296
    chunks = 6
    memory = torch.zeros(chunks, layout.row_bytes + 64 * padded, dtype=torch.int8)
    host = memory[:, : layout.row_bytes]
    rng = random.Random(per)
    n = rng.randint(3, min(9, chunks * per))
    blocks = rng.sample(range(BLOCKS), n)
    places = rng.sample(range(chunks * per), n)
    moved = HostBlocks(layout, host, "dma")
    assert not moved.flat  # two tensors in a row: one copy per row and part
    stats = moved.copy(ids(blocks), ids(places), True)
    expect = tensor_major_reference(rows, pages, per, blocks, places, chunks)
    assert torch.equal(host, expect)
    assert not memory[:, layout.row_bytes :].any()  # the padding untouched
    assert stats.bytes == n * 296
    # Load back into cleared tensors: exactly the stored blocks come back.
    saved = {i: t.clone() for i, t in rows.items()}
    for t in rows.values():
        t.zero_()
    moved.copy(ids(blocks), ids(places), False)
    for i, t in rows.items():
        assert torch.equal(t[blocks], saved[i][blocks])
        others = [b for b in range(BLOCKS) if b not in blocks]
        assert not t[others].any()


def test_one_tensor_filling_back_to_back_rows_copies_runs_across_rows():
    """Cross-layer blocks (one tensor) in contiguous chunks: places are
    packed rows, so blocks consecutive on both sides are one copy even
    across a chunk boundary; with rows at a stride, one per chunk."""
    page, per = 64, 2
    rows = {0: rand_bytes(BLOCKS, page)}
    layout = HostLayout.tensor_major([page], rows, per)
    flat = HostBlocks(layout, torch.zeros(4, per * page, dtype=torch.int8), "dma")
    wide = torch.zeros(4, per * page + 16, dtype=torch.int8)[:, : per * page]
    apart = HostBlocks(layout, wide, "dma")
    assert flat.flat and not apart.flat
    blocks, places = ids([5, 6, 7]), ids([1, 2, 3])  # chunk 0 slot 1 .. chunk 1
    assert flat.copy(blocks, places, True).copy_calls == 1
    assert apart.copy(blocks, places, True).copy_calls == 2
    assert torch.equal(flat.host, apart.host)
    assert torch.equal(flat.host.view(-1, page)[1:4], rows[0][5:8])


def test_bad_layouts_and_memory_are_refused():
    table = BlockTable.from_tensors([rand_bytes(BLOCKS, 32)], 0)
    with pytest.raises(ValueError, match="does not hold"):
        HostLayout((HostPart(table, 8, 32),), 1, 32)  # leaves the row
    with pytest.raises(ValueError, match="does not hold"):
        HostLayout((HostPart(table, 0, 32),), 2, 64)  # one place, not two
    with pytest.raises(ValueError, match="parts"):
        HostLayout((), 1, 32)
    layout = HostLayout.packed(table)
    with pytest.raises(ValueError, match="rows of 32 one-byte"):
        HostBlocks(layout, torch.zeros(4, 16, dtype=torch.int8), "dma")
    with pytest.raises(ValueError, match="rows of 32 one-byte"):
        HostBlocks(layout, torch.zeros(4, 8), "dma")  # float32: 4-byte elements
    with pytest.raises(ValueError, match="copy method"):
        HostBlocks(layout, torch.zeros(4, 32, dtype=torch.int8), "memcpy")
