"""CrossLayerProbeConnector: a KV connector that only opts in and reports.

It moves no KV data.  It exists so that the cross-layer layout is reachable
(tests, the demo) without a transfer connector: it sets
``prefer_cross_layer_blocks`` and records what the model runner registered.

``kv_connector_extra_config``:
  ``prefer_cross_layer_blocks`` (bool, default true): opt in or not;
  ``report_path`` (str, optional): the worker writes a JSON summary of the
  registered KV cache there (rank suffix ``.rank<N>`` when world size > 1).
"""

from __future__ import annotations

import json
import logging
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

logger = logging.getLogger("vllm.overlay")


def tensor_summary(tensor: torch.Tensor) -> dict[str, Any]:
    return {
        "shape": list(tensor.shape),
        "stride": list(tensor.stride()),
        "dtype": str(tensor.dtype).removeprefix("torch."),
        "data_ptr": tensor.data_ptr(),
        "storage_ptr": tensor.untyped_storage().data_ptr(),
        "storage_nbytes": tensor.untyped_storage().nbytes(),
        "element_size": tensor.element_size(),
    }


class CrossLayerProbeConnector(KVConnectorBase_V1):
    def __init__(
        self, vllm_config, role: KVConnectorRole, kv_cache_config=None
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        unknown = set(extra) - {"prefer_cross_layer_blocks", "report_path"}
        if unknown:
            raise ValueError(
                f"CrossLayerProbeConnector: unknown "
                f"kv_connector_extra_config keys {sorted(unknown)}"
            )
        prefer = extra.get("prefer_cross_layer_blocks", True)
        if not isinstance(prefer, bool):
            raise ValueError(
                "CrossLayerProbeConnector: "
                "prefer_cross_layer_blocks must be true or false, "
                f"got {prefer!r}"
            )
        self.prefer_cross_layer_blocks = prefer
        self.report_path: str | None = extra.get("report_path")
        self.registered_mode: str | None = None
        self.kv_caches: dict[str, torch.Tensor] | None = None
        self.cross_layer_buffer: torch.Tensor | None = None
        self.cross_layer_layout = None
        self.attn_backend = None

    # ==============================
    # Worker-side methods
    # ==============================
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.registered_mode = "per-layer"
        self.kv_caches = kv_caches
        self._write_report()

    def register_cross_layers_kv_cache(self, kv_cache, attn_backend, layout) -> None:
        self.registered_mode = "cross-layer"
        self.cross_layer_buffer = kv_cache
        self.attn_backend = attn_backend
        self.cross_layer_layout = layout
        self._write_report()

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        return

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(
        self, layer_name: str, kv_layer, attn_metadata, **kwargs: Any
    ) -> None:
        return

    def wait_for_save(self) -> None:
        return

    # ==============================
    # Scheduler-side methods
    # ==============================
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        return 0, False

    def update_state_after_alloc(
        self, request, blocks, num_external_tokens: int
    ) -> None:
        return

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        return KVConnectorMetadata()

    # ==============================
    def _bound_layers(self) -> dict[str, dict[str, Any]]:
        """What each attention layer will really read: its bound kv_cache."""
        context = self._vllm_config.compilation_config.static_forward_context
        bound = {}
        for name, layer in context.items():
            kv_cache = getattr(layer, "kv_cache", None)
            if kv_cache and isinstance(kv_cache[0], torch.Tensor):
                bound[name] = tensor_summary(kv_cache[0])
        return bound

    def _write_report(self) -> None:
        logger.info(
            "CrossLayerProbeConnector: KV cache registered as %s", self.registered_mode
        )
        if not self.report_path:
            return
        report = {
            "mode": self.registered_mode,
            "layout": (
                None
                if self.cross_layer_layout is None
                else self.cross_layer_layout.to_dict()
            ),
            "attn_backend": (
                None if self.attn_backend is None else self.attn_backend.get_name()
            ),
            "buffer": (
                None
                if self.cross_layer_buffer is None
                else tensor_summary(self.cross_layer_buffer)
            ),
            "registered_layers": {
                name: tensor_summary(t) for name, t in (self.kv_caches or {}).items()
            },
            "bound_layers": self._bound_layers(),
        }
        path = self.report_path
        world_size = self._vllm_config.parallel_config.world_size
        if world_size > 1:
            from vllm.distributed import get_world_group

            path = f"{path}.rank{get_world_group().rank}"
        with open(path, "w") as f:
            json.dump(report, f, indent=1)
