"""KV connectors shipped with the overlay, registered with vLLM's factory.

Python runs this file before any connector module, so importing one of them
on a vLLM they do not run on (``version_gate.FEATURE_RELEASES``) is the
startup error naming the versions they run on: ``kv_connector_module_path``
cannot run a connector against vLLM internals it was not written for.
"""

from __future__ import annotations

from vllm_overlay.version_gate import (
    CONNECTORS,
    OFFLOADING_SPECS,
    feature_runs_on,
    installed_vllm_version,
    unsupported_error,
)


def _require_supported_vllm() -> None:
    version = installed_vllm_version()
    if version is not None and not feature_runs_on("connectors", version):
        raise unsupported_error(
            [f"the overlay's KV connectors (module {__name__})"],
            version,
            "connectors",
        )


_require_supported_vllm()


def register_connectors() -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory

    for name, (module, cls) in CONNECTORS.items():
        if name not in KVConnectorFactory._registry:
            KVConnectorFactory.register_connector(name, module, cls)
    for name, (module, cls) in OFFLOADING_SPECS.items():
        if name not in OffloadingSpecFactory._registry:
            OffloadingSpecFactory.register_spec(name, module, cls)
