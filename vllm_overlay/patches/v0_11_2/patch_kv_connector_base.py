"""vllm/distributed/kv_transfer/kv_connector/v1/base.py: cross-layer opt-in.

Adds to ``KVConnectorBase_V1``:

* ``prefer_cross_layer_blocks`` (class attribute, default False): a connector
  sets it to ask for one KV buffer for all layers;
* ``register_cross_layers_kv_cache(kv_cache, attn_backend, layout)``: called
  instead of ``register_kv_caches`` when that buffer was allocated.  ``layout``
  is a ``vllm_overlay.core.kv_layout.CrossLayerKVLayout``: the explicit physical
  description upstream's reviewers asked for (upstream passes only the
  backend class).

Connectors that do not opt in keep receiving ``register_kv_caches`` as before.
"""

from vllm_overlay.core.patching import Patch

MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.base"


def register_cross_layers_kv_cache(self, kv_cache, attn_backend, layout):
    """Receive the single KV buffer of all layers.

    Args:
        kv_cache: the physical buffer, contiguous, shape ``layout.shape``
            with dims ``layout.dims`` (blocks outermost).
        attn_backend: the attention backend class of every layer.
        layout: ``CrossLayerKVLayout`` describing the buffer.
    """
    return


_WHY = (
    "vLLM 0.11.2 has no way for a connector to ask for, or receive, one "
    "KV buffer for all layers."
)
_UPSTREAM = (
    "vllm-project/vllm#27743 (v0.12.0; its register call has no layout argument)"
)
_REMOVAL = (
    "Drop when the base is vLLM >= 0.12.0; the layout argument moves "
    "to a connector helper or an upstream follow-up."
)

PATCHES = [
    Patch(
        id="CL-07",
        module=MODULE,
        target="KVConnectorBase_V1.prefer_cross_layer_blocks",
        new=False,
        why=_WHY,
        upstream=_UPSTREAM,
        removal=_REMOVAL,
    ),
    Patch(
        id="CL-08",
        module=MODULE,
        target="KVConnectorBase_V1.register_cross_layers_kv_cache",
        new=register_cross_layers_kv_cache,
        why=_WHY,
        upstream=_UPSTREAM,
        removal=_REMOVAL,
    ),
]
