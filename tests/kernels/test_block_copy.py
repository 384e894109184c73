"""Block gather/scatter: Triton kernel and DMA path against the torch
reference and an independent per-block spec.

Random bytes, random block tables (any order, odd counts), round trips,
untouched blocks checked, bad input rejected.  On CPU the Triton kernel runs
in the interpreter (TRITON_INTERPRET=1, set in conftest.py).
"""

from __future__ import annotations

import os

import pytest
import torch

from vllm_overlay.core.ops.block_copy import BlockTable, dma_copy, gather, scatter

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float8_e4m3fn]
LAYOUTS = ["cross_layer", "cross_layer_views", "kv_first", "blocks_first"]
BLOCK_SIZES = [16, 128]
LAYERS, HEADS, HEAD_SIZE = 3, 2, 32


@pytest.fixture(autouse=True)
def _cpu_triton_needs_the_interpreter(request):
    """On a GPU machine run with TRITON_INTERPRET=0, Triton cannot launch
    on CPU tensors: those cases run in CI's interpreter instead."""
    callspec = getattr(request.node, "callspec", None)
    params = callspec.params if callspec else {}
    uses_triton = (
        params.get("method") == "triton" or "triton" in request.node.name.split("[")[0]
    )
    if (
        uses_triton
        and params.get("device") == "cpu"
        and os.environ.get("TRITON_INTERPRET") != "1"
    ):
        pytest.fail(
            "Triton on CPU tensors needs TRITON_INTERPRET=1: run `tox -e kernels` "
            "(it sets it) or `TRITON_INTERPRET=1 pytest tests/kernels`",
            pytrace=False,
        )


def random_cache(
    layout: str, num_blocks: int, block_size: int, dtype, device: str, seed: int = 0
):
    """(tensors, blocks_dim, per-block spec function)."""
    gen = torch.Generator().manual_seed(seed)
    L, H, D, B, N = LAYERS, HEADS, HEAD_SIZE, block_size, num_blocks

    def rand(*shape):
        raw = torch.randint(
            0,
            256,
            shape + (torch.empty((), dtype=dtype).element_size(),),
            generator=gen,
            dtype=torch.uint8,
        )
        return raw.view(dtype).view(shape).to(device)

    if layout.startswith("cross_layer"):
        buffer = rand(N, L, 2, H, B, D)
        spec = lambda b: buffer[b].reshape(-1)  # noqa: E731
        if layout == "cross_layer":
            return [buffer], 0, spec
        views = [buffer.permute(2, 0, 1, 3, 4, 5)[:, :, layer] for layer in range(L)]
        return views, 1, spec
    if layout == "kv_first":
        tensors = [rand(2, N, B, H, D) for _ in range(L)]
        return (
            tensors,
            1,
            lambda b: torch.cat([t[k, b].reshape(-1) for t in tensors for k in (0, 1)]),
        )
    tensors = [rand(N, 2, B, H, D) for _ in range(L)]
    return tensors, 0, lambda b: torch.cat([t[b].reshape(-1) for t in tensors])


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8).cpu()


