"""Asynchronous block moves between a device KV cache and a host pool.

Knows nothing of vLLM.  The host pool is ``[num_host_blocks, block_bytes]``
(pinned on CUDA); host block ``h`` holds one device block packed as the
``BlockTable`` describes it (for a cross-layer buffer: its bytes verbatim).

On CUDA each job runs on a side stream (one for stores, one for loads) that
first waits for the compute stream, so a store is ordered after the kernels
that wrote the blocks; completion is polled with events.  On CPU there is no
copy engine: jobs run at submit time and are reported finished at the next
poll.
"""

from __future__ import annotations

import dataclasses
import time

import torch

from vllm_overlay.core.ops.block_copy import COPY_METHODS, BlockTable

METHODS = ("auto", "dma", "triton")


@dataclasses.dataclass
class TransferStats:
    """Totals since the last ``take``; one per direction."""

    jobs: int = 0
    blocks: int = 0
    bytes: int = 0
    copy_calls: int = 0
    seconds: float = 0.0  # CPU: measured copy time; CUDA: submit time

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


def choose_method(table: BlockTable, method: str) -> str:
    """``auto``: the copy engine when a block is one run (cross-layer
    blocks: no SMs taken from the model), one Triton launch otherwise
    (avoids 2 x layers small copies per block).  CPU: always ``dma``
    (``Tensor.copy_``); Triton runs there only in its interpreter."""
    if method not in METHODS:
        raise ValueError(
            f"transfer method {method!r}: expected one of {', '.join(METHODS)}"
        )
    if table.device.type != "cuda":
        if method == "triton":
            raise ValueError(
                "transfer method 'triton' needs a CUDA device "
                f"(KV cache is on {table.device.type})"
            )
        return "dma"
    if method == "auto":
        return "dma" if table.runs_per_block == 1 else "triton"
    return method


class BlockMover:
    def __init__(
        self, table: BlockTable, num_host_blocks: int, method: str = "auto"
    ) -> None:
        if num_host_blocks <= 0:
            raise ValueError(f"num_host_blocks must be > 0, got {num_host_blocks}")
        self.table = table
        self.method = choose_method(table, method)
        self.cuda = table.device.type == "cuda"
        self.host = torch.zeros(
            num_host_blocks,
            table.block_bytes,
            dtype=torch.uint8,
            device="cpu",
            pin_memory=self.cuda,
        )
        self._streams = (
            {
                True: torch.cuda.Stream(table.device),
                False: torch.cuda.Stream(table.device),
            }
            if self.cuda
            else {}
        )
        self._pending: dict[int, object] = {}  # job id -> event or None
        self.stats = {"store": TransferStats(), "load": TransferStats()}

    @property
    def host_bytes(self) -> int:
        return self.host.nbytes

    def submit(
        self,
        job_id: int,
        device_ids: torch.Tensor,
        host_ids: torch.Tensor,
        to_host: bool,
    ) -> None:
        """Start copying device blocks <-> host blocks (pairwise)."""
        if job_id in self._pending:
            raise ValueError(f"job {job_id} is already in flight")
        copy = COPY_METHODS[self.method]
        start = time.perf_counter()
        if self.cuda:
            stream = self._streams[to_host]
            stream.wait_stream(torch.cuda.current_stream(self.table.device))
            with torch.cuda.stream(stream):
                calls = copy(self.table, device_ids, self.host, to_host, host_ids)
                event = torch.cuda.Event()
                event.record(stream)
        else:
            calls = copy(self.table, device_ids, self.host, to_host, host_ids)
            event = None
        elapsed = time.perf_counter() - start
        n = device_ids.numel()
        self._pending[job_id] = event
        self.stats["store" if to_host else "load"].add(
            TransferStats(
                jobs=1,
                blocks=n,
                bytes=n * self.table.block_bytes,
                copy_calls=calls,
                seconds=elapsed,
            )
        )

    def poll(self) -> list[int]:
        """Job ids finished since the last poll."""
        done = [
            job
            for job, event in self._pending.items()
            if event is None or event.query()
        ]
        for job in done:
            del self._pending[job]
        return done

    def take_stats(self) -> dict[str, TransferStats]:
        stats = self.stats
        self.stats = {"store": TransferStats(), "load": TransferStats()}
        return stats
