"""vllm/v1/core/kv_cache_manager.py: admit an async KV load only if the
request can finish its prefill afterwards.

Stock 0.11.2 allocates, for a request whose prefix a connector loads
asynchronously, only the blocks of the loaded tokens.  Such a request holds
them without running and cannot be preempted.  Under KV pressure many
loading requests together take every free block; once loaded, none of them
can get the blocks for the rest of its prompt, nothing runs, nothing is
freed: the engine stalls for good (vLLM issue #45388; it is what hung the
offload and pool lm-eval runs).

Here every parked request (admitted with ``delay_cache_blocks``) keeps a
*deficit*: the blocks it still needs to finish its prompt.  A new async load
is admitted only if its whole prompt fits next to the deficits already
promised; otherwise ``allocate_slots`` returns None, as for any request that
does not fit, and the scheduler tries again later.  The deficit is released
when the request's own prefill allocation succeeds or it is freed.  With
KV-03 (parked requests first in the waiting queue) the blocks a parked
request needs are always there once nothing else runs.
"""

from __future__ import annotations

import logging

from vllm_overlay.core.patching import REGISTRY, Patch

MODULE = "vllm.v1.core.kv_cache_manager"
logger = logging.getLogger("vllm.overlay")


def parked_deficits(manager) -> dict[str, int]:
    """request id -> blocks still needed, for each request parked on an
    async KV load."""
    return manager.__dict__.setdefault("vllm_overlay_parked", {})


def _counters(manager) -> dict[str, int]:
    return manager.__dict__.setdefault(
        "vllm_overlay_admission", {"admitted": 0, "deferred": 0}
    )


def allocate_slots(
    self,
    request,
    num_new_tokens: int,
    num_new_computed_tokens: int = 0,
    new_computed_blocks=None,
    num_lookahead_tokens: int = 0,
    delay_cache_blocks: bool = False,
    num_encoder_tokens: int = 0,
):
    original = REGISTRY.original("KV-01")
    parked = parked_deficits(self)
    rid = request.request_id
    if delay_cache_blocks:
        computed = (
            new_computed_blocks.blocks
            if new_computed_blocks is not None
            else self.empty_kv_cache_blocks.blocks
        )
        prompt_tokens = min(
            request.num_tokens + num_lookahead_tokens, self.max_model_len
        )
        need = self.coordinator.get_num_blocks_to_allocate(
            request_id=rid,
            num_tokens=prompt_tokens,
            new_computed_blocks=computed,
            num_encoder_tokens=num_encoder_tokens,
        )
        promised = sum(v for k, v in parked.items() if k != rid)
        free = self.block_pool.get_num_free_blocks()
        if need + promised > free:
            _counters(self)["deferred"] += 1
            logger.debug(
                "vllm-overlay: async KV load of %s deferred: its prompt needs "
                "%d blocks, %d free, %d promised to %d parked requests",
                rid,
                need,
                free,
                promised,
                len(parked),
            )
            return None
    blocks = original(
        self,
        request,
        num_new_tokens,
        num_new_computed_tokens,
        new_computed_blocks,
        num_lookahead_tokens,
        delay_cache_blocks,
        num_encoder_tokens,
    )
    if blocks is None:
        return None
    if delay_cache_blocks:
        parked[rid] = self.coordinator.get_num_blocks_to_allocate(
            request_id=rid,
            num_tokens=prompt_tokens,
            new_computed_blocks=self.empty_kv_cache_blocks.blocks,
            num_encoder_tokens=num_encoder_tokens,
        )
        _counters(self)["admitted"] += 1
    else:
        parked.pop(rid, None)  # its prefill has its blocks now
    return blocks


def free(self, request) -> None:
    parked_deficits(self).pop(request.request_id, None)
    return REGISTRY.original("KV-02")(self, request)


_FEATURE = "async KV loads under KV pressure"
_UPSTREAM = (
    "vLLM issue #45388 (scheduler stalls under KV pressure with an "
    "offloading connector); fixed after 0.11.2, differently, by "
    "PR #44560 (admission) and PR #57841 (queue order)"
)

PATCHES = [
    Patch(
        id="KV-01",
        module=MODULE,
        target="KVCacheManager.allocate_slots",
        new=allocate_slots,
        feature=_FEATURE,
        why="Async-load requests hold blocks without running; admitting "
        "them only for the loaded tokens lets them take every block and "
        "stall the engine. Admit one only if its whole prompt fits next "
        "to the blocks promised to the others.",
        upstream=_UPSTREAM,
        removal="Drop with KV-02/KV-03 when rebasing on a vLLM whose "
        "scheduler has the upstream fix (test_kv_pressure_e2e passes "
        "with VLLM_OVERLAY_SKIP_PATCHES=KV-01,KV-02,KV-03).",
    ),
    Patch(
        id="KV-02",
        module=MODULE,
        target="KVCacheManager.free",
        new=free,
        feature=_FEATURE,
        why="Forget a parked request's promised blocks when it is freed "
        "(finished, aborted, or a failed load with nothing valid).",
        upstream=_UPSTREAM,
        removal="With KV-01.",
    ),
]