def random_ids(num_blocks: int, n: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randperm(num_blocks, generator=gen)[:n].to(torch.int64)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("method", ["triton", "dma"])
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", LAYOUTS)
@torch.inference_mode()
def test_gather_matches_reference_and_spec(layout, dtype, block_size, method, device):
    num_blocks, n = 9, 5
    tensors, blocks_dim, spec = random_cache(
        layout, num_blocks, block_size, dtype, device
    )
    table = BlockTable.from_tensors(tensors, blocks_dim)
    expected_runs = {
        "cross_layer": 1,
        "cross_layer_views": LAYERS,
        "kv_first": 2 * LAYERS,
        "blocks_first": LAYERS,
    }[layout]
    assert table.runs_per_block == expected_runs
    ids = random_ids(num_blocks, n, seed=1)
    ref = torch.empty(n, table.block_bytes, dtype=torch.uint8, device=device)
    gather(table, ids, ref, method="reference")
    want = torch.stack([as_bytes(spec(int(b))) for b in ids])
    assert torch.equal(ref.cpu(), want)
    out = torch.full_like(ref, 0xAB)
    gather(table, ids, out, method=method)
    assert torch.equal(out.cpu(), want)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("method", ["triton", "dma", "reference"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
@torch.inference_mode()
def test_scatter_round_trip_and_untouched_blocks(layout, dtype, method, device):
    num_blocks, n = 11, 7
    tensors, blocks_dim, spec = random_cache(
        layout, num_blocks, 16, dtype, device, seed=2
    )
    table = BlockTable.from_tensors(tensors, blocks_dim)
    before = {b: as_bytes(spec(b)) for b in range(num_blocks)}
    ids = random_ids(num_blocks, n, seed=3)
    # Round trip: gather, clobber, scatter back.
    packed = torch.empty(n, table.block_bytes, dtype=torch.uint8, device=device)
    gather(table, ids, packed, method=method)
    scatter(table, ids, torch.zeros_like(packed), method="reference")
    assert all(not as_bytes(spec(b)).any() for b in ids.tolist())
    scatter(table, ids, packed, method=method)
    for b in ids.tolist():
        assert torch.equal(as_bytes(spec(b)), before[b])
    # New bytes into some blocks; every other block keeps its bytes.
    fresh = torch.randint(
        0,
        256,
        packed.shape,
        dtype=torch.uint8,
        generator=torch.Generator().manual_seed(4),
    )
    targets = random_ids(num_blocks, 3, seed=5)
    scatter(table, targets, fresh[:3].to(device), method=method)
    for i, b in enumerate(targets.tolist()):
        assert torch.equal(as_bytes(spec(b)), fresh[i])
    untouched = set(range(num_blocks)) - set(targets.tolist()) - set(ids.tolist())
    for b in untouched:
        assert torch.equal(as_bytes(spec(b)), before[b])


@pytest.mark.parametrize("method", ["triton", "dma", "reference"])
def test_bad_input_is_rejected(method):
    tensors, blocks_dim, _ = random_cache("kv_first", 5, 16, torch.float16, "cpu")
    table = BlockTable.from_tensors(tensors, blocks_dim)
    packed = torch.empty(2, table.block_bytes, dtype=torch.uint8)
    with pytest.raises(ValueError, match="duplicate"):
        scatter(table, torch.tensor([1, 1]), packed, method=method)
    with pytest.raises(IndexError, match=r"\[0, 5\)"):
        gather(table, torch.tensor([0, 5]), packed, method=method)
    with pytest.raises(ValueError, match="packed buffer"):
        gather(table, torch.tensor([0]), packed, method=method)
    with pytest.raises(ValueError, match="duplicate"):
        gather(
            table,
            torch.tensor([0, 1]),
            packed,
            method=method,
            packed_ids=torch.tensor([1, 1]),
        )
    with pytest.raises(IndexError, match=r"packed ids must be in \[0, 2\)"):
        gather(
            table,
            torch.tensor([0, 1]),
            packed,
            method=method,
            packed_ids=torch.tensor([0, 2]),
        )
    with pytest.raises(ValueError, match="int64"):
        gather(table, torch.tensor([0, 1], dtype=torch.int32), packed, method=method)


def test_empty_transfer_is_a_no_op():
    tensors, blocks_dim, _ = random_cache("cross_layer", 3, 16, torch.float32, "cpu")
    table = BlockTable.from_tensors(tensors, blocks_dim)
    empty = torch.empty(0, table.block_bytes, dtype=torch.uint8)
    for method in ("triton", "dma", "reference"):
        gather(table, torch.empty(0, dtype=torch.int64), empty, method=method)


def test_dma_merges_consecutive_blocks_of_a_cross_layer_buffer():
    tensors, _, spec = random_cache("cross_layer", 8, 16, torch.float16, "cpu")
    table = BlockTable.from_tensors(tensors, 0)
    ids = torch.tensor([2, 3, 4, 7, 0, 1])
    packed = torch.empty(6, table.block_bytes, dtype=torch.uint8)
    assert dma_copy(table, ids, packed, to_packed=True) == 3  # 2-4, 7, 0-1
    assert torch.equal(packed, torch.stack([as_bytes(spec(b)) for b in ids.tolist()]))
    per_layer, dim, _ = random_cache("kv_first", 8, 16, torch.float16, "cpu")
    table = BlockTable.from_tensors(per_layer, dim)
    packed = torch.empty(6, table.block_bytes, dtype=torch.uint8)
    assert dma_copy(table, ids, packed, to_packed=True) == 6 * 2 * LAYERS


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_gather_into_pinned_host_memory():
    tensors, blocks_dim, spec = random_cache("kv_first", 9, 16, torch.bfloat16, "cuda")
    table = BlockTable.from_tensors(tensors, blocks_dim)
    ids = random_ids(9, 5, seed=6)
    host = torch.empty(5, table.block_bytes, dtype=torch.uint8, pin_memory=True)
    gather(table, ids.cuda(), host, method="triton")
    torch.cuda.synchronize()
    assert torch.equal(host, torch.stack([as_bytes(spec(int(b))) for b in ids]))
    scatter(table, ids.cuda(), host, method="triton")
    torch.cuda.synchronize()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("method", ["triton", "dma", "reference"])
@pytest.mark.parametrize("layout", LAYOUTS)
@torch.inference_mode()
def test_packed_ids_place_blocks_anywhere_in_a_host_pool(layout, method, device):
    """Offloading writes device blocks to arbitrary host pool rows."""
    num_blocks, rows = 10, 13
    tensors, blocks_dim, spec = random_cache(
        layout, num_blocks, 16, torch.float16, device, seed=7
    )
    table = BlockTable.from_tensors(tensors, blocks_dim)
    pool = torch.zeros(rows, table.block_bytes, dtype=torch.uint8, device=device)
    ids = torch.tensor([4, 5, 6, 0, 9])
    rows_ids = torch.tensor([7, 8, 9, 2, 12])  # partly consecutive
    gather(table, ids, pool, method=method, packed_ids=rows_ids)
    for b, r in zip(ids.tolist(), rows_ids.tolist()):
        assert torch.equal(pool[r].cpu(), as_bytes(spec(b)))
    assert not pool[[0, 1, 3, 4, 5, 6, 10, 11]].any()
    # ...and back into other device blocks.
    before = {b: as_bytes(spec(b)) for b in range(num_blocks)}
    dst = torch.tensor([1, 2, 3, 8, 7])
    scatter(table, dst, pool, method=method, packed_ids=rows_ids)
    for b, src in zip(dst.tolist(), ids.tolist()):
        assert torch.equal(as_bytes(spec(b)), before[src])


def test_coarsen_groups_kernel_blocks_into_cache_blocks():
    for layout in LAYOUTS:
        tensors, blocks_dim, spec = random_cache(layout, 12, 16, torch.float16, "cpu")
        fine = BlockTable.from_tensors(tensors, blocks_dim)
        coarse = fine.coarsen(4)
        assert coarse.num_blocks == 3
        assert coarse.block_bytes == 4 * fine.block_bytes
        packed = torch.empty(1, coarse.block_bytes, dtype=torch.uint8)
        gather(coarse, torch.tensor([2]), packed, method="reference")
        fine_packed = torch.empty(4, fine.block_bytes, dtype=torch.uint8)
        gather(fine, torch.arange(8, 12), fine_packed, method="reference")
        # Same bytes; for per-layer tables the runs are grouped per segment.
        assert torch.equal(
            packed.flatten().sort().values, fine_packed.flatten().sort().values
        )
        if layout == "cross_layer":
            assert torch.equal(packed.flatten(), fine_packed.flatten())
            assert coarse.runs_per_block == 1
    with pytest.raises(ValueError, match="not a multiple"):
        fine.coarsen(5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "skew,word,vec", [(0, 4, 4), (8, 8, 1), (4, 4, 1), (2, 2, 1), (1, 1, 1)]
)
@torch.inference_mode()
def test_triton_variant_follows_alignment_and_odd_alignments_copy(
    device, skew, word, vec
):
    """Segments 16-byte aligned: the 128-bit variant; any other alignment
    (caches starting ``skew`` bytes into their storage, 48-byte runs):
    the fallback, with the same bytes."""
    from vllm_overlay.core.ops.block_copy import _word_size

    num_blocks, n = 7, 4
    gen = torch.Generator().manual_seed(8)
    raw = torch.randint(
        0, 256, (LAYERS, 2 * num_blocks * 48 + 16), dtype=torch.uint8, generator=gen
    ).to(device)
    tensors = [
        r[skew : skew + 2 * num_blocks * 48].view(2, num_blocks, 48) for r in raw
    ]
    table = BlockTable.from_tensors(tensors, 1)
    packed = torch.full((n, table.block_bytes), 0xAB, dtype=torch.uint8, device=device)
    assert _word_size(table, packed, table.segments[0].storage) == (word, vec)
    ids = random_ids(num_blocks, n, seed=9)
    gather(table, ids, packed, method="triton")
    want = torch.stack(
        [torch.cat([t[k, b] for t in tensors for k in (0, 1)]) for b in ids.tolist()]
    )
    assert torch.equal(packed.cpu(), want.cpu())
    fresh = torch.randint(0, 256, packed.shape, dtype=torch.uint8, generator=gen).to(
        device
    )
    before = [t.clone() for t in tensors]
    scatter(table, ids, fresh, method="triton")
    for i, b in enumerate(ids.tolist()):
        got = torch.cat([t[k, b] for t in tensors for k in (0, 1)])
        assert torch.equal(got.cpu(), fresh[i].cpu())
    for t, old in zip(tensors, before):
        keep = [b for b in range(num_blocks) if b not in ids.tolist()]
        assert torch.equal(t[:, keep], old[:, keep])


@pytest.mark.parametrize("device", DEVICES)
def test_triton_segment_table_is_cached_on_the_device(device):
    tensors, blocks_dim, _ = random_cache("kv_first", 6, 16, torch.float16, device)
    table = BlockTable.from_tensors(tensors, blocks_dim)
    packed = torch.empty(2, table.block_bytes, dtype=torch.uint8, device=device)
    gather(table, torch.tensor([1, 4]), packed, method="triton")
    _, meta, longest = table._device_meta[4]  # aligned: int32 words
    assert meta[0].device.type == torch.device(device).type
    gather(table, torch.tensor([0, 5]), packed, method="triton")
    assert table._device_meta[4][1] is meta
