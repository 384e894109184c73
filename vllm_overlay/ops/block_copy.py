"""Copy KV blocks between a paged KV cache and a packed buffer.

The cache side is described by ``BlockTable``: where block ``b`` lives, as a
list of contiguous byte runs (*segments*) at ``address + b * stride``.

* a cross-layer buffer ``[blocks, ...]``: one segment (the whole block);
* stock per-layer tensors, K/V first ``(2, blocks, ...)``: two segments per
  layer (K and V); blocks first ``(blocks, 2, ...)``: one per layer.

The packed side is a contiguous ``[n, block_bytes]`` buffer (device memory
or, on a GPU, pinned host memory written in place: zero copy); packed block
``i`` holds ``block_ids[i]``, its segments back to back.

Three ways to move the bytes, all giving the same bytes:
``reference_*`` (plain torch, the specification), ``triton_*`` (one kernel
launch per transfer, any number of blocks and layers), ``dma_*`` (one
``copy_`` per contiguous run; adjacent block ids are merged into one run).
Knows nothing of vLLM.
"""

from __future__ import annotations

import dataclasses
import math

import torch

_WORDS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


@dataclasses.dataclass(frozen=True)
class Segment:
    storage: torch.UntypedStorage  # memory the run lives in
    offset: int  # bytes from the storage start to the run of block 0
    stride: int  # bytes between the runs of consecutive blocks
    length: int  # bytes per block


def _is_dense(t: torch.Tensor) -> bool:
    """Elements of ``t`` fill one contiguous range (any dim order)."""
    expected = 1
    for size, stride in sorted(zip(t.shape, t.stride()), key=lambda p: p[1]):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


def segments_of(t: torch.Tensor, blocks_dim: int) -> list[Segment]:
    """The byte runs of one block of ``t`` (blocks along ``blocks_dim``),
    split along the outermost other dim until each run is contiguous."""
    es = t.element_size()
    one_block = t.select(blocks_dim, 0)
    if _is_dense(one_block):
        return [Segment(t.untyped_storage(), t.storage_offset() * es,
                        t.stride(blocks_dim) * es, one_block.numel() * es)]
    split = max((d for d in range(t.dim()) if d != blocks_dim),
                key=lambda d: t.stride(d))
    inner = blocks_dim - (split < blocks_dim)
    return [seg for j in range(t.shape[split])
            for seg in segments_of(t.select(split, j), inner)]


@dataclasses.dataclass(frozen=True)
class BlockTable:
    """Where each KV block lives: the same runs for every block id."""

    segments: tuple[Segment, ...]
    num_blocks: int
    device: torch.device

    def __post_init__(self) -> None:
        if not self.segments:
            raise ValueError("a block table needs at least one segment")
        for seg in self.segments:
            last = seg.offset + (self.num_blocks - 1) * seg.stride + seg.length
            if seg.offset < 0 or seg.length <= 0 or last > seg.storage.nbytes():
                raise ValueError(f"segment {seg.offset}+{seg.stride}*b "
                                 f"({seg.length} B) leaves its storage of "
                                 f"{seg.storage.nbytes()} B")

    @classmethod
    def from_tensors(cls, tensors: list[torch.Tensor],
                     blocks_dim: int) -> "BlockTable":
        """Per-layer caches (or one cross-layer buffer, ``blocks_dim=0``)."""
        num_blocks = {t.shape[blocks_dim] for t in tensors}
        devices = {t.device for t in tensors}
        if len(num_blocks) != 1 or len(devices) != 1:
            raise ValueError(f"tensors differ in block count {num_blocks} or "
                             f"device {devices}")
        segments = tuple(s for t in tensors for s in segments_of(t, blocks_dim))
        return cls(segments, num_blocks.pop(), devices.pop())

    @property
    def block_bytes(self) -> int:
        return sum(seg.length for seg in self.segments)

    @property
    def runs_per_block(self) -> int:
        return len(self.segments)

    def check(self, block_ids: torch.Tensor, packed: torch.Tensor,
              unique: bool) -> None:
        if block_ids.dtype != torch.int64 or block_ids.dim() != 1:
            raise ValueError("block_ids must be a 1-D int64 tensor")
        n = block_ids.numel()
        if not packed.is_contiguous() or packed.nbytes != n * self.block_bytes:
            raise ValueError(f"packed buffer must be contiguous with "
                             f"{n} x {self.block_bytes} B, got "
                             f"{tuple(packed.shape)} {packed.dtype}")
        if n:
            lo, hi = int(block_ids.min()), int(block_ids.max())
            if lo < 0 or hi >= self.num_blocks:
                raise IndexError(f"block ids must be in [0, {self.num_blocks})"
                                 f", got [{lo}, {hi}]")
            if unique and block_ids.unique().numel() != n:
                raise ValueError("duplicate destination block ids")


