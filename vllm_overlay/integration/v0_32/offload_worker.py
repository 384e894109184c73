"""Upstream's ``OffloadingWorker`` for the CPU platform, on ``core/ops``.

vLLM 0.32's ``OffloadingConnector`` moves KV blocks between the KV cache
and host memory through an ``OffloadingWorker``; upstream's
(``cpu/gpu_worker.py``) runs on CUDA streams only, and
``CPUOffloadingSpec.get_worker`` refuses any other platform.  This worker
keeps everything else upstream's (the connector, the manager and its
eviction policies, the ``cpu_bytes_to_use`` sizing, the chunk ids the
scheduler hands out) and moves the bytes with ``core/ops``' DMA path: one
``copy_`` per block and KV tensor, and with cross-layer blocks (``BLHNC``:
one canonical tensor whose row is a block of every layer) one per block,
consecutive blocks merged into one.

Host memory is one buffer of ``num_cpu_chunks * blocks_per_chunk`` rows
(each a block of every KV tensor, back to back), allocated at startup.
Transfers run in submission order on one background thread, never on the
engine's; a transfer that raises fails alone (its job reports failure and
vLLM recomputes), and ``wait`` has a deadline.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time

import numpy
import torch
from vllm.v1.kv_offload.base import OffloadingWorker, TransferResult

from vllm_overlay.core.ops.block_copy import BlockTable, gather, scatter

logger = logging.getLogger("vllm.overlay")

WAIT_DEADLINE_S = 120.0  # wait(): no transfer of a few blocks takes this long
_STOP = object()


class CPUPlatformOffloadingWorker(OffloadingWorker):
    def __init__(self, kv_caches, blocks_per_chunk: int, num_cpu_chunks: int) -> None:
        groups = kv_caches.group_data_refs
        if len(groups) != 1:
            raise NotImplementedError(
                "vllm-overlay CPU offloading: one KV cache group only (a "
                f"uniform model); this model has {len(groups)}"
            )
        used = sorted({ref.tensor_idx for ref in groups[0]})
        for ref in groups[0]:
            page = kv_caches.tensors[ref.tensor_idx].page_size_bytes
            if ref.page_size_bytes != page:
                raise NotImplementedError(
                    "vllm-overlay CPU offloading: a KV reference covers part "
                    f"of its tensor's page ({ref.page_size_bytes} of {page} B)"
                )
        rows = [
            kv_caches.tensors[i]
            .tensor.view(torch.int8)
            .view(-1, kv_caches.tensors[i].page_size_bytes)
            for i in used
        ]
        self.table = BlockTable.from_tensors(rows, 0)
        self.blocks_per_chunk = blocks_per_chunk
        self.host = torch.zeros(
            (num_cpu_chunks * blocks_per_chunk, self.table.block_bytes),
            dtype=torch.int8,
        )
        self.copies = {"store": 0, "load": 0}  # copy_ calls (tests, logs)
        self.blocks = {"store": 0, "load": 0}
        self._jobs: queue.Queue = queue.Queue()
        self._done: collections.deque = collections.deque()
        self._pending: set[int] = set()
        self._cond = threading.Condition()
        self._thread = threading.Thread(
            target=self._run, name="vllm-overlay-offload", daemon=True
        )
        self._thread.start()
        logger.info(
            "vllm-overlay CPU offloading worker: %d KV tensor(s), %d B per "
            "block in %d run(s), host memory %.1f MiB (%d chunks of %d "
            "blocks), copies by core/ops dma on a background thread",
            len(rows),
            self.table.block_bytes,
            self.table.runs_per_block,
            self.host.nbytes / 2**20,
            num_cpu_chunks,
            blocks_per_chunk,
        )

    # -- the OffloadingWorker interface ---------------------------------------
    def submit_store(self, job_id: int, src_spec, dst_spec) -> bool:
        """KV cache blocks ``src_spec`` -> host chunks ``dst_spec``."""
        ids = numpy.asarray(src_spec.block_ids, dtype=numpy.int64)
        rows = self._host_rows(dst_spec.block_ids, src_spec, len(ids))
        return self._submit(job_id, "store", ids, rows)

    def submit_load(self, job_id: int, src_spec, dst_spec) -> bool:
        """Host chunks ``src_spec`` -> KV cache blocks ``dst_spec``."""
        ids = numpy.asarray(dst_spec.block_ids, dtype=numpy.int64)
        rows = self._host_rows(src_spec.block_ids, dst_spec, len(ids))
        return self._submit(job_id, "load", ids, rows)

    def get_finished(self) -> list[TransferResult]:
        out = []
        while self._done:
            out.append(self._done.popleft())
        return out

    def wait(self, job_ids: set[int]) -> None:
        deadline = time.monotonic() + WAIT_DEADLINE_S
        with self._cond:
            while self._pending & set(job_ids):
                left = deadline - time.monotonic()
                if left <= 0 or not self._thread.is_alive():
                    raise TimeoutError(
                        "vllm-overlay CPU offloading: transfers "
                        f"{sorted(self._pending & set(job_ids))} not done "
                        f"within {WAIT_DEADLINE_S:.0f} s"
                    )
                self._cond.wait(left)

    def shutdown(self) -> None:
        self._jobs.put(_STOP)
        self._thread.join(timeout=5)

    # -- internals ---------------------------------------------------------------
    def _host_rows(self, chunk_ids, gpu_spec, count: int) -> numpy.ndarray:
        """The host rows of ``count`` blocks in chunks ``chunk_ids``, the
        first chunk possibly entered part way (the request's first block
        index, modulo the blocks per chunk)."""
        per = self.blocks_per_chunk
        chunks = numpy.asarray(chunk_ids, dtype=numpy.int64)
        skip = int(gpu_spec.block_indices[0]) % per if per > 1 else 0
        rows = (chunks[:, None] * per + numpy.arange(per)).ravel()
        rows = rows[skip : skip + count]
        if len(rows) != count:
            raise ValueError(
                f"{len(chunk_ids)} host chunk(s) of {per} blocks do not hold "
                f"{count} blocks from block {skip} on"
            )
        return rows

    def _submit(self, job_id: int, kind: str, ids, rows) -> bool:
        with self._cond:
            self._pending.add(job_id)
        self._jobs.put((job_id, kind, torch.from_numpy(ids), torch.from_numpy(rows)))
        return True

    def _run(self) -> None:
        """Transfers in submission order; one that raises fails alone."""
        while True:
            job = self._jobs.get()
            if job is _STOP:
                return
            job_id, kind, ids, rows = job
            start = time.perf_counter()
            ok = True
            try:
                move = gather if kind == "store" else scatter
                self.copies[kind] += move(self.table, ids, self.host, "dma", rows)
                self.blocks[kind] += len(ids)
            except Exception:  # noqa: BLE001 - this job fails, vLLM recomputes
                ok = False
                logger.exception(
                    "vllm-overlay CPU offloading: %s of %d blocks failed",
                    kind,
                    len(ids),
                )
            result = TransferResult(
                job_id,
                ok,
                len(ids) * self.table.block_bytes,
                time.perf_counter() - start,
            )
            with self._cond:
                self._done.append(result)
                self._pending.discard(job_id)
                self._cond.notify_all()
