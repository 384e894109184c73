"""Host memory for the shared pool connector's copies: a ring of rows
allocated once at startup (pinned with CUDA) and reused, so no staging
memory is allocated while serving."""

from __future__ import annotations

import collections
import threading

import numpy
import torch


class StagingRing:
    """Host rows ``[slots, block_bytes]`` (pinned with CUDA) allocated once
    and reused: contiguous spans handed out first in, first out (a span
    released early keeps its rows until the spans before it are released).
    With ``header_bytes``, a header row per slot as well (plain memory).
    Thread-safe; ``allocations`` counts staging buffers ever allocated."""

    def __init__(
        self, slots: int, block_bytes: int, pin: bool = False, header_bytes: int = 0
    ) -> None:
        self.slots = slots
        self.rows = torch.empty(slots, block_bytes, dtype=torch.uint8, pin_memory=pin)
        # Touched now, once: a first read into untouched rows pays a page
        # fault per 4 KiB (measured: the first reload into fresh rows took
        # up to 2x as long).
        self.rows.zero_()
        self.rows_np = self.rows.numpy()
        self.heads = (
            numpy.zeros((slots, header_bytes), dtype=numpy.uint8)
            if header_bytes
            else None
        )
        self.allocations = 1
        self._lock = threading.Lock()
        self._spans: collections.deque = collections.deque()  # [start, n, freed]
        self._head = 0  # one past the last row handed out

    def words(self, dtype: torch.dtype) -> torch.Tensor:
        return self.rows.view(dtype)

    def alloc(self, n: int) -> tuple[int, int]:
        """(first row, rows) of the longest free contiguous span of at most
        ``n`` rows; rows is 0 when none is free."""
        if n <= 0:
            return 0, 0
        with self._lock:
            while self._spans and self._spans[0][2]:
                self._spans.popleft()
            if not self._spans:
                start, k = 0, min(n, self.slots)
            else:
                tail, head = self._spans[0][0], self._head
                if head > tail:  # free: [head, slots) and [0, tail)
                    end_free = self.slots - head
                    if end_free >= n or end_free >= tail:
                        start, k = head, min(n, end_free)
                    else:  # wrap: the end stays unused until it frees up
                        start, k = 0, min(n, tail)
                else:  # wrapped (or full): free [head, tail)
                    start, k = head, min(n, tail - head)
            if k <= 0:
                return 0, 0
            self._spans.append([start, k, False])
            self._head = start + k
            return start, k

    def release(self, start: int) -> None:
        with self._lock:
            for span in self._spans:
                if span[0] == start and not span[2]:
                    span[2] = True
                    break
            while self._spans and self._spans[0][2]:
                self._spans.popleft()

    @property
    def in_use(self) -> int:
        with self._lock:
            return sum(n for _, n, freed in self._spans if not freed)