def _storage_as(storage: torch.UntypedStorage, dtype: torch.dtype,
                device: torch.device) -> torch.Tensor:
    word = torch.empty((), dtype=dtype).element_size()
    out = torch.empty(0, dtype=dtype, device=device)
    return out.set_(storage, 0, (storage.nbytes() // word,), (1,))


def _runs(table: BlockTable, seg: Segment) -> torch.Tensor:
    """uint8 view [num_blocks, length] of one segment."""
    base = _storage_as(seg.storage, torch.uint8, table.device)
    return base.as_strided((table.num_blocks, seg.length), (seg.stride, 1),
                           seg.offset)


def _packed_bytes(packed: torch.Tensor, n: int, block_bytes: int
                  ) -> torch.Tensor:
    return packed.view(torch.uint8).view(n, block_bytes)


# -- reference (plain torch) ---------------------------------------------------
def reference_gather(table: BlockTable, block_ids: torch.Tensor,
                     packed: torch.Tensor) -> None:
    table.check(block_ids, packed, unique=False)
    out, start = _packed_bytes(packed, block_ids.numel(), table.block_bytes), 0
    for seg in table.segments:
        out[:, start:start + seg.length] = _runs(table, seg).index_select(
            0, block_ids.to(table.device))
        start += seg.length


def reference_scatter(table: BlockTable, block_ids: torch.Tensor,
                      packed: torch.Tensor) -> None:
    table.check(block_ids, packed, unique=True)
    src, start = _packed_bytes(packed, block_ids.numel(), table.block_bytes), 0
    for seg in table.segments:
        _runs(table, seg).index_copy_(0, block_ids.to(table.device),
                                      src[:, start:start + seg.length].to(
                                          table.device))
        start += seg.length


# -- DMA: one copy per contiguous run ---------------------------------------------
def _merged_runs(block_ids: list[int]) -> list[tuple[int, int, int]]:
    """(packed index, first block id, count) for runs of consecutive ids."""
    runs: list[tuple[int, int, int]] = []
    for i, b in enumerate(block_ids):
        if runs and runs[-1][1] + runs[-1][2] == b:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((i, b, 1))
    return runs


def dma_copy(table: BlockTable, block_ids: torch.Tensor, packed: torch.Tensor,
             to_packed: bool, non_blocking: bool = True) -> int:
    """Copy with ``Tensor.copy_`` per run; returns the number of copies.

    A segment whose stride equals its length (a cross-layer buffer) lets a
    run of consecutive block ids move as one copy."""
    table.check(block_ids, packed, unique=not to_packed)
    ids = block_ids.tolist()
    buf, start, copies = _packed_bytes(packed, len(ids), table.block_bytes), 0, 0
    for seg in table.segments:
        runs = _runs(table, seg)
        merge = seg.stride == seg.length and len(table.segments) == 1
        spans = _merged_runs(ids) if merge else [(i, b, 1) for i, b in
                                                 enumerate(ids)]
        for i, b, count in spans:
            cache = runs[b:b + count]
            host = buf[i:i + count, start:start + seg.length]
            if to_packed:
                host.copy_(cache, non_blocking=non_blocking)
            else:
                cache.copy_(host, non_blocking=non_blocking)
            copies += 1
        start += seg.length
    return copies


# -- Triton: one launch per transfer ------------------------------------------------
def _word_size(table: BlockTable, packed: torch.Tensor,
               ref: torch.UntypedStorage) -> int:
    ref_ptr = ref.data_ptr()
    values = [packed.data_ptr(), table.block_bytes]
    for seg in table.segments:
        values += [seg.storage.data_ptr() + seg.offset - ref_ptr, seg.stride,
                   seg.length]
    gcd = math.gcd(*values)
    return next(w for w in (8, 4, 2, 1) if gcd % w == 0)


def triton_copy(table: BlockTable, block_ids: torch.Tensor,
                packed: torch.Tensor, to_packed: bool,
                chunk_words: int = 1024) -> None:
    """One kernel launch moves every run of every block.

    On a GPU ``packed`` may be pinned host memory (written over PCIe by the
    kernel, zero copy).  On CPU it runs with ``TRITON_INTERPRET=1``."""
    from vllm_overlay.ops.triton_kernels import copy_blocks_kernel

    table.check(block_ids, packed, unique=not to_packed)
    n = block_ids.numel()
    if n == 0:
        return
    ref = table.segments[0].storage
    word = _word_size(table, packed, ref)
    wdtype = _WORDS[word]
    dev = table.device
    ref_words = _storage_as(ref, wdtype, dev)
    meta = torch.tensor(
        [[(s.storage.data_ptr() + s.offset - ref.data_ptr()) // word
          for s in table.segments],
         [s.stride // word for s in table.segments],
         [0] * len(table.segments),
         [s.length // word for s in table.segments]], dtype=torch.int64)
    meta[2, 1:] = torch.cumsum(meta[3], 0)[:-1]
    meta = meta.to(dev)
    longest = int(meta[3].max())
    chunk = min(chunk_words, 1 << (longest - 1).bit_length())
    grid = (n, len(table.segments), triton_cdiv(longest, chunk))
    copy_blocks_kernel[grid](
        ref_words, packed.view(wdtype), block_ids.to(dev), meta[0], meta[1],
        meta[2], meta[3], table.block_bytes // word,
        TO_PACKED=to_packed, CHUNK=chunk)


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def gather(table: BlockTable, block_ids: torch.Tensor, packed: torch.Tensor,
           method: str = "triton") -> None:
    """Cache blocks ``block_ids`` -> packed buffer."""
    _METHODS[method](table, block_ids, packed, True)


def scatter(table: BlockTable, block_ids: torch.Tensor, packed: torch.Tensor,
            method: str = "triton") -> None:
    """Packed buffer -> cache blocks ``block_ids`` (ids must be unique)."""
    _METHODS[method](table, block_ids, packed, False)


_METHODS = {
    "reference": lambda t, ids, p, to: (reference_gather if to
                                        else reference_scatter)(t, ids, p),
    "dma": lambda t, ids, p, to: dma_copy(t, ids, p, to),
    "triton": lambda t, ids, p, to: triton_copy(t, ids, p, to),
}
