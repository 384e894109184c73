"""CrossLayerProbeConnector: its options are validated."""

from __future__ import annotations

import pytest


def make(extra):
    from vllm.config import KVTransferConfig, VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from vllm_overlay.connectors.probe import CrossLayerProbeConnector

    config = VllmConfig(
        kv_transfer_config=KVTransferConfig(
            kv_connector="CrossLayerProbeConnector",
            kv_role="kv_both",
            kv_connector_extra_config=extra,
        )
    )
    return CrossLayerProbeConnector(config, KVConnectorRole.WORKER, None)


def test_opts_in_by_default_and_can_opt_out(overlay):
    assert make({}).prefer_cross_layer_blocks is True
    assert make({"prefer_cross_layer_blocks": False}).prefer_cross_layer_blocks is False


@pytest.mark.parametrize(
    "extra,message",
    [
        ({"prefer_cross_layer_blocks": "yes"}, "must be true or false"),
        ({"report": "/tmp/x"}, "unknown kv_connector_extra_config keys"),
    ],
)
def test_bad_options_are_rejected(overlay, extra, message):
    with pytest.raises(ValueError, match=message):
        make(extra)


def test_registered_with_vllm_factory(overlay):
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    assert "CrossLayerProbeConnector" in KVConnectorFactory._registry
    overlay.connectors.register_connectors()  # again: no "already registered"
