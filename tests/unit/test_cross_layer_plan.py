"""plan_cross_layer_kv_cache: each condition, and the reason when one fails.

Real vLLM config classes and backends; only the runner and the connector are
stand-ins (the end-to-end tests run the real ones).
"""

from __future__ import annotations

import types

import pytest
import torch

from vllm_overlay.integration.cross_layer import (
    allocate_cross_layer_kv_cache,
    plan_cross_layer_kv_cache,
)

LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(4)]


@pytest.fixture
def connector(monkeypatch):
    from vllm.distributed.kv_transfer import kv_transfer_state

    agent = types.SimpleNamespace(prefer_cross_layer_blocks=True)
    monkeypatch.setattr(kv_transfer_state, "_KV_CONNECTOR_AGENT", agent)
    return agent


def make_case(
    spec=None, backend=None, groups=1, layers=LAYERS, num_blocks=6, sizes=None
):
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        KVCacheTensor,
    )

    spec = spec or FullAttentionSpec(
        block_size=16, num_kv_heads=2, head_size=32, dtype=torch.float32
    )
    backend = backend or CPUAttentionBackend
    sizes = sizes or [spec.page_size_bytes * num_blocks] * len(layers)
    config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[
            KVCacheTensor(size=s, shared_by=[n]) for s, n in zip(sizes, layers)
        ],
        kv_cache_groups=[KVCacheGroupSpec(list(layers), spec) for _ in range(groups)],
    )
    group = types.SimpleNamespace(kv_cache_spec=spec, backend=backend)
    runner = types.SimpleNamespace(
        attn_groups=[[group]],
        runner_only_attn_layers=set(),
        cache_config=types.SimpleNamespace(cache_dtype="auto"),
    )
    return runner, config


def test_all_conditions_met_gives_a_layout(overlay, connector):
    runner, config = make_case()
    plan = plan_cross_layer_kv_cache(runner, config, [16])
    assert plan.enabled, plan.reason
    layout = plan.layout
    assert layout.shape == (6, 4, 2, 2, 16, 32)
    assert layout.layer_names == tuple(LAYERS)
    assert layout.block_bytes == 4 * 2 * 2 * 16 * 32 * 4
    assert layout.layer_offsets == tuple(i * 2 * 2 * 16 * 32 * 4 for i in range(4))
    assert layout.kv_offsets == (0, 2 * 16 * 32 * 4)
    # Same bytes as stock would allocate, in one buffer.
    buffer, kv_caches = allocate_cross_layer_kv_cache(plan, config, "cpu")
    assert buffer.untyped_storage().nbytes() == sum(
        t.size for t in config.kv_cache_tensors
    )
    assert set(kv_caches) == set(LAYERS)
    assert all(v.shape == (2, 6, 2, 16, 32) for v in kv_caches.values())


def test_kernel_blocks_smaller_than_cache_blocks(overlay, connector):
    runner, config = make_case()
    plan = plan_cross_layer_kv_cache(runner, config, [8])
    assert plan.enabled, plan.reason
    assert plan.layout.num_blocks == 12 and plan.layout.blocks_per_cache_block == 2
    assert plan.layout.cache_block_bytes == 2 * plan.layout.block_bytes


def test_no_connector(overlay, monkeypatch):
    from vllm.distributed.kv_transfer import kv_transfer_state

    monkeypatch.setattr(kv_transfer_state, "_KV_CONNECTOR_AGENT", None)
    runner, config = make_case()
    assert (
        plan_cross_layer_kv_cache(runner, config, [16]).reason
        == "no KV connector is configured"
    )


def test_connector_not_opted_in(overlay, connector):
    connector.prefer_cross_layer_blocks = False
    runner, config = make_case()
    assert (
        "does not prefer cross-layer blocks"
        in plan_cross_layer_kv_cache(runner, config, [16]).reason
    )


def test_two_kv_cache_groups(overlay, connector):
    runner, config = make_case(groups=2)
    plan = plan_cross_layer_kv_cache(runner, config, [16])
    assert not plan.enabled and "2 KV cache groups" in plan.reason


def test_two_attention_backends(overlay, connector):
    runner, config = make_case()
    runner.attn_groups[0].append(runner.attn_groups[0][0])
    plan = plan_cross_layer_kv_cache(runner, config, [16])
    assert not plan.enabled and "more than one attention backend" in plan.reason


