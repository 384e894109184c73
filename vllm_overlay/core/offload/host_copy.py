"""The one copy step between a device KV cache and host memory.

Both offloading workers move blocks through here: vLLM 0.11.2's connector
(``mover.BlockMover``: CUDA streams and events around it) and vLLM 0.32's
CPU worker (``integration/v0_32/offload_worker``: upstream's specs, its
thread, retries and results around it).  Knows nothing of vLLM.

Host memory is ``[rows, row_bytes]`` bytes, each row contiguous.  Each
device block is copied to (or from) a *host place*; a ``HostLayout`` says
where place ``p`` lies: in row ``p // places_per_row``, and there, for each
part (a ``BlockTable`` over some of the KV cache's runs), at
``part.offset + (p % places_per_row) * part.table.block_bytes``.  The two
workers' host layouts differ only in this data:

* ``HostLayout.packed``: vLLM 0.11.2's host pool, one block per row, its
  runs back to back (``block_copy``'s packed block);
* ``HostLayout.tensor_major``: vLLM 0.32's chunk (upstream's
  ``cpu/gpu_worker.py``: one ``SharedOffloadRegion`` view per KV tensor),
  ``blocks_per_chunk`` places per row, one part per KV tensor holding that
  tensor's pages of the chunk back to back, tensor after tensor.

``HostBlocks.copy`` moves (device block, host place) pairs with one
``block_copy`` call per part and row; when a single part fills every row
and the rows lie back to back, places are plain packed rows and one call
moves the whole transfer (runs of blocks consecutive on both sides merge
into one copy, across rows too).  It counts the blocks, bytes, copy calls
and seconds of each transfer (``TransferStats``).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping, Sequence
from typing import NamedTuple

import torch

from vllm_overlay.core.ops.block_copy import COPY_METHODS, BlockTable


@dataclasses.dataclass
class TransferStats:
    """Totals of one or more transfers."""

    jobs: int = 0
    blocks: int = 0
    bytes: int = 0
    copy_calls: int = 0
    seconds: float = 0.0  # CPU: the copy time; CUDA: the time to submit it

    def add(self, other: TransferStats) -> None:
        for field in dataclasses.fields(self):
            setattr(
                self, field.name, getattr(self, field.name) + getattr(other, field.name)
            )

    @property
    def gb_per_s(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds else 0.0

    def as_dict(self) -> dict:
        return {**dataclasses.asdict(self), "gb_per_s": self.gb_per_s}


class HostPart(NamedTuple):
    """Some of a block's runs and their bytes in every host row."""

    table: BlockTable  # where those runs live in the KV cache
    offset: int  # bytes into a row
    size: int  # bytes: places_per_row blocks of this part


@dataclasses.dataclass(frozen=True)
class HostLayout:
    """Where each host place's bytes lie in a row (module docstring)."""

    parts: tuple[HostPart, ...]
    places_per_row: int
    row_bytes: int

    def __post_init__(self) -> None:
        if not self.parts or self.places_per_row <= 0:
            raise ValueError(
                f"a host layout needs parts and places per row, got "
                f"{len(self.parts)} part(s), {self.places_per_row} place(s)"
            )
        for part in self.parts:
            if (
                part.size != self.places_per_row * part.table.block_bytes
                or part.offset < 0
                or part.offset + part.size > self.row_bytes
            ):
                raise ValueError(
                    f"host part at {part.offset} B ({part.size} B) does not "
                    f"hold {self.places_per_row} block(s) of "
                    f"{part.table.block_bytes} B in a row of {self.row_bytes} B"
                )

    @classmethod
    def packed(cls, table: BlockTable) -> HostLayout:
        """One block per row, its runs back to back."""
        return cls((HostPart(table, 0, table.block_bytes),), 1, table.block_bytes)

    @classmethod
    def tensor_major(
        cls,
        pages: Sequence[int],
        tensors: Mapping[int, torch.Tensor],
        places_per_row: int,
    ) -> HostLayout:
        """Rows of ``places_per_row`` blocks: KV tensor after tensor (page
        sizes ``pages``), each its ``places_per_row`` pages.  ``tensors``
        maps the index of each tensor to copy to its ``[blocks, page]``
        view; one left out keeps its place in the row, uncopied."""
        parts, offset = [], 0
        for i, page in enumerate(pages):
            size = places_per_row * page
            if i in tensors:
                table = BlockTable.from_tensors([tensors[i]], 0)
                parts.append(HostPart(table, offset, size))
            offset += size
        return cls(tuple(parts), places_per_row, offset)

    @property
    def block_bytes(self) -> int:
        """Bytes copied per block."""
        return sum(part.table.block_bytes for part in self.parts)


class HostBlocks:
    """Host memory in a ``HostLayout``, and the copy step to and from it.

    ``host``: ``[rows, layout.row_bytes]`` one-byte elements, each row
    contiguous, rows at any stride.  ``method``: a ``block_copy`` method."""

    def __init__(self, layout: HostLayout, host: torch.Tensor, method: str) -> None:
        if (
            host.element_size() != 1
            or host.dim() != 2
            or host.shape[1] != layout.row_bytes
            or host.stride(1) != 1
        ):
            raise ValueError(
                f"host memory must be rows of {layout.row_bytes} one-byte "
                f"elements, each contiguous; got {tuple(host.shape)} "
                f"{host.dtype} strides {host.stride()}"
            )
        if method not in COPY_METHODS:
            raise ValueError(f"copy method {method!r}: expected one of {COPY_METHODS}")
        self.layout = layout
        self.host = host
        self.method = method
        # One part filling rows that lie back to back: places are packed
        # rows of the whole memory, and a run may cross rows.
        self.flat = (
            len(layout.parts) == 1
            and layout.parts[0].size == layout.row_bytes
            and host.is_contiguous()
        )

    def copy(
        self, block_ids: torch.Tensor, places: torch.Tensor, to_host: bool
    ) -> TransferStats:
        """Device blocks ``block_ids`` -> host places ``places`` (pairwise;
        the other way round unless ``to_host``); both 1-D int64."""
        move = COPY_METHODS[self.method]
        start = time.perf_counter()
        if self.flat:
            table = self.layout.parts[0].table
            calls = move(table, block_ids, self.host.view(-1), to_host, places)
        else:
            calls = self._row_by_row(move, block_ids, places, to_host)
        n = block_ids.numel()
        return TransferStats(
            jobs=1,
            blocks=n,
            bytes=n * self.layout.block_bytes,
            copy_calls=calls,
            seconds=time.perf_counter() - start,
        )

    def _row_by_row(self, move, block_ids, places, to_host: bool) -> int:
        per, calls = self.layout.places_per_row, 0
        rows = places // per
        for row in rows.unique().tolist():
            mine = rows == row
            blocks, at = block_ids[mine], places[mine] % per
            line = self.host[row]
            for part in self.layout.parts:
                area = line[part.offset : part.offset + part.size]
                calls += move(part.table, blocks, area, to_host, at)
        return calls
