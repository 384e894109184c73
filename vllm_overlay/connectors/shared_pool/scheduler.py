"""Scheduler side of the shared pool connector: chain hashes, pool lookups,
and which blocks each step loads and stores.

Lookups never block the scheduler: the first time a request asks, a
lookup is submitted to the pool's lookup thread and the answer is ``None``
("ask again next step": vLLM 0.11.2 leaves the request waiting, others
run).  When the answer is in, the hits are returned; after
``lookup_wait_s`` without an answer the request computes without the pool
and the pool pauses itself (slow).  While the pool is paused, the answer is
0 at once.  Its ``KVPool`` starts no store or load threads.

The tickets, their deadlines and the late-ticket rule are the pool's
``LookupFlights`` (``core/pool/flights.py``, shared with the 0.32 pool
tier); what is remembered (leading hits per request range, for
``ANSWER_TTL_S``; refused blocks, for ``REFUSED_TTL_S``) is this release's
own (``core/pool/flights.py`` says why).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from vllm_overlay.connectors.shared_pool.common import (
    PoolMetadata,
    take_refused,
)
from vllm_overlay.core.pool.flights import LookupFlights
from vllm_overlay.core.pool.keys import pool_key

CHAIN_ROOT = b"vLLM shared KV pool chain root v1"
# A value refused by its check (checksum, MAC, layout, namespace) is not
# looked up again for this long; a transient failure (a dropped connection,
# an evicted key, a load over the in-flight limit, a deadline) is not
# remembered: the next request asks the pool again (the pool's own
# back-off decides whether it goes to the network).  The request whose load
# failed never asks again from its first failed block on: it recomputes
# (asking again at once, with the answer it had, looped on a missing key).
REFUSED_TTL_S = 300.0
ANSWER_TTL_S = 5.0  # a lookup's answer is reused for this long (same request)
SPIN_S = 0.002  # asked again this soon: the engine is idle-spinning
SPIN_YIELD_S = 0.001  # then hand the GIL to the lookup thread this long


@dataclasses.dataclass
class _Answer:
    """What the pool said about blocks ``start`` .. ``end`` (exclusive) of a
    request's chain: the first ``present`` of them are in the pool."""

    start: int
    end: int
    present: int
    when: float

    def hits(self, start: int, end: int, now: float) -> int | None:
        if now - self.when > ANSWER_TTL_S or not self.start <= start <= end <= self.end:
            return None
        return max(0, min(self.start + self.present, end) - start)


