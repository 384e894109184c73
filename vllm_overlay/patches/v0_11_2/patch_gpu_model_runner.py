"""vllm/v1/worker/gpu_model_runner.py: allocate and register cross-layer KV.

``GPUModelRunner.initialize_kv_cache_tensors``: when
``vllm_overlay.integration.cross_layer.plan_cross_layer_kv_cache`` accepts,
one buffer is allocated for all layers and each layer gets a strided view into it; KV
sharing and ``bind_kv_cache`` then run exactly as stock.  Otherwise the stock
method runs.  Either way one log line says which layout and why.

``GPUModelRunner.initialize_kv_cache``: runs stock, except that an opted-in
connector receives ``register_cross_layers_kv_cache(buffer, backend, layout)``
instead of ``register_kv_caches`` when the buffer exists.

``CPUModelRunner`` inherits both methods, so the CPU platform is covered.
"""

import sys

from vllm_overlay.core.patching import REGISTRY, Patch
from vllm_overlay.integration.cross_layer import (
    allocate_cross_layer_kv_cache,
    log_plan,
    plan_cross_layer_kv_cache,
)

MODULE = "vllm.v1.worker.gpu_model_runner"


def initialize_kv_cache_tensors(self, kv_cache_config, kernel_block_sizes):
    plan = plan_cross_layer_kv_cache(self, kv_cache_config, kernel_block_sizes)
    log_plan(plan)
    self.cross_layers_kv_cache = None
    self.cross_layers_attn_backend = None
    self.cross_layers_kv_layout = None
    if not plan.enabled:
        return REGISTRY.original("CL-09")(self, kv_cache_config, kernel_block_sizes)

    buffer, kv_caches = allocate_cross_layer_kv_cache(
        plan, kv_cache_config, self.device
    )
    self.cross_layers_kv_cache = buffer
    self.cross_layers_attn_backend = plan.backend
    self.cross_layers_kv_layout = plan.layout
    # The rest is stock: KV sharing aliases, then binding to the layers.
    for layer_name, target_layer_name in self.shared_kv_cache_layers.items():
        kv_caches[layer_name] = kv_caches[target_layer_name]
    num_attn_module = (
        2 if self.model_config.hf_config.model_type == "longcat_flash" else 1
    )
    sys.modules[MODULE].bind_kv_cache(
        kv_caches,
        self.compilation_config.static_forward_context,
        self.kv_caches,
        num_attn_module,
    )
    return kv_caches


def initialize_kv_cache(self, kv_cache_config):
    from vllm.distributed.kv_transfer import (
        get_kv_transfer_group,
        has_kv_transfer_group,
    )

    stock = REGISTRY.original("CL-10")
    if not has_kv_transfer_group():
        return stock(self, kv_cache_config)
    connector = get_kv_transfer_group()
    if not getattr(connector, "prefer_cross_layer_blocks", False):
        return stock(self, kv_cache_config)

    # Stock calls connector.register_kv_caches(kv_caches) once the tensors
    # exist; route that one call to the cross-layer registration.
    def register_kv_caches(kv_caches):
        # Absent when CL-09 is skipped (VLLM_OVERLAY_SKIP_PATCHES): stock
        # allocated per-layer tensors.
        if getattr(self, "cross_layers_kv_cache", None) is None:
            return type(connector).register_kv_caches(connector, kv_caches)
        return connector.register_cross_layers_kv_cache(
            self.cross_layers_kv_cache,
            self.cross_layers_attn_backend,
            self.cross_layers_kv_layout,
        )

    connector.register_kv_caches = register_kv_caches
    try:
        return stock(self, kv_cache_config)
    finally:
        del connector.register_kv_caches


_UPSTREAM = "vllm-project/vllm#27743 (v0.12.0)"
_REMOVAL = (
    "Drop when the base is vLLM >= 0.12.0 (its "
    "KVConnectorModelRunnerMixin.allocate_uniform_kv_caches); keep "
    "only the layout argument if upstream still lacks it."
)

PATCHES = [
    Patch(
        id="CL-09",
        module=MODULE,
        target="GPUModelRunner.initialize_kv_cache_tensors",
        new=initialize_kv_cache_tensors,
        why="Allocate one KV buffer for all layers (each block one contiguous "
        "run) when the model, connector and backend allow it; log the choice.",
        upstream=_UPSTREAM,
        removal=_REMOVAL,
    ),
    Patch(
        id="CL-10",
        module=MODULE,
        target="GPUModelRunner.initialize_kv_cache",
        new=initialize_kv_cache,
        why="Hand the single buffer and its layout to the connector through "
        "register_cross_layers_kv_cache instead of register_kv_caches.",
        upstream=_UPSTREAM,
        removal=_REMOVAL,
    ),
]
