"""KV connectors shipped with the overlay, registered with vLLM's factory."""

from __future__ import annotations

CONNECTORS = {
    # name in kv_transfer_config -> (module, class)
    "CrossLayerProbeConnector": ("vllm_overlay.connectors.probe",
                                 "CrossLayerProbeConnector"),
}


def register_connectors() -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import \
        KVConnectorFactory

    for name, (module, cls) in CONNECTORS.items():
        if name not in KVConnectorFactory._registry:
            KVConnectorFactory.register_connector(name, module, cls)
