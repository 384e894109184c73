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

KI32-01 / KI32-02: with a pool tier configured, the workers measure the
engine's KV identity (weights fingerprint, in-page layout) once the KV
caches exist and again after every prefix-cache reset and every RPC to
the workers (KI32-03; ``integration/v0_32/kv_identity``).
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


def _initialize_kv_caches(self, vllm_config):
    from vllm_overlay.integration.v0_32.kv_identity import measure

    kv_cache_config = REGISTRY.original("KI32-01")(self, vllm_config)
    measure(self, vllm_config)  # before the scheduler (and its pool tier) is built
    return kv_cache_config


def reset_prefix_cache(self, *args, **kwargs):
    from vllm_overlay.integration.v0_32.kv_identity import measure

    done = REGISTRY.original("KI32-02")(self, *args, **kwargs)
    measure(self)  # new weights take effect at a reset: re-key the pool tiers
    return done


def collective_rpc(self, method, *args, **kwargs):
    from vllm_overlay.integration.v0_32.kv_identity import measure

    results = REGISTRY.original("KI32-03")(self, method, *args, **kwargs)
    measure(self)  # an RPC may have changed the weights (apply_model, RL updates)
    return results


_KI_FEATURE = "shared KV pool tier"
_KI_UPSTREAM = (
    "none (vLLM's config hashes name the model by path and do not see weights "
    "changed in place; vllm-project/vllm#16159 keyed by the model name)"
)

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
        id="KI32-01",
        module=MODULE,
        target="EngineCore._initialize_kv_caches",
        new=_initialize_kv_caches,
        feature=_KI_FEATURE,
        why="A shared pool must never hand a node KV it would not compute "
        "itself; the configuration does not show the weights (two mounts of "
        "one folder hash apart, two weights files under one path hash alike) "
        "nor the attention kernel's in-page layout (CPU_ATTN's AMX and vec "
        "kernels lay K out differently under one layout name). With a pool "
        "tier configured, the workers fingerprint their weights and probe "
        "their backend's KV-cache write once the KV caches exist, before the "
        "scheduler builds the tier (integration/v0_32/kv_identity).",
        upstream=_KI_UPSTREAM,
        removal="Drop when OffloadingConfig carries a weights fingerprint and "
        "the backend's page layout.",
    ),
    Patch(
        id="KI32-02",
        module=MODULE,
        target="EngineCore.reset_prefix_cache",
        new=reset_prefix_cache,
        feature=_KI_FEATURE,
        why="RL loops change weights in place (load_weights, apply_model, "
        "sleep/wake_up) and reset the prefix cache; upstream's tiering "
        "manager keeps secondary tiers across reset_cache, and config hashes "
        "do not change, so every node kept loading KV of the old weights. "
        "After each reset (wake_up's too) the workers fingerprint the weights "
        "again; other weights re-key the engine's pool tiers.",
        upstream=_KI_UPSTREAM,
        removal="Drop with KI32-01.",
    ),
    Patch(
        id="KI32-03",
        module=MODULE,
        target="EngineCore.collective_rpc",
        new=collective_rpc,
        feature=_KI_FEATURE,
        why="Weights also change through RPCs to the workers (LLM.apply_model, "
        "RL frameworks' update methods) with no reset after them: stock then "
        "has an empty or stale device cache of its own, but the pool would "
        "hand it every other node's KV of the old weights. After each RPC the "
        "workers fingerprint the weights again (no RPC of the overlay's own).",
        upstream=_KI_UPSTREAM,
        removal="Drop with KI32-01.",
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