def test_not_plain_attention(overlay, connector):
    from vllm.v1.kv_cache_interface import ChunkedLocalAttentionSpec

    spec = ChunkedLocalAttentionSpec(
        block_size=16,
        num_kv_heads=2,
        head_size=32,
        dtype=torch.float32,
        attention_chunk_size=64,
    )
    runner, config = make_case(spec=spec)
    plan = plan_cross_layer_kv_cache(runner, config, [16])
    assert not plan.enabled and "ChunkedLocalAttentionSpec" in plan.reason


def test_unequal_tensors(overlay, connector):
    runner, config = make_case(sizes=[16384 * 6] * 3 + [16384 * 5])
    plan = plan_cross_layer_kv_cache(runner, config, [16])
    assert not plan.enabled and "differ in size" in plan.reason


def test_backend_without_support(overlay, connector):
    from vllm.v1.attention.backends.flex_attention import FlexAttentionBackend

    runner, config = make_case(backend=FlexAttentionBackend)
    plan = plan_cross_layer_kv_cache(runner, config, [16])
    assert not plan.enabled
    assert "FLEX_ATTENTION has no stride order with a layers dimension" in plan.reason


def test_backend_with_unpatched_signature_is_not_a_crash(overlay, connector):
    class OldStyle:  # a 0.11.2-style override without the keyword
        @staticmethod
        def get_name():
            return "OLD"

        @staticmethod
        def get_kv_cache_shape(
            num_blocks, block_size, num_kv_heads, head_size, cache_dtype_str="auto"
        ):
            return (2, num_blocks, block_size, num_kv_heads, head_size)

        @staticmethod
        def get_kv_cache_stride_order():
            return (0, 1, 2, 3, 4)

    runner, config = make_case(backend=OldStyle)
    plan = plan_cross_layer_kv_cache(runner, config, [16])
    assert not plan.enabled and "OLD has no stride order" in plan.reason


def test_order_that_does_not_keep_blocks_outermost(overlay, connector):
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    class LayersOuter(CPUAttentionBackend):
        @staticmethod
        def get_kv_cache_stride_order(include_num_layers_dimension=False):
            return (0, 1, 2, 3, 4, 5)  # [layers, 2, blocks, ...]

    runner, config = make_case(backend=LayersOuter)
    plan = plan_cross_layer_kv_cache(runner, config, [16])
    assert not plan.enabled and "'blocks' must be outermost" in plan.reason


# -- The patched model runner and connector base (CL-07..CL-10) ------------
# Stand-in runners: a GPUModelRunner without __init__ (no model, no device),
# carrying only what the two KV cache methods read.  The end-to-end tests
# run the real runner.


@pytest.mark.patch_test("CL-07")
def test_connectors_do_not_opt_in_unless_they_say_so(overlay):
    from vllm.distributed.kv_transfer.kv_connector.v1 import shared_storage_connector
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    assert KVConnectorBase_V1.prefer_cross_layer_blocks is False
    assert (
        shared_storage_connector.SharedStorageConnector.prefer_cross_layer_blocks
        is False
    )


