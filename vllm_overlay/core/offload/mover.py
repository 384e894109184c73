"""Asynchronous block moves between a device KV cache and a host pool
(vLLM 0.11.2's offloading connector).

Knows nothing of vLLM.  The host pool is ``[num_host_blocks, block_bytes]``
(pinned on CUDA): ``HostLayout.packed``, host block ``h`` holds one device
block packed as the ``BlockTable`` describes it (for a cross-layer buffer:
its bytes verbatim).  The copy itself is ``host_copy.HostBlocks.copy``, the
step vLLM 0.32's CPU worker uses too; this class adds what 0.11.2's
``OffloadingHandler`` needs around it: the method choice (DMA or one Triton
launch), job ids polled for completion, and stats per direction taken by
interval.

On CUDA each job runs on a side stream (one for stores, one for loads) that
first waits for the compute stream, so a store is ordered after the kernels
that wrote the blocks; completion is polled with events.  On CPU there is no
copy engine: jobs run at submit time and are reported finished at the next
poll (0.32's worker has its own thread instead: its callers may not block).
"""

from __future__ import annotations

import torch

from vllm_overlay.core.offload.host_copy import HostBlocks, HostLayout, TransferStats
from vllm_overlay.core.ops.block_copy import BlockTable

METHODS = ("auto", "dma", "triton")


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
        layout = HostLayout.packed(table)
        self.host = torch.zeros(
            num_host_blocks,
            layout.row_bytes,
            dtype=torch.uint8,
            device="cpu",
            pin_memory=self.cuda,
        )
        self.host_blocks = HostBlocks(layout, self.host, self.method)
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
        if self.cuda:
            stream = self._streams[to_host]
            stream.wait_stream(torch.cuda.current_stream(self.table.device))
            with torch.cuda.stream(stream):
                stats = self.host_blocks.copy(device_ids, host_ids, to_host)
                event = torch.cuda.Event()
                event.record(stream)
        else:
            stats = self.host_blocks.copy(device_ids, host_ids, to_host)
            event = None
        self._pending[job_id] = event
        self.stats["store" if to_host else "load"].add(stats)

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
