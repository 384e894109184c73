"""KV connectors shipped with the overlay, registered with vLLM's factory."""

from __future__ import annotations

CONNECTORS = {
    # name in kv_transfer_config -> (module, class)
    "CrossLayerProbeConnector": (
        "vllm_overlay.connectors.probe",
        "CrossLayerProbeConnector",
    ),
    "OverlayOffloadingConnector": (
        "vllm_overlay.connectors.offloading",
        "OverlayOffloadingConnector",
    ),
    "SharedKVPoolConnector": (
        "vllm_overlay.connectors.shared_pool",
        "SharedKVPoolConnector",
    ),
}
OFFLOADING_SPECS = {
    # spec_name for stock OffloadingConnector -> (module, class)
    "OverlayCPUOffloadingSpec": (
        "vllm_overlay.connectors.offloading",
        "OverlayCPUOffloadingSpec",
    ),
}


def register_connectors() -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory

    for name, (module, cls) in CONNECTORS.items():
        if name not in KVConnectorFactory._registry:
            KVConnectorFactory.register_connector(name, module, cls)
    for name, (module, cls) in OFFLOADING_SPECS.items():
        if name not in OffloadingSpecFactory._registry:
            OffloadingSpecFactory.register_spec(name, module, cls)
