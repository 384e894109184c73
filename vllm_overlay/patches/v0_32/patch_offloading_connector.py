"""vllm/distributed/kv_transfer/kv_connector/v1/offloading_connector.py:
the offloading config names the model config whose KV it holds (0.32).

``OffloadingConnector.__init__`` builds the ``OffloadingConfig`` its spec
and tiers see with ``build_offloading_config`` (imported into this module).
That config names the model by its path and the KV dtype only: a tier
shared by several engines (a Redis/Valkey pool) cannot tell whether
another engine's blocks were computed with the same weights, revision,
quantization, RoPE overrides or prefix hash; they all change the bytes
under one block hash.  With this patch the config's
``extra_config["kv_identity"]`` lists what decides the KV bytes
(``integration/v0_32/kv_identity``: vLLM's own hashes of those configs
without the model's location, and the engine's weights fingerprint and
in-page layout measured by KI32-01), so a shared tier namespaces its keys
by them.

``get_transfer_results`` (OF32-05) also returns the loads whose copy failed
as failed receives (``failed_recving``; OF32-04 in
``patch_offloading_worker`` collects them), so the scheduler applies
``kv_load_failure_policy`` to their requests.
"""

from __future__ import annotations

import dataclasses

from vllm_overlay.core.patching import REGISTRY, Patch
from vllm_overlay.integration.v0_32 import kv_identity
from vllm_overlay.integration.v0_32.kv_identity import KV_IDENTITY

MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector"
PATCH_ID = "PT32-01"
FAILED_LOADS_ID = "OF32-05"


def build_offloading_config(vllm_config, kv_cache_config):
    config = REGISTRY.original(PATCH_ID)(vllm_config, kv_cache_config)
    extra = dict(config.extra_config)
    # The configuration's part, and in the engine core's process the
    # engine's measured part (KI32-01 measured it before the scheduler and
    # its connector were built).
    extra[KV_IDENTITY] = (
        kv_identity.config_factors(vllm_config)
        + kv_identity.engine(config.engine_id).factors()
    )
    return dataclasses.replace(config, extra_config=extra)


def get_transfer_results(self, finished_req_ids):
    results = REGISTRY.original(FAILED_LOADS_ID)(self, finished_req_ids)
    worker = self.connector_worker
    failed = worker.__dict__.get("_failed_load_req_ids") if worker else None
    if failed:
        # Reported finished receiving too (get_finished), as upstream's
        # scheduler requires of a failed receive.
        results.failed_recving |= failed & results.finished_recving
        failed -= results.finished_recving
    return results


PATCHES = [
    Patch(
        id=PATCH_ID,
        module=MODULE,
        target="build_offloading_config",
        new=build_offloading_config,
        feature="shared KV pool tier",
        why="OffloadingConfig names the model by path and KV dtype only; a "
        "secondary tier shared by several engines must not serve blocks "
        "computed under another revision, quantization, RoPE override, "
        "prefix hash or LoRA config. The patch adds vLLM's own hashes of "
        "those configs to the config's extra_config (kv_identity), and the "
        "pool tier refuses to start without them.",
        upstream="none yet (a field of OffloadingModelConfig with "
        "model_config.compute_hash() would do; vllm-project/vllm#16159 "
        "namespaced its keys the same way)",
        removal="Drop once OffloadingConfig carries the model config's hash; "
        "the pool tier then reads it from there.",
    ),
    Patch(
        id=FAILED_LOADS_ID,
        module=MODULE,
        target="OffloadingConnector.get_transfer_results",
        new=get_transfer_results,
        feature="host offloading on the CPU platform",
        why="The base class's get_transfer_results reports no failed receives; "
        "with OF32-04 a load whose copy failed is returned in failed_recving, "
        "so the scheduler applies kv_load_failure_policy to its request "
        "instead of running it on KV never written.",
        upstream="none (OffloadingConnector does not report failed loads)",
        removal="Drop with OF32-04.",
    ),
]
