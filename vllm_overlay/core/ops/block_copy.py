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
        return [
            Segment(
                t.untyped_storage(),
                t.storage_offset() * es,
                t.stride(blocks_dim) * es,
                one_block.numel() * es,
            )
        ]
    split = max(
        (d for d in range(t.dim()) if d != blocks_dim), key=lambda d: t.stride(d)
    )
    inner = blocks_dim - (split < blocks_dim)
    return [
        seg
        for j in range(t.shape[split])
        for seg in segments_of(t.select(split, j), inner)
    ]


@dataclasses.dataclass(frozen=True)
class BlockTable:
    """Where each KV block lives: the same runs for every block id."""

    segments: tuple[Segment, ...]
    num_blocks: int
    device: torch.device
    # Triton segment tables already on ``device``, by word size (no
    # host-to-device copy per transfer); filled by ``triton_copy``.
    _device_meta: dict = dataclasses.field(
        default_factory=dict, init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        if not self.segments:
            raise ValueError("a block table needs at least one segment")
        for seg in self.segments:
            last = seg.offset + (self.num_blocks - 1) * seg.stride + seg.length
            if seg.offset < 0 or seg.length <= 0 or last > seg.storage.nbytes():
                raise ValueError(
                    f"segment {seg.offset}+{seg.stride}*b "
                    f"({seg.length} B) leaves its storage of "
                    f"{seg.storage.nbytes()} B"
                )

    @classmethod
    def from_tensors(cls, tensors: list[torch.Tensor], blocks_dim: int) -> BlockTable:
        """Per-layer caches (or one cross-layer buffer, ``blocks_dim=0``)."""
        num_blocks = {t.shape[blocks_dim] for t in tensors}
        devices = {t.device for t in tensors}
        if len(num_blocks) != 1 or len(devices) != 1:
            raise ValueError(
                f"tensors differ in block count {num_blocks} or device {devices}"
            )
        segments = tuple(s for t in tensors for s in segments_of(t, blocks_dim))
        return cls(segments, num_blocks.pop(), devices.pop())

    @property
    def block_bytes(self) -> int:
        return sum(seg.length for seg in self.segments)

    @property
    def runs_per_block(self) -> int:
        return len(self.segments)

    def coarsen(self, factor: int) -> BlockTable:
        """The same memory seen in blocks of ``factor`` consecutive blocks
        (a cache block made of several kernel blocks)."""
        if factor == 1:
            return self
        if self.num_blocks % factor:
            raise ValueError(f"{self.num_blocks} blocks are not a multiple of {factor}")
        segments = []
        for seg in self.segments:
            if seg.stride == seg.length:  # dense: one longer run
                segments.append(
                    dataclasses.replace(
                        seg, stride=seg.stride * factor, length=seg.length * factor
                    )
                )
            else:
                segments += [
                    dataclasses.replace(
                        seg,
                        offset=seg.offset + j * seg.stride,
                        stride=seg.stride * factor,
                    )
                    for j in range(factor)
                ]
        return BlockTable(tuple(segments), self.num_blocks // factor, self.device)

    def packed_rows(self, packed: torch.Tensor) -> int:
        if not packed.is_contiguous() or packed.nbytes % self.block_bytes:
            raise ValueError(
                f"packed buffer must be contiguous rows of "
                f"{self.block_bytes} B, got "
                f"{tuple(packed.shape)} {packed.dtype}"
            )
        return packed.nbytes // self.block_bytes

    def check(
        self,
        block_ids: torch.Tensor,
        packed: torch.Tensor,
        packed_ids: torch.Tensor | None,
        to_packed: bool,
    ) -> torch.Tensor:
        """Validate a transfer; returns the packed ids (default 0..n-1)."""
        for name, ids in (("block_ids", block_ids), ("packed_ids", packed_ids)):
            if ids is not None and (ids.dtype != torch.int64 or ids.dim() != 1):
                raise ValueError(f"{name} must be a 1-D int64 tensor")
        n = block_ids.numel()
        rows = self.packed_rows(packed)
        if packed_ids is None:
            if rows != n:
                raise ValueError(
                    f"packed buffer must be contiguous with "
                    f"{n} x {self.block_bytes} B, got {rows} rows"
                )
            packed_ids = torch.arange(n, dtype=torch.int64, device=block_ids.device)
        elif packed_ids.numel() != n:
            raise ValueError(f"{n} block ids but {packed_ids.numel()} packed ids")
        if n and not block_ids.is_cuda and not packed_ids.is_cuda:
            # Host ids (the usual case): plain Python is cheapest.
            b, p = block_ids.tolist(), packed_ids.tolist()
            b_lo, b_hi, p_lo, p_hi = min(b), max(b), min(p), max(p)
            dup = len(set(p if to_packed else b)) != n
        elif n:
            # One device sync at most (ids may live on the GPU).
            dst = (packed_ids if to_packed else block_ids).sort().values
            dev = block_ids.device
            b_lo, b_hi, p_lo, p_hi, dup = torch.stack(
                [
                    block_ids.min(),
                    block_ids.max(),
                    packed_ids.min().to(dev),
                    packed_ids.max().to(dev),
                    (dst[1:] == dst[:-1]).any().to(dev, torch.int64),
                ]
            ).tolist()
        if n:
            for name, lo, hi, limit in (
                ("block", b_lo, b_hi, self.num_blocks),
                ("packed", p_lo, p_hi, rows),
            ):
                if lo < 0 or hi >= limit:
                    raise IndexError(
                        f"{name} ids must be in [0, {limit}), got [{lo}, {hi}]"
                    )
            if dup:
                raise ValueError("duplicate destination block ids")
        return packed_ids


def _storage_as(
    storage: torch.UntypedStorage, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    word = torch.empty((), dtype=dtype).element_size()
    out = torch.empty(0, dtype=dtype, device=device)
    return out.set_(storage, 0, (storage.nbytes() // word,), (1,))


def _runs(table: BlockTable, seg: Segment) -> torch.Tensor:
    """uint8 view [num_blocks, length] of one segment."""
    base = _storage_as(seg.storage, torch.uint8, table.device)
    return base.as_strided((table.num_blocks, seg.length), (seg.stride, 1), seg.offset)


def _packed_bytes(packed: torch.Tensor, n: int, block_bytes: int) -> torch.Tensor:
    return packed.view(torch.uint8).view(n, block_bytes)


# -- reference (plain torch) ---------------------------------------------------
def reference_copy(
    table: BlockTable,
    block_ids: torch.Tensor,
    packed: torch.Tensor,
    to_packed: bool,
    packed_ids: torch.Tensor | None = None,
) -> int:
    packed_ids = table.check(block_ids, packed, packed_ids, to_packed)
    rows = _packed_bytes(packed, table.packed_rows(packed), table.block_bytes)
    cache_ids = block_ids.to(table.device)
    row_ids = packed_ids.to(packed.device)
    start = 0
    for seg in table.segments:
        runs, cols = _runs(table, seg), slice(start, start + seg.length)
        if to_packed:
            rows[row_ids, cols] = runs.index_select(0, cache_ids).to(packed.device)
        else:
            runs.index_copy_(0, cache_ids, rows[row_ids, cols].to(table.device))
        start += seg.length
    return len(table.segments)


# -- DMA: one copy per contiguous run ---------------------------------------------
def _merged_runs(
    block_ids: list[int], packed_ids: list[int]
) -> list[tuple[int, int, int]]:
    """(first packed id, first block id, count) for runs where both ids
    are consecutive."""
    runs: list[tuple[int, int, int]] = []
    for p, b in zip(packed_ids, block_ids):
        if runs and runs[-1][1] + runs[-1][2] == b and runs[-1][0] + runs[-1][2] == p:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((p, b, 1))
    return runs


def dma_copy(
    table: BlockTable,
    block_ids: torch.Tensor,
    packed: torch.Tensor,
    to_packed: bool,
    packed_ids: torch.Tensor | None = None,
    non_blocking: bool = True,
) -> int:
    """Copy with ``Tensor.copy_`` per run; returns the number of copies.

    With one segment whose stride equals its length (a cross-layer buffer),
    blocks that are consecutive on both sides move as one copy."""
    packed_ids = table.check(block_ids, packed, packed_ids, to_packed)
    ids, pids = block_ids.tolist(), packed_ids.tolist()
    rows = _packed_bytes(packed, table.packed_rows(packed), table.block_bytes)
    start, copies = 0, 0
    for seg in table.segments:
        runs = _runs(table, seg)
        merge = seg.stride == seg.length and len(table.segments) == 1
        spans = (
            _merged_runs(ids, pids) if merge else [(p, b, 1) for p, b in zip(pids, ids)]
        )
        for p, b, count in spans:
            cache = runs[b : b + count]
            host = rows[p : p + count, start : start + seg.length]
            if to_packed:
                host.copy_(cache, non_blocking=non_blocking)
            else:
                cache.copy_(host, non_blocking=non_blocking)
            copies += 1
        start += seg.length
    return copies


# -- Triton: one launch per transfer ------------------------------------------------
_VEC_BYTES = 16  # one 128-bit access


def _word_size(
    table: BlockTable, packed: torch.Tensor, ref: torch.UntypedStorage
) -> tuple[int, int]:
    """(word bytes, words per access): int32 x 4 (128-bit accesses) when
    every address, offset, stride and length is a multiple of 16 bytes;
    else the widest word that divides them all, one word per access."""
    table_gcd = table._device_meta.get("gcd")
    if table_gcd is None:  # the table's part, once
        ref_ptr = ref.data_ptr()
        values = [ref_ptr, table.block_bytes]
        for seg in table.segments:
            values += [
                seg.storage.data_ptr() + seg.offset - ref_ptr,
                seg.stride,
                seg.length,
            ]
        table_gcd = table._device_meta["gcd"] = math.gcd(*values)
    gcd = math.gcd(table_gcd, packed.data_ptr())
    if gcd % _VEC_BYTES == 0:
        return 4, _VEC_BYTES // 4
    return next(w for w in (8, 4, 2, 1) if gcd % w == 0), 1


def _device_meta(table: BlockTable, word: int, ref: torch.UntypedStorage) -> tuple:
    """The cache viewed as words, the segment table in words (four int64
    rows on the table's device: source offset, stride, offset in the packed
    block, length) and the longest length; built and copied to the device
    once per word size."""
    cached = table._device_meta.get(word)
    if cached is None:
        lengths = [s.length // word for s in table.segments]
        meta = torch.tensor(
            [
                [
                    (s.storage.data_ptr() + s.offset - ref.data_ptr()) // word
                    for s in table.segments
                ],
                [s.stride // word for s in table.segments],
                [sum(lengths[:i]) for i in range(len(lengths))],
                lengths,
            ],
            dtype=torch.int64,
        ).to(table.device)
        cached = (
            _storage_as(ref, _WORDS[word], table.device),
            tuple(meta),
            max(lengths),
        )
        table._device_meta[word] = cached
    return cached


def triton_copy(
    table: BlockTable,
    block_ids: torch.Tensor,
    packed: torch.Tensor,
    to_packed: bool,
    packed_ids: torch.Tensor | None = None,
    chunk_words: int = 1024,
) -> int:
    """One kernel launch moves every run of every block.

    On a GPU ``packed`` may be pinned host memory (written over PCIe by the
    kernel, zero copy).  On CPU it runs with ``TRITON_INTERPRET=1``.  When
    everything is 16-byte aligned the kernel's aligned variant moves 128
    bits per access; otherwise the fallback variant (any alignment)."""
    from vllm_overlay.core.ops.triton_kernels import copy_blocks_kernel

    packed_ids = table.check(block_ids, packed, packed_ids, to_packed)
    n = block_ids.numel()
    if n == 0:
        return 0
    ref = table.segments[0].storage
    word, vec = _word_size(table, packed, ref)
    dev = table.device
    ref_words, meta, longest = _device_meta(table, word, ref)
    if block_ids.device != dev or packed_ids.device != dev:
        # Both id lists in one host-to-device copy (pinned: asynchronous).
        ids = torch.stack([block_ids.cpu(), packed_ids.cpu()])
        if dev.type == "cuda":
            ids = ids.pin_memory()
        ids = ids.to(dev, non_blocking=True)
        block_ids, packed_ids = ids[0], ids[1]
    chunk = min(chunk_words, 1 << (longest - 1).bit_length())
    chunk = max(chunk, vec)
    grid = (n, len(table.segments), -(-longest // chunk))
    copy_blocks_kernel[grid](
        ref_words,
        packed.view(_WORDS[word]),
        block_ids,
        packed_ids,
        *meta,
        table.block_bytes // word,
        TO_PACKED=to_packed,
        CHUNK=chunk,
        VEC=vec,
    )
    return 1


COPY_METHODS = {"reference": reference_copy, "dma": dma_copy, "triton": triton_copy}


def gather(
    table: BlockTable,
    block_ids: torch.Tensor,
    packed: torch.Tensor,
    method: str = "triton",
    packed_ids: torch.Tensor | None = None,
) -> int:
    """Cache blocks ``block_ids`` -> packed rows ``packed_ids`` (default
    0..n-1).  Returns the number of copy calls / launches."""
    return COPY_METHODS[method](table, block_ids, packed, True, packed_ids)


def scatter(
    table: BlockTable,
    block_ids: torch.Tensor,
    packed: torch.Tensor,
    method: str = "triton",
    packed_ids: torch.Tensor | None = None,
) -> int:
    """Packed rows -> cache blocks ``block_ids`` (which must be unique)."""
    return COPY_METHODS[method](table, block_ids, packed, False, packed_ids)