class SharedPoolScheduler:
    def __init__(self, vllm_config, ns: bytes, pool) -> None:
        from vllm.utils.hashing import get_hash_fn_by_name

        cache = vllm_config.cache_config
        self.block_size = cache.block_size
        self.world_size = vllm_config.parallel_config.world_size
        self.ns = ns
        self.pool = pool
        self._hash_fn = get_hash_fn_by_name(cache.prefix_caching_hash_algo)
        self._chains: dict[str, list[bytes]] = {}
        self._requests: dict[str, Any] = {}
        self._block_ids: dict[str, list[int]] = {}
        self._next_store: dict[str, int] = {}
        self._lookups: dict[str, tuple[int, int]] = {}  # req -> (start, hits)
        self._answers: dict[str, _Answer] = {}
        self._flights = LookupFlights(pool)
        self._pending: dict[str, Any] = {}  # req -> its flight (about: start, end)
        self._last_ask: dict[str, float] = {}  # last "ask again" answer
        self._loads: dict[str, tuple[list[int], list[bytes]]] = {}
        self._storing: set[str] = set()
        self._loading: dict[str, tuple[list[int], list[bytes]]] = {}
        self._refused: dict[bytes, float] = {}  # chain hash -> when
        self._failed_from: dict[str, int] = {}  # req -> first failed block
        self._load_start: dict[str, int] = {}

    def _chain(self, request) -> list[bytes]:
        from vllm.v1.core.kv_cache_utils import (
            generate_block_hash_extra_keys,
            hash_block_tokens,
        )

        chain = self._chains.setdefault(request.request_id, [])
        tokens = request.all_token_ids
        # vLLM keys a LoRA by name only; across nodes the name may stand for
        # another adapter, so the pool chain adds where it was loaded from.
        lora = getattr(request, "lora_request", None)
        lora_key = (f"lora-path={lora.lora_path}",) if lora is not None else ()
        mm_idx = 0
        while (len(chain) + 1) * self.block_size <= len(tokens):
            start = len(chain) * self.block_size
            end = start + self.block_size
            extra, mm_idx = generate_block_hash_extra_keys(request, start, end, mm_idx)
            if lora_key:
                extra = (*(extra or ()), *lora_key)
            parent = chain[-1] if chain else self._hash_fn(CHAIN_ROOT)
            chain.append(
                bytes(
                    hash_block_tokens(self._hash_fn, parent, tokens[start:end], extra)
                )
            )
        return chain

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        if getattr(request, "skip_reading_prefix_cache", False):
            return 0, False  # e.g. prompt logprobs: every position computed
        chain = self._chain(request)
        start = num_computed_tokens // self.block_size
        # Leave at least one token to compute; never a block whose load
        # failed for this request (it recomputes from there).
        last = min(len(chain), (request.num_tokens - 1) // self.block_size)
        last = min(last, self._failed_from.get(request.request_id, last))
        if last <= start:
            return 0, False
        hits = last - start
        # Stop before a block whose value was refused recently.
        now = time.monotonic()
        for i, h in enumerate(chain[start:last]):
            when = self._refused.get(h)
            if when is not None and now - when < REFUSED_TTL_S:
                hits = i
                break
        if hits == 0:
            return 0, False
        hits = self._pool_hits(request.request_id, chain, start, start + hits)
        if hits is None:
            return None, False  # the lookup is under way: ask again next step
        if hits == 0:
            return 0, False
        self._lookups[request.request_id] = (start, hits)
        return hits * self.block_size, True

    def _pool_hits(self, req_id: str, chain, start: int, end: int) -> int | None:
        """Leading blocks of ``chain[start:end]`` present for every rank;
        None while the lookup is under way (never waits)."""
        now = time.monotonic()
        answer = self._answers.get(req_id)
        if answer is not None and (hits := answer.hits(start, end, now)) is not None:
            return hits
        pending, since = self._pending.get(req_id), None
        if pending is not None and not (
            pending.about[0] <= start <= end <= pending.about[1]
        ):
            # Another range now: asked again, within the first ask's wait.
            since = pending.since
            self._flights.drop(self._pending.pop(req_id))
            pending = None
        if pending is None:
            keys = [
                pool_key(self.ns, h, rank, self.pool.config.name_key)
                for rank in range(self.world_size)
                for h in chain[start:end]
            ]
            pending = self._flights.ask(keys, (start, end), now, since)
            self._pending[req_id] = pending
        settled, answer_flags = self._flights.poll(pending, now)
        if not settled:
            self._yield_if_spinning(req_id, now)
            return None
        del self._pending[req_id]  # (late: abandoned, the pool pauses itself)
        self._last_ask.pop(req_id, None)
        p_start, p_end = pending.about
        n = p_end - p_start
        present = n
        for rank in range(self.world_size):
            flags = (answer_flags or [False] * n * self.world_size)[
                rank * n : (rank + 1) * n
            ]
            present = min(present, next((i for i, p in enumerate(flags) if not p), n))
        answer = _Answer(p_start, p_end, present, now)
        self._answers[req_id] = answer
        return answer.hits(start, end, now)

    def _yield_if_spinning(self, req_id: str, now: float) -> None:
        """When the engine has nothing else to run it asks again at once,
        in a tight loop that can keep the lookup thread from ever getting
        the GIL (measured: 250-800 ms for one EXISTS on 2 CPU cores).  Asked
        again within SPIN_S, this call sleeps SPIN_YIELD_S: only an idle
        engine pays it, and it waits on nothing (not the network)."""
        last = self._last_ask.get(req_id)
        self._last_ask[req_id] = now
        if last is not None and now - last < SPIN_S:
            time.sleep(SPIN_YIELD_S)
            self._last_ask[req_id] = time.monotonic()

    def update_state_after_alloc(
        self, request, blocks, num_external_tokens: int
    ) -> None:
        req_id = request.request_id
        self._requests[req_id] = request
        block_ids = list(blocks.get_block_ids()[0])
        start, hits = self._lookups.pop(req_id, (0, 0))
        if num_external_tokens:
            n = num_external_tokens // self.block_size
            assert n == hits, (n, hits)
            chain = self._chains[req_id]
            self._loads[req_id] = (block_ids[-n:], chain[start : start + n])
            self._load_start[req_id] = start
        # Called again when a loaded request is scheduled: keep the mark.
        self._next_store[req_id] = max(self._next_store.get(req_id, 0), start + hits)

    def build_connector_meta(self, scheduler_output) -> PoolMetadata:
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
            yield_req_data,
        )

        stores = {}
        for req_id, new_ids, preempted in yield_req_data(scheduler_output):
            if req_id not in self._requests:
                continue
            ids = self._block_ids.setdefault(req_id, [])
            if preempted:
                ids.clear()
            if new_ids:
                ids.extend(new_ids[0])
            request = self._requests[req_id]
            done = (
                request.num_computed_tokens
                + scheduler_output.num_scheduled_tokens.get(req_id, 0)
            )
            chain = self._chain(request)
            full = min(done // self.block_size, len(chain), len(ids))
            first = self._next_store.get(req_id, 0)
            if full > first:
                stores[req_id] = (ids[first:full], chain[first:full])
                self._next_store[req_id] = full
                self._storing.add(req_id)
        meta = PoolMetadata(loads=self._loads, stores=stores)
        self._loading.update(self._loads)
        self._loads = {}
        return meta

    def update_connector_output(self, connector_output) -> None:
        for req_id in connector_output.finished_sending or ():
            self._storing.discard(req_id)
        invalid = connector_output.invalid_block_ids or set()
        refused = take_refused(connector_output)
        now = time.monotonic()
        for req_id in connector_output.finished_recving or ():
            block_ids, chain = self._loading.pop(req_id, ((), ()))
            start = self._load_start.pop(req_id, 0)
            for i, (block_id, h) in enumerate(zip(block_ids, chain)):
                if block_id in refused:  # not looked up again (for a while)
                    self._refused[h] = now
                if block_id not in invalid:
                    continue
                if req_id in self._next_store:
                    # Store it once recomputed (an honest value replaces a
                    # refused one that was deleted).
                    self._next_store[req_id] = min(self._next_store[req_id], start + i)
                if req_id in self._requests:  # (not finished meanwhile)
                    first = self._failed_from.get(req_id, start + i)
                    self._failed_from[req_id] = min(first, start + i)
                    self._answers.pop(req_id, None)
        if len(self._refused) > 100_000:
            self._refused = {
                h: t for h, t in self._refused.items() if now - t < REFUSED_TTL_S
            }

    def request_finished(self, request, block_ids):
        req_id = request.request_id
        for table in (
            self._loads,  # (not sent yet: its blocks are never written)
            self._chains,
            self._requests,
            self._block_ids,
            self._next_store,
            self._lookups,
            self._load_start,
            self._answers,
            self._last_ask,
            self._failed_from,
        ):
            table.pop(req_id, None)
        pending = self._pending.pop(req_id, None)
        if pending is not None:
            self._flights.drop(pending)
        # A load under way still writes into its blocks: they are freed when
        # the worker reports the request finished (after the load landed).
        loading = self._loading.pop(req_id, None) is not None
        return req_id in self._storing or loading, None
