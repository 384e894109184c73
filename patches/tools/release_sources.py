"""What ``release_compat.py`` starts from: per patch set (and, for a set
that groups its files, per feature) the overlay code it runs, the upstream
files it relies on without importing them, and the upstream functions whose
result is an identity the overlay keeps (each with why).  From these the
tool derives the rest (``upstream_follow``): the modules of FOLLOWED that
the touched offloading code imports, and the files defining what the
relied-on functions call.

A file is here when a change to it can change the stored bytes, their
identity (the pool's namespace, the keys), or a contract the overlay keeps
with its caller, with every patch still applying.
"""

from __future__ import annotations

# Upstream packages (module prefixes) whose modules, imported by a touched
# module in them, are touched too: the offloading code that moves and
# accounts for the bytes, and the block hashes the keys are made of.
FOLLOWED = (
    "vllm.v1.kv_offload",
    "vllm.distributed.kv_transfer.kv_connector",
    "vllm.v1.core.kv_cache_utils",
)

_HASHES = (
    "the block hashes the offloading keys are made of (hash_block_tokens, "
    "get_request_block_hasher) and the block sizes the offloading config "
    "resolves (resolve_kv_cache_block_sizes)"
)
_AGGREGATE = (
    "OffloadingWorkerMetadata.aggregate sums the workers' completed_jobs; "
    "OF32-06 takes the failure flag off that sum, so how it sums decides "
    "whether a failed store completes as stored"
)
_ISA = (
    "CPU_ATTN picks the kernel ISA per host (_get_attn_isa): vec, vec16 and "
    "AMX lay K out differently in a page, so the pool's identity reads it"
)
_FACTORY = (
    "loads the tier by module_path and takes out type/module_path/"
    "backpressure (config_check.FACTORY_KEYS)"
)
_GPU_WORKER = (
    "upstream's host chunk layout (tensor after tensor, one "
    "create_next_worker_view each), which the CPU worker and a pool shared "
    "with GPU nodes must match"
)
_REGION = (
    "the host region whose per-tensor views (create_next_worker_view) fix "
    "the chunk layout the workers write (tests/v0_32/test_chunk_layout.py)"
)
_CPU_SPEC = (
    "builds the host tier the pool tier stores from and loads into (the "
    "region, blocks_per_chunk, the worker)"
)

# Upstream functions whose result is an identity the overlay keeps -> why.
# PT32-01 (kv_identity_factors) puts these hashes in the pool's namespace.
_IDENTITY = "PT32-01 (kv_identity_factors) puts it in the pool's namespace"
IDENTITY_FUNCTIONS = {
    "vllm/config/model.py:ModelConfig.compute_hash": "the model config's "
    "hash (and its fields) " + _IDENTITY,
    "vllm/config/cache.py:CacheConfig.compute_hash": "the cache config's "
    "hash (and prefix_caching_hash_algo) " + _IDENTITY,
    "vllm/config/lora.py:LoRAConfig.compute_hash": "the LoRA config's hash "
    + _IDENTITY,
}

# The v0_32 set: upstream files its code never imports but whose behaviour
# it relies on (paths in the vLLM tree) -> why.
RELIED_ON = {
    "vllm/v1/kv_offload/tiering/manager.py": "TieringOffloadingManager calls "
    "the pool tier's drain_jobs() in reset_cache and then asserts every job "
    "finished (the drain contract SharedPoolTier keeps)",
    "vllm/v1/kv_offload/tiering/factory.py": _FACTORY,
    "vllm/distributed/kv_transfer/kv_connector/v1/offloading/worker.py": "the "
    "only consumer of the CPU worker's TransferResults (what it does with "
    "success=False)",
    "vllm/distributed/kv_transfer/kv_connector/v1/offloading/config.py": "the "
    "OffloadingConfig the spec, the tiers and PT32-01 read",
    "vllm/distributed/kv_transfer/kv_connector/v1/offloading/common.py": (_AGGREGATE),
    "vllm/distributed/kv_transfer/kv_connector/v1/base.py": "the connector "
    "contract OF32-05 keeps (a failed receive is also reported finished)",
    "vllm/v1/kv_offload/cpu/gpu_worker.py": _GPU_WORKER,
    "vllm/v1/kv_offload/cpu/shared_offload_region.py": _REGION,
    "vllm/v1/core/kv_cache_utils.py": _HASHES,
    "vllm/v1/attention/backends/cpu_attn.py": _ISA,
    "vllm/v1/core/sched/scheduler.py": "the request queues the idle wait "
    "(integration/v0_32/idle_wait.py) reads",
}


