"""Upstream's ``OffloadingWorker`` for the CPU platform, on ``core/ops``.

vLLM 0.32's ``OffloadingConnector`` moves KV blocks between the KV cache
and host memory through an ``OffloadingWorker``; upstream's
(``cpu/gpu_worker.py``) runs on CUDA streams only, and
``CPUOffloadingSpec.get_worker`` refuses any other platform.  This worker
keeps everything else upstream's (the connector, the manager and its
eviction policies, the ``cpu_bytes_to_use`` sizing, the chunk ids the
scheduler hands out) and moves the bytes with the copy step that vLLM
0.11.2's connector uses too (``host_copy.HostBlocks``, on ``core/ops``' DMA
path): one ``copy_`` per KV tensor and run of consecutive blocks inside a
chunk; with cross-layer blocks (``BLHNC``: one canonical tensor whose row
is a block of every layer) and chunks back to back, runs also cross chunks.
What stays here is upstream's contract: specs to block ids and host places,
the background thread, retries, and ``TransferResult``.

Host memory is ``num_cpu_chunks`` chunks (``HostLayout.tensor_major``),
each laid out as upstream's worker lays out its slot of a chunk row
(``cpu/gpu_worker.py``: one ``SharedOffloadRegion.create_next_worker_view``
per KV tensor, in tensor order): tensor after tensor, each tensor's
``blocks_per_chunk`` blocks back to back.  So a CPU engine and a GPU engine
write the same bytes for the same KV, and a chunk one wrote (to a file
tier, a shared pool) is one the other can load.  Consecutive blocks of one
tensor are contiguous in a chunk: one copy per such run and tensor.  By
default the worker allocates the memory at startup; a caller can hand it in
instead (``host``): the tiering spec gives it its slot of the primary
tier's shared region, which the scheduler's secondary tiers read and write.
Transfers run in submission order on one background thread, never on the
engine's.  ``wait`` blocks until its jobs are done, as upstream's does (its
caller, ``handle_preemptions``, reuses their blocks next), but not forever:
a job still pending after ``WAIT_DEADLINE_S`` (or at once, if the thread
died) is given up, as a failed transfer its caller already takes (below):
one still queued never runs, one whose copy is under way has its result
dropped, and an error names them.  A transfer that raises is redone
from the start on that thread, up to ``TRANSFER_RETRIES`` more times (a
partly done copy is simply copied again; each failure is a warning naming
the job and the attempt).  One that still fails is reported failed (an
error, once): with OF32-04/05/06 upstream's connector then ends or
recomputes the request of a failed load as ``kv_load_failure_policy`` says
(``"fail"``, vLLM's default: the request finishes with ``finish_reason``
``"error"``; ``"recompute"``: its KV is computed again; the worker logs
which one applies when it starts), and completes a failed store as not
stored.  Either way the engine serves on and no request runs on KV that was
not written.  ``retries`` and ``failed`` count, per direction, the attempts
redone and the jobs given up; ``stats`` the blocks, bytes, copy calls and
seconds of the jobs done (``copies`` and ``blocks`` read from it).
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from collections.abc import Callable

import numpy
import torch
from vllm.v1.kv_offload.base import OffloadingWorker, TransferResult

from vllm_overlay.core.offload.host_copy import HostBlocks, HostLayout, TransferStats
from vllm_overlay.core.ops.block_copy import BlockTable
from vllm_overlay.integration.v0_32.idle_wait import TRANSFER_DONE

logger = logging.getLogger("vllm.overlay")

WAIT_DEADLINE_S = 120.0  # wait(): no transfer of a few blocks takes this long
_WAIT_TICK_S = 1.0  # wait() checks the thread is alive this often
TRANSFER_RETRIES = 2  # a transfer that raised is redone this many times more
_STOP = object()


class CPUPlatformOffloadingWorker(OffloadingWorker):
    """``host(n)``, if given, returns the host memory: an int8 tensor of
    ``num_cpu_chunks`` rows of ``n`` bytes (``blocks_per_chunk`` blocks of
    every KV tensor), each row contiguous, rows at any stride.  ``release`` is called at
    shutdown, once no transfer touches that memory any more."""

    def __init__(
        self,
        kv_caches,
        blocks_per_chunk: int,
        num_cpu_chunks: int,
        host: Callable[[int], torch.Tensor] | None = None,
        release: Callable[[], None] | None = None,
    ) -> None:
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
        pages = [t.page_size_bytes for t in kv_caches.tensors]
        rows = {
            i: kv_caches.tensors[i].tensor.view(torch.int8).view(-1, pages[i])
            for i in used
        }
        self.table = BlockTable.from_tensors(list(rows.values()), 0)
        self.blocks_per_chunk = blocks_per_chunk
        # Upstream's chunk: every KV tensor's blocks_per_chunk pages, tensor
        # after tensor (a tensor no reference uses keeps its place).
        layout = HostLayout.tensor_major(pages, rows, blocks_per_chunk)
        chunk_bytes = layout.row_bytes
        memory = (host or _allocate(num_cpu_chunks))(chunk_bytes)
        if (
            memory.dtype != torch.int8
            or tuple(memory.shape) != (num_cpu_chunks, chunk_bytes)
            or memory.stride(1) != 1
        ):
            raise ValueError(
                f"host memory must be {num_cpu_chunks} int8 rows of "
                f"{chunk_bytes} B, each contiguous; got {tuple(memory.shape)} "
                f"{memory.dtype} strides {memory.stride()}"
            )
        self.host = memory  # [chunk, byte]
        # host place of block j of chunk c: c * blocks_per_chunk + j
        self.host_blocks = HostBlocks(layout, memory, "dma")
        self._release = release
        self.stats = {"store": TransferStats(), "load": TransferStats()}
        self.retries = {"store": 0, "load": 0}  # attempts redone
        self.failed = {"store": 0, "load": 0}  # jobs given up
        self._jobs: queue.Queue = queue.Queue()
        self._done: collections.deque = collections.deque()
        self._pending: dict[int, str] = {}  # job -> "store" | "load"
        self._given_up: set[int] = set()  # by wait(): results not reported
        self._running: int | None = None  # the job whose copy is under way
        self._cond = threading.Condition()
        self._thread = threading.Thread(
            target=self._run, name="vllm-overlay-offload", daemon=True
        )
        self._thread.start()
        logger.info(
            "vllm-overlay CPU offloading worker: %d KV tensor(s), %d B per "
            "block, host memory %.1f MiB (%d chunks of %d blocks, tensor-major "
            "as upstream's, %s, %s), copies by core/ops dma on a background "
            "thread",
            len(rows),
            self.table.block_bytes,
            self.host.numel() / 2**20,
            num_cpu_chunks,
            blocks_per_chunk,
            "allocated here" if host is None else "given by the spec",
            "runs across chunks" if self.host_blocks.flat else "chunk by chunk",
        )
        _log_load_failure_policy()

    @property
    def copies(self) -> dict[str, int]:
        """copy_ calls per direction, of the jobs done (tests, logs)."""
        return {kind: s.copy_calls for kind, s in self.stats.items()}

    @property
    def blocks(self) -> dict[str, int]:
        """Blocks moved per direction, by the jobs done."""
        return {kind: s.blocks for kind, s in self.stats.items()}

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
        """Until ``job_ids`` are done, as upstream's ``wait`` (its caller
        then reuses their blocks); those still pending after
        ``WAIT_DEADLINE_S``, or once the thread died, are given up and
        reported failed, never raised into the engine's step."""
        deadline = time.monotonic() + WAIT_DEADLINE_S
        with self._cond:
            while late := self._pending.keys() & set(job_ids):
                left = deadline - time.monotonic()
                if left <= 0 or not self._thread.is_alive():
                    self._give_up(late)
                    return
                self._cond.wait(min(left, _WAIT_TICK_S))

    def shutdown(self) -> None:
        self._jobs.put(_STOP)
        self._thread.join(timeout=5)
        if self._thread.is_alive():
            # A copy still runs: its memory must stay mapped.
            logger.warning(
                "vllm-overlay CPU offloading: a transfer still runs at "
                "shutdown; host memory left in place"
            )
            return
        self.host = self.host_blocks = None
        if self._release is not None:
            release, self._release = self._release, None
            release()

    # -- internals ---------------------------------------------------------------
    def _host_rows(self, chunk_ids, gpu_spec, count: int) -> numpy.ndarray:
        """The host places (``chunk * blocks_per_chunk + block in chunk``)
        of ``count`` blocks in chunks ``chunk_ids``, the first chunk possibly
        entered part way (the request's first block index, modulo the blocks
        per chunk), as upstream's ``compute_sub_block_ptrs`` counts them."""
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

    def _give_up(self, jobs: set[int]) -> None:
        """(Under ``_cond``.)  ``jobs`` fail now: each is reported failed
        (``get_finished``); a queued one never runs, a running one's result
        is dropped."""
        alive = self._thread.is_alive()
        for job_id in sorted(jobs):
            kind = self._pending.pop(job_id)
            self.failed[kind] += 1
            self._given_up.add(job_id)
            self._done.append(TransferResult(job_id, False))
        running = self._running if self._running in jobs else None
        logger.error(
            "vllm-overlay CPU offloading: transfer job(s) %s not done %s; "
            "reported failed (a load's request is recomputed or ends with an "
            "error, as kv_load_failure_policy says; a store is not kept)%s",
            sorted(jobs),
            f"within {WAIT_DEADLINE_S:g} s" if alive else "(the thread died)",
            f"; job {running}'s copy is still under way (its result will be "
            "dropped; a load may still write its blocks)"
            if running is not None
            else "; none of them will run",
        )

    def _submit(self, job_id: int, kind: str, ids, rows) -> bool:
        with self._cond:
            self._pending[job_id] = kind
        self._jobs.put((job_id, kind, torch.from_numpy(ids), torch.from_numpy(rows)))
        return True

    def _move(self, kind: str, ids: torch.Tensor, rows: torch.Tensor) -> TransferStats:
        """One attempt: cache blocks ``ids`` <-> host places ``rows``."""
        return self.host_blocks.copy(ids, rows, kind == "store")

    def _run(self) -> None:
        try:
            self._serve()
        except BaseException:
            logger.exception(
                "vllm-overlay CPU offloading: the transfer thread died; the "
                "transfers it had not done are reported failed when waited for"
            )
            raise

    def _serve(self) -> None:
        """Transfers in submission order; one that raises is redone, then
        fails alone."""
        while True:
            job = self._jobs.get()
            if job is _STOP:
                return
            job_id, kind, ids, rows = job
            with self._cond:
                if job_id in self._given_up:  # by wait(): reported failed
                    self._given_up.discard(job_id)
                    continue
                self._running = job_id
            start = time.perf_counter()
            ok = self._transfer(job_id, kind, ids, rows)
            result = TransferResult(
                job_id,
                ok,
                len(ids) * self.table.block_bytes,
                time.perf_counter() - start,
            )
            with self._cond:
                self._running = None
                if job_id in self._given_up:
                    self._given_up.discard(job_id)
                    logger.warning(
                        "vllm-overlay CPU offloading: %s job %d done %.1f s "
                        "after it started, after wait() gave it up; its "
                        "result is dropped (it was reported failed)",
                        kind,
                        job_id,
                        result.transfer_time,
                    )
                    continue
                self._done.append(result)
                self._pending.pop(job_id, None)
                self._cond.notify_all()
            TRANSFER_DONE.set()  # an idle engine of this process steps now

    def _transfer(self, job_id: int, kind: str, ids, rows) -> bool:
        """One job's copies, redone from the start while they raise, up to
        ``TRANSFER_RETRIES`` more times; whether they were done."""
        tries = 1 + TRANSFER_RETRIES
        for attempt in range(1, tries + 1):
            try:
                done = self._move(kind, ids, rows)
            except Exception as e:  # noqa: BLE001 - redone, then failed alone
                if attempt < tries:
                    self.retries[kind] += 1
                    logger.warning(
                        "vllm-overlay CPU offloading: %s job %d (%d blocks) "
                        "failed on attempt %d of %d (%s: %s); redoing it",
                        kind,
                        job_id,
                        len(ids),
                        attempt,
                        tries,
                        type(e).__name__,
                        e,
                    )
                    continue
                self.failed[kind] += 1
                logger.exception(
                    "vllm-overlay CPU offloading: %s job %d (%d blocks) failed "
                    "on all %d attempts; reported failed (%s)",
                    kind,
                    job_id,
                    len(ids),
                    tries,
                    "its request is recomputed or ends with an error, as "
                    "kv_load_failure_policy says"
                    if kind == "load"
                    else "its blocks are not marked stored",
                )
                return False
            self.stats[kind].add(done)
            return True
        return False


