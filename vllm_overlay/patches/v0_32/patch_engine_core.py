"""vllm/v1/engine/core.py: the PP KV budget split by layers, and no busy
loop while requests only wait for KV loads (0.32).

``EngineCore._initialize_kv_caches`` calls ``get_kv_cache_configs`` (which
it imports into this module) with every worker's KV specs and the memory
each worker reported; upstream then sizes each stage with all of it and
shrinks every stage to the smallest stage's block count (#25164 as
merged).  With ``--enable-pp-prop-kv-cache`` each worker's memory becomes
its stage's share of ``--kv-cache-memory-bytes`` by layers first
(``integration/v0_32/pp_kv``), so every stage fits the same number of
blocks.  Without the flag the call is upstream's, unchanged.

EC32-01 / EC32-02: ``EngineCore.step`` (and ``step_with_batch_queue`` with
an empty batch queue) first waits a little when every request waits for its
async KV load, or for the connector to say how many tokens it holds (a
secondary tier's lookup or promotion), instead of running empty steps back
to back that hold the GIL the load's threads need: ``core/idle_wait`` (the
wait, shared with 0.11.2's EC-01/EC-02) with 0.32's gate
(``integration/v0_32/idle_wait``: its queues, and ``TRANSFER_DONE``).
"""

from vllm_overlay.core.patching import REGISTRY, Patch

MODULE = "vllm.v1.engine.core"
PATCH_ID = "PP32-04"


# A wrapper: the overlay's step, then upstream's function (``patches/latest``
# renders the step at the top of upstream's body, where it is defined).
def get_kv_cache_configs(vllm_config, kv_cache_specs, available_memory):
    from vllm_overlay.integration.v0_32.pp_kv import split_available_memory

    available_memory = split_available_memory(
        vllm_config, kv_cache_specs, available_memory
    )
    return REGISTRY.original(PATCH_ID)(vllm_config, kv_cache_specs, available_memory)


def step(self):
    from vllm_overlay.integration.v0_32.idle_wait import idle_wait

    idle_wait(self)
    return REGISTRY.original("EC32-01")(self)


def step_with_batch_queue(self):
    from vllm_overlay.integration.v0_32.idle_wait import idle_wait

    if not self.batch_queue:  # nothing in flight on the workers
        idle_wait(self)
    return REGISTRY.original("EC32-02")(self)


_IDLE_WHY = (
    "While every request waits for an async KV load (upstream's "
    "OffloadingConnector: host memory, a secondary tier), the engine runs "
    "empty steps back to back and holds the GIL the transfer threads need: "
    "measured on CPU, a 128 MiB host reload in 256 copies took 1.77 s under "
    "27 000 empty steps; the same while a secondary tier promotes blocks "
    "into host memory (the connector defers the request). Such a step now "
    "first waits, at most 2 ms, for a transfer of this process to complete."
)
_IDLE_UPSTREAM = "none found (0.11.2's EC-01/EC-02 are the same change)"
_IDLE_REMOVAL = (
    "When upstream's engine loop blocks on KV transfer progress instead of "
    "stepping while only WAITING_FOR_REMOTE_KVS requests remain."
)
_IDLE_FEATURE = "async KV loads (CPU offloading, the pool tier)"

PATCHES = [
    Patch(
        id=PATCH_ID,
        module=MODULE,
        target="get_kv_cache_configs",
        new=get_kv_cache_configs,
        feature="pipeline-parallel KV budget",
        why="Upstream gives every stage the whole --kv-cache-memory-bytes and "
        "keeps the smallest stage's block count: with an uneven partition the "
        "stage with more layers sets the blocks and the budget is per stage. "
        "With the flag the budget is the pipeline's, split by layers, so every "
        "stage fits the same blocks (more than upstream for the same memory).",
        upstream="vllm-project/vllm#25164 (flag version; upstream merged the "
        "min-shrink without the flag)",
        removal="Drop if upstream sizes PP stages by their share of one budget.",
    ),
    Patch(
        id="EC32-01",
        module=MODULE,
        target="EngineCore.step",
        new=step,
        feature=_IDLE_FEATURE,
        why=_IDLE_WHY,
        upstream=_IDLE_UPSTREAM,
        removal=_IDLE_REMOVAL,
    ),
    Patch(
        id="EC32-02",
        module=MODULE,
        target="EngineCore.step_with_batch_queue",
        new=step_with_batch_queue,
        feature=_IDLE_FEATURE,
        why=_IDLE_WHY + " (pipeline parallel, async scheduling: the batch-queue step)",
        upstream=_IDLE_UPSTREAM,
        removal=_IDLE_REMOVAL,
    ),
]