# The v0_33 set, per feature (version_gate.FEATURE_RELEASES' names): the
# overlay code it runs (files or folders; the feature's patch modules are
# added from the set's FEATURES), the upstream files it relies on without
# importing them, and the identity functions it reads, each with why.
_POOL_MANAGER = "the manager drives every tier method (lookups, stores, "
FEATURE_SOURCES: dict[str, dict] = {
    "pool_tier": {
        "sources": [
            "vllm_overlay/patches/v0_32/patch_offloading_connector.py",
            "vllm_overlay/integration/v0_32/pool_tier",
        ],
        "relied_on": {
            "vllm/v1/kv_offload/tiering/manager.py": _POOL_MANAGER
            + "promotions, drain_jobs in reset_cache, the promotion hold "
            "after a reset) and asserts every job it is told of is known",
            "vllm/v1/kv_offload/tiering/spec.py": "builds the manager and "
            "the tiers from secondary_tiers (tier_poll_interval_s, the "
            "config_info keys)",
            "vllm/v1/kv_offload/tiering/factory.py": _FACTORY,
            "vllm/v1/kv_offload/tiering/backpressure.py": "fed by the tier's "
            "JobResults (failed stores count with failure_threshold set)",
            "vllm/v1/kv_offload/tiering/metrics.py": "reads the JobResults' "
            "transfer sizes and times",
            "vllm/v1/kv_offload/config.py": "the OffloadingConfig fields "
            "identity.tier_factors namespaces the pool by",
            "vllm/v1/kv_offload/cpu/gpu_worker.py": _GPU_WORKER,
            "vllm/v1/kv_offload/cpu/shared_offload_region.py": _REGION,
            "vllm/v1/kv_offload/cpu/spec.py": _CPU_SPEC,
            "vllm/v1/core/kv_cache_utils.py": _HASHES,
            "vllm/v1/attention/backends/cpu_attn.py": _ISA,
            "vllm/distributed/kv_transfer/kv_connector/v1/offloading/"
            "config.py": "build_offloading_config, which PT32-01 wraps",
            "vllm/distributed/kv_transfer/kv_connector/v1/offloading/"
            "scheduler.py": "calls the manager under its lock: lookups, "
            "on_schedule_end (the tier's per-step flush), the reset fence",
            "vllm/distributed/kv_transfer/kv_connector/v1/offloading/"
            "common.py": "OffloadingWorkerMetadata.aggregate sums the "
            "workers' completed_jobs the scheduler completes the stores the "
            "pool tier copies out by",
        },
        "functions": IDENTITY_FUNCTIONS,
    },
    "pp_prop_kv_cache": {
        "sources": ["vllm_overlay/integration/v0_32/pp_kv.py"],
        "relied_on": {
            "vllm/v1/core/kv_cache_planning.py": "defines the "
            "get_kv_cache_configs PP33-04 wraps: blocks = memory // bytes "
            "per block per worker, then the min over stages",
            "vllm/v1/core/kv_cache_config_builder.py": "the bytes per block "
            "that arithmetic divides by",
            "vllm/v1/worker/gpu_worker.py": "determine_available_memory "
            "reports kv_cache_memory_bytes as each worker's memory",
            "vllm/distributed/utils.py": "get_pp_indices: the partition the "
            "split's layer counts follow",
        },
        "functions": {},
    },
}