def _log_load_failure_policy() -> None:
    """Says once, at startup, what becomes of a load that still fails after
    the retries: upstream's scheduler applies ``kv_load_failure_policy``."""
    from vllm.config import get_current_vllm_config_or_none

    config = get_current_vllm_config_or_none()
    kv = config.kv_transfer_config if config is not None else None
    policy = getattr(kv, "kv_load_failure_policy", None)
    tries = 1 + TRANSFER_RETRIES
    if policy == "recompute":
        logger.info(
            "vllm-overlay CPU offloading: a load that still fails after %d "
            "tries is recomputed (kv_load_failure_policy 'recompute')",
            tries,
        )
    elif policy == "fail":
        logger.info(
            "vllm-overlay CPU offloading: a load that still fails after %d "
            "tries ends its request with finish_reason 'error' "
            "(kv_load_failure_policy 'fail', vLLM's default; set "
            '"kv_load_failure_policy": "recompute" in --kv-transfer-config to '
            "recompute it instead)",
            tries,
        )
    else:
        logger.info(
            "vllm-overlay CPU offloading: a load that still fails after %d "
            "tries is reported failed; no vLLM config in this process, so the "
            "scheduler's kv_load_failure_policy decides",
            tries,
        )


def _allocate(num_chunks: int) -> Callable[[int], torch.Tensor]:
    return lambda chunk_bytes: torch.zeros((num_chunks, chunk_bytes), dtype=torch.int8)