def model_runner(connector_agent=None):
    """A GPUModelRunner for make_case()'s four layers, with the stock
    helpers that initialize_kv_cache calls before the tensors as no-ops."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    from vllm.v1.worker.utils import AttentionGroup

    stand_in, config = make_case()
    group = stand_in.attn_groups[0][0]
    runner = object.__new__(GPUModelRunner)
    runner.attn_groups = [
        [AttentionGroup(group.backend, list(LAYERS), group.kv_cache_spec, 0)]
    ]
    runner.runner_only_attn_layers = set()
    runner.cache_config = stand_in.cache_config
    runner.kv_cache_config = config
    runner.device = torch.device("cpu")
    runner.shared_kv_cache_layers = {}
    runner.model_config = types.SimpleNamespace(
        hf_config=types.SimpleNamespace(model_type="llama")
    )
    runner.compilation_config = types.SimpleNamespace(
        static_forward_context={n: types.SimpleNamespace(kv_cache=None) for n in LAYERS}
    )
    runner.kv_caches = []
    runner.speculative_config = None
    runner.dcp_world_size = 1
    return runner, config


@pytest.mark.patch_test("CL-09")
def test_runner_allocates_one_buffer_for_all_layers(overlay, connector):
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    runner, config = model_runner()
    kv_caches = GPUModelRunner.initialize_kv_cache_tensors(runner, config, [16])
    buffer = runner.cross_layers_kv_cache
    assert buffer is not None and buffer.is_contiguous()
    assert (
        runner.cross_layers_kv_layout.shape
        == tuple(buffer.shape)
        == (6, 4, 2, 2, 16, 32)
    )
    assert runner.cross_layers_attn_backend is runner.attn_groups[0][0].backend
    # Every layer is a view of the one buffer, bound like stock binds.
    assert set(kv_caches) == set(LAYERS)
    for name in LAYERS:
        view = kv_caches[name]
        assert view.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()
        assert runner.compilation_config.static_forward_context[name].kv_cache == [view]
    assert len(runner.kv_caches) == 4


def test_runner_keeps_stock_tensors_without_an_opted_in_connector(overlay, connector):
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    connector.prefer_cross_layer_blocks = False
    runner, config = model_runner()
    kv_caches = GPUModelRunner.initialize_kv_cache_tensors(runner, config, [16])
    assert runner.cross_layers_kv_cache is None
    assert len({v.untyped_storage().data_ptr() for v in kv_caches.values()}) == 4


class _RecordingConnector:
    prefer_cross_layer_blocks = True

    def __init__(self):
        self.calls = []

    def register_kv_caches(self, kv_caches):
        self.calls.append(("register_kv_caches", kv_caches))

    def register_cross_layers_kv_cache(self, kv_cache, attn_backend, layout):
        self.calls.append(
            ("register_cross_layers_kv_cache", kv_cache, attn_backend, layout)
        )

    def set_host_xfer_buffer_ops(self, copy_operation):
        pass


def initialize_kv_cache(runner, config, agent, monkeypatch, cross_layer=True):
    """Run GPUModelRunner.initialize_kv_cache with a cross-layer buffer
    already made (CL-09's part stubbed: this is CL-10's routing only);
    ``cross_layer=False``: stock per-layer tensors, as when CL-09 is
    skipped (the runner never gets the cross-layer attributes)."""
    from vllm.distributed.kv_transfer import kv_transfer_state
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    buffer = torch.zeros(8)
    monkeypatch.setattr(kv_transfer_state, "_KV_CONNECTOR_AGENT", agent)
    for name in (
        "may_add_encoder_only_layers_to_kv_cache_config",
        "maybe_add_kv_sharing_layers_to_kv_cache_groups",
        "initialize_attn_backend",
        "initialize_metadata_builders",
        "may_reinitialize_input_batch",
    ):
        monkeypatch.setattr(runner, name, lambda *args: None, raising=False)
    monkeypatch.setattr(
        runner, "_prepare_kernel_block_sizes", lambda config: [16], raising=False
    )

    def tensors(config, kernel_block_sizes):
        if not cross_layer:
            return {"layer": buffer}
        runner.cross_layers_kv_cache = buffer
        runner.cross_layers_attn_backend = "BACKEND"
        runner.cross_layers_kv_layout = "LAYOUT"
        return {"layer": buffer}

    monkeypatch.setattr(runner, "initialize_kv_cache_tensors", tensors, raising=False)
    GPUModelRunner.initialize_kv_cache(runner, config)
    return buffer


@pytest.mark.patch_test("CL-10")
def test_runner_hands_the_buffer_to_an_opted_in_connector(overlay, monkeypatch):
    runner, config = model_runner()
    agent = _RecordingConnector()
    buffer = initialize_kv_cache(runner, config, agent, monkeypatch)
    assert agent.calls == [
        ("register_cross_layers_kv_cache", buffer, "BACKEND", "LAYOUT")
    ]
    assert "register_kv_caches" not in vars(agent)  # the routing is undone


def test_with_cl09_skipped_the_connector_gets_per_layer_caches(overlay, monkeypatch):
    """VLLM_OVERLAY_SKIP_PATCHES=CL-09 (docs/operations.md's switch to the stock
    layout): CL-10 alone must pass stock's per-layer caches through."""
    runner, config = model_runner()
    assert not hasattr(runner, "cross_layers_kv_cache")
    agent = _RecordingConnector()
    buffer = initialize_kv_cache(runner, config, agent, monkeypatch, False)
    assert agent.calls == [("register_kv_caches", {"layer": buffer})]


@pytest.mark.patch_test("CL-08")
def test_connector_base_accepts_the_buffer(overlay, monkeypatch):
    """An opted-in connector that does not override the new method gets
    the base's (which ignores it), not an AttributeError."""
    from vllm.distributed.kv_transfer.kv_connector.v1 import shared_storage_connector

    class OptedIn(shared_storage_connector.SharedStorageConnector):
        prefer_cross_layer_blocks = True

        def register_kv_caches(self, kv_caches):
            raise AssertionError("per-layer registration with a buffer")

    runner, config = model_runner()
    agent = object.__new__(OptedIn)
    initialize_kv_cache(runner, config, agent, monkeypatch)
    assert agent.register_cross_layers_kv_cache(None, None, None) is None
