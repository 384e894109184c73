"""Debug trace for a chaos node (``CHAOS_TRACE_KV=1``): which KV blocks hold
NaN after each engine step, who owns them, and what the pool connector's
worker loaded where.  Lines go to the node's log, prefixed ``KVTRACE``.

Only for a CPU KV cache read in place (the pool worker's ``_cache_rows``);
it wraps the worker's ``start_load_kv`` and ``_finish_loads`` (names of
today's worker: where they are missing, those lines are skipped)."""

from __future__ import annotations

import sys

import numpy


class KVTrace:
    def __init__(self, scheduler, worker_connector) -> None:
        self.scheduler = scheduler
        self.worker = getattr(worker_connector, "connector_worker", None)
        self.step_no = 0
        self.nan_blocks: set[int] = set()
        self._wrap()

    def log(self, text: str) -> None:
        print(f"KVTRACE step {self.step_no}: {text}", file=sys.stderr, flush=True)

    def _wrap(self) -> None:
        worker = self.worker
        if worker is None:
            return
        start = getattr(worker, "start_load_kv", None)
        finish = getattr(worker, "_finish_loads", None)
        if start is not None:

            def start_load_kv(meta, _start=start):
                for req_id, (block_ids, _) in meta.loads.items():
                    self.log(f"load {req_id} into blocks {list(block_ids)}")
                return _start(meta)

            worker.start_load_kv = start_load_kv
        if finish is not None:

            def finish_loads(_finish=finish):
                done = _finish()
                if done:
                    errors = sorted(getattr(worker, "_load_errors", ()))
                    self.log(f"loads done {sorted(done)}, failed blocks {errors}")
                return done

            worker._finish_loads = finish_loads

    def owners(self, block_id: int) -> list[str]:
        manager = self.scheduler.kv_cache_manager
        out = []
        for single in manager.coordinator.single_type_managers:
            for req_id, blocks in single.req_to_blocks.items():
                if any(b.block_id == block_id for b in blocks):
                    out.append(req_id)
        return out

    def after_step(self) -> None:
        self.step_no += 1
        rows = getattr(self.worker, "_cache_rows", None)
        if rows is None:
            return
        nan = set(
            numpy.flatnonzero(numpy.isnan(rows.view(numpy.float32)).any(axis=1))
            .astype(int)
            .tolist()
        )
        pool = self.scheduler.kv_cache_manager.block_pool
        for b in sorted(nan - self.nan_blocks):
            block = pool.blocks[b]
            self.log(
                f"block {b} now holds NaN: owners {self.owners(b)}, ref_cnt "
                f"{block.ref_cnt}, cached {block.block_hash is not None}"
            )
        for b in sorted(self.nan_blocks - nan):
            self.log(f"block {b} clean again: owners {self.owners(b)}")
        self.nan_blocks = nan
        # A running request reading a NaN block.
        managers = self.scheduler.kv_cache_manager.coordinator.single_type_managers
        for req in self.scheduler.running:
            for single in managers:
                ids = [b.block_id for b in single.req_to_blocks.get(req.request_id, ())]
                bad = [b for b in ids if b in nan]
                if bad:
                    self.log(
                        f"running {req.request_id} has NaN blocks {bad} of {ids} "
                        f"(computed {req.num_computed_tokens}, cached "
                        f"{req.num_cached_tokens})"
                    )
