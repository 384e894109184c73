# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Cross-layer KV blocks: stride orders with a layers dimension, the
explicit layout (vllm.v1.kv_cache_layout), the worker's plan and allocation
(vllm.v1.worker.cross_layer_kv), and an engine whose connector prefers
cross-layer blocks against a stock one."""

import math
from types import SimpleNamespace

import pytest
import torch

from tests.v1.kv_connector.unit.tiny_llama import (
    make_tiny_llama,
    prompt_token_ids,
    tiny_llm,
)
from vllm.attention.backends.abstract import AttentionBackend
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
)
from vllm.v1.attention.backends import flash_attn
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
from vllm.v1.attention.backends.mla.common import MLACommonBackend
from vllm.v1.attention.backends.mla.indexer import DeepseekV32IndexerBackend
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
)
from vllm.v1.kv_cache_layout import CrossLayerKVLayout
from vllm.v1.worker.cross_layer_kv import (
    allocate_cross_layer_kv_cache,
    name_kv_cache_dims,
    plan_cross_layer_kv_cache,
)

NUM_BLOCKS = 6
BLOCK_SIZE = 16
NUM_LAYERS = 3


# -- stride orders --------------------------------------------------------------


def build_layout(backend, num_kv_heads=2, head_size=8, num_layers=NUM_LAYERS):
    """The cross-layer layout BACKEND's stride order gives."""
    order = backend.get_kv_cache_stride_order(include_num_layers_dimension=True)
    dims = name_kv_cache_dims(
        backend, NUM_BLOCKS, BLOCK_SIZE, num_kv_heads, head_size, "auto"
    )
    shape = backend.get_kv_cache_shape(NUM_BLOCKS, BLOCK_SIZE, num_kv_heads, head_size)
    full_dims = ("layers", *dims)
    full_shape = (num_layers, *shape)
    return CrossLayerKVLayout(
        dims=tuple(full_dims[i] for i in order),
        shape=tuple(full_shape[i] for i in order),
        logical_dims=dims,
        dtype=torch.float32,
        layer_names=tuple(f"layer.{i}" for i in range(num_layers)),
        block_size=BLOCK_SIZE,
        kernel_block_size=BLOCK_SIZE,
    )


def assert_blocks_contiguous_for_all_layers(layout: CrossLayerKVLayout):
    """Write (layer, block) markers through each layer's logical view and
    read the buffer physically: block b is one contiguous run holding the
    KV of block b of every layer, and nothing else."""
    buffer = layout.allocate("cpu")
    views = layout.layer_views(buffer)
    blocks_dim = layout.logical_dims.index("blocks")
    for layer, view in enumerate(views):
        assert tuple(view.shape) == tuple(
            layout.shape[layout.dims.index(d)] for d in layout.logical_dims
        )
        for block in range(NUM_BLOCKS):
            view.select(blocks_dim, block).fill_(1000 * layer + block)
    per_block = math.prod(layout.shape[1:])
    flat = buffer.view(-1)
    for block in range(NUM_BLOCKS):
        run = flat[block * per_block : (block + 1) * per_block]
        assert sorted(run.unique().tolist()) == [
            1000 * layer + block for layer in range(layout.num_layers)
        ]
        # each layer fills an equal share of the block
        assert (run == 1000 + block).sum() == per_block // layout.num_layers
    assert layout.block_bytes == per_block * 4
    assert layout.total_bytes == buffer.numel() * 4


def test_cpu_backend_stride_order():
    assert CPUAttentionBackend.get_kv_cache_stride_order() == (0, 1, 2, 3, 4)
    order = CPUAttentionBackend.get_kv_cache_stride_order(
        include_num_layers_dimension=True
    )
    assert order == (2, 0, 1, 3, 4, 5)
    layout = build_layout(CPUAttentionBackend)
    assert layout.dims == ("blocks", "layers", "kv", "heads", "tokens", "head_size")
    assert layout.layer_contiguous_in_block
    assert_blocks_contiguous_for_all_layers(layout)


@pytest.mark.parametrize(
    "cache_layout, stock, with_layers, layer_contiguous",
    [
        ("NHD", (0, 1, 2, 3, 4), (2, 0, 1, 3, 4, 5), True),
        ("HND", (0, 1, 3, 2, 4), (2, 4, 0, 1, 3, 5), False),
    ],
)
def test_flash_attn_stride_order(
    monkeypatch, cache_layout, stock, with_layers, layer_contiguous
):
    monkeypatch.setattr(flash_attn, "get_kv_cache_layout", lambda: cache_layout)
    backend = flash_attn.FlashAttentionBackend
    assert backend.get_kv_cache_stride_order() == stock
    assert (
        backend.get_kv_cache_stride_order(include_num_layers_dimension=True)
        == with_layers
    )
    layout = build_layout(backend)
    assert layout.dims[0] == "blocks"
    assert layout.layer_contiguous_in_block == layer_contiguous
    assert_blocks_contiguous_for_all_layers(layout)


def test_flashinfer_stride_order(monkeypatch):
    flashinfer = pytest.importorskip("vllm.v1.attention.backends.flashinfer")
    monkeypatch.setenv("VLLM_USE_TRTLLM_ATTENTION", "0")
    monkeypatch.setattr(flashinfer, "get_kv_cache_layout", lambda: "NHD")
    backend = flashinfer.FlashInferBackend
    assert backend.get_kv_cache_stride_order(include_num_layers_dimension=True) == (
        1,
        0,
        2,
        3,
        4,
        5,
    )
    assert_blocks_contiguous_for_all_layers(build_layout(backend))


def test_mla_stride_order():
    assert MLACommonBackend.get_kv_cache_stride_order() == (0, 1, 2)
    layout = build_layout(MLACommonBackend, num_kv_heads=1, head_size=16)
    assert layout.dims == ("blocks", "layers", "tokens", "head_size")
    assert layout.kv_offsets is None
    assert_blocks_contiguous_for_all_layers(layout)


def test_backends_without_a_layers_dimension_refuse():
    assert DeepseekV32IndexerBackend.get_kv_cache_stride_order() == (0, 1, 2)
    with pytest.raises(NotImplementedError):
        DeepseekV32IndexerBackend.get_kv_cache_stride_order(
            include_num_layers_dimension=True
        )
    with pytest.raises(NotImplementedError, match="layers dimension"):
        AttentionBackend.get_kv_cache_stride_order(include_num_layers_dimension=True)


# -- vllm.v1.kv_cache_layout -------------------------------------------------------


def make_layout(**overrides) -> CrossLayerKVLayout:
    args = dict(
        dims=("blocks", "layers", "kv", "heads", "tokens", "head_size"),
        shape=(8, 3, 2, 2, 16, 32),
        logical_dims=("kv", "blocks", "heads", "tokens", "head_size"),
        dtype=torch.float16,
        layer_names=("l0", "l1", "l2"),
        block_size=32,
        kernel_block_size=16,
    )
    args.update(overrides)
    return CrossLayerKVLayout(**args)


def test_layout_sizes_and_offsets():
    layout = make_layout()
    assert layout.num_layers == 3
    assert layout.num_blocks == 8
    assert layout.blocks_per_cache_block == 2
    assert layout.num_cache_blocks == 4
    assert layout.element_size == 2
    assert layout.block_bytes == 3 * 2 * 2 * 16 * 32 * 2 == 12288
    assert layout.cache_block_bytes == 2 * 12288
    assert layout.total_bytes == 8 * 12288
    assert layout.layer_offsets == (0, 4096, 8192)
    assert layout.kv_offsets == (0, 2048)
    assert layout.stride("heads") == 16 * 32
    assert layout.logical_order() == (2, 0, 1, 3, 4, 5)
    described = layout.to_dict()
    assert described["block_bytes"] == 12288
    assert described["dtype"] == "float16"
    assert described["layer_names"] == ["l0", "l1", "l2"]
    assert "blocks=8" in layout.describe()


def test_layout_views_share_the_buffer():
    layout = make_layout()
    buffer = layout.allocate("cpu")
    assert buffer.is_contiguous() and not buffer.any()
    views = layout.layer_views(buffer)
    assert [tuple(v.shape) for v in views] == [(2, 8, 2, 16, 32)] * 3
    views[2][1, 5].fill_(1.0)  # V of block 5, layer 2
    hot = buffer.view(8, -1)[5].nonzero().flatten() * layout.element_size
    start = layout.layer_offsets[2] + layout.kv_offsets[1]
    assert hot.min().item() == start
    assert hot.max().item() == start + 2048 - layout.element_size
    with pytest.raises(ValueError, match="does not match"):
        layout.layer_views(buffer.view(-1))


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"shape": (8, 3, 2, 2, 16)}, "differ in length"),
        (
            {
                "dims": ("layers", "blocks", "kv", "heads", "tokens", "head_size"),
                "shape": (3, 8, 2, 2, 16, 32),
            },
            "outermost",
        ),
        (
            {"dims": ("blocks", "layers", "kv", "heads", "tokens", "width")},
            "names must be unique",
        ),
        ({"layer_names": ("l0", "l1")}, "2 layer names for 3 layers"),
        ({"block_size": 24}, "not a multiple"),
        ({"block_size": 64, "kernel_block_size": 32}, "'tokens' dim is 16"),
        ({"logical_dims": ("kv", "blocks", "heads", "tokens")}, "permutation"),
    ],
)
def test_layout_rejects_inconsistent_descriptions(overrides, message):
    with pytest.raises(ValueError, match=message):
        make_layout(**overrides)


# -- vllm.v1.worker.cross_layer_kv ---------------------------------------------------


def test_name_kv_cache_dims():
    assert name_kv_cache_dims(CPUAttentionBackend, 7, 16, 2, 32, "auto") == (
        "kv",
        "blocks",
        "heads",
        "tokens",
        "head_size",
    )
    assert name_kv_cache_dims(
        flash_attn.FlashAttentionBackend, 7, 16, 2, 32, "auto"
    ) == ("kv", "blocks", "tokens", "heads", "head_size")

    class Opaque:
        @staticmethod
        def get_kv_cache_shape(
            num_blocks, block_size, num_kv_heads, head_size, cache_dtype_str
        ):
            return (num_blocks * block_size, num_kv_heads * head_size)

    with pytest.raises(ValueError):
        name_kv_cache_dims(Opaque, 7, 16, 2, 32, "auto")


class NoLayersBackend(CPUAttentionBackend):
    @staticmethod
    def get_kv_cache_stride_order(include_num_layers_dimension=False):
        if include_num_layers_dimension:
            raise NotImplementedError("no layers dimension here")
        return (0, 1, 2, 3, 4)


class PreferringConnector:
    prefer_cross_layer_blocks = True


class StockConnector:
    prefer_cross_layer_blocks = False


def plan_for(monkeypatch, connector, backend=CPUAttentionBackend, groups=1):
    import vllm.distributed.kv_transfer as kv_transfer

    monkeypatch.setattr(kv_transfer, "has_kv_transfer_group", lambda: bool(connector))
    monkeypatch.setattr(kv_transfer, "get_kv_transfer_group", lambda: connector)
    spec = FullAttentionSpec(BLOCK_SIZE, 2, 32, torch.float32)
    names = [f"model.layers.{i}.attn" for i in range(NUM_LAYERS)]
    kv_cache_config = KVCacheConfig(
        num_blocks=NUM_BLOCKS,
        kv_cache_tensors=[
            KVCacheTensor(size=spec.page_size_bytes * NUM_BLOCKS, shared_by=[n])
            for n in names
        ],
        kv_cache_groups=[KVCacheGroupSpec(names, spec)] * groups,
    )
    runner = SimpleNamespace(
        attn_groups=[[SimpleNamespace(kv_cache_spec=spec, backend=backend)]],
        runner_only_attn_layers=set(),
        cache_config=SimpleNamespace(cache_dtype="auto"),
    )
    plan = plan_cross_layer_kv_cache(runner, kv_cache_config, [BLOCK_SIZE])
    return plan, kv_cache_config


@pytest.mark.parametrize(
    "connector, backend, groups, reason",
    [
        (None, CPUAttentionBackend, 1, "no KV connector"),
        (StockConnector(), CPUAttentionBackend, 1, "does not prefer"),
        (PreferringConnector(), CPUAttentionBackend, 2, "2 KV cache groups"),
        (PreferringConnector(), NoLayersBackend, 1, "no stride order"),
    ],
)
def test_plan_keeps_the_stock_layout(monkeypatch, connector, backend, groups, reason):
    plan, _ = plan_for(monkeypatch, connector, backend, groups)
    assert not plan.enabled
    assert plan.layout is None
    assert reason in plan.reason


def test_plan_and_allocate_one_buffer_for_all_layers(monkeypatch):
    plan, kv_cache_config = plan_for(monkeypatch, PreferringConnector())
    assert plan.enabled and plan.backend is CPUAttentionBackend
    layout = plan.layout
    assert layout.dims == ("blocks", "layers", "kv", "heads", "tokens", "head_size")
    assert layout.shape == (NUM_BLOCKS, NUM_LAYERS, 2, 2, BLOCK_SIZE, 32)
    assert layout.total_bytes == sum(t.size for t in kv_cache_config.kv_cache_tensors)

    buffer, kv_caches = allocate_cross_layer_kv_cache(plan, kv_cache_config, "cpu")
    assert list(kv_caches) == [f"model.layers.{i}.attn" for i in range(NUM_LAYERS)]
    stock_shape = CPUAttentionBackend.get_kv_cache_shape(NUM_BLOCKS, BLOCK_SIZE, 2, 32)
    for layer, view in enumerate(kv_caches.values()):
        assert tuple(view.shape) == stock_shape
        assert view.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()
        view[:, 4].fill_(layer + 1)  # K and V of block 4
    # block 4 of every layer, and only that, in one run of the buffer
    assert torch.equal(
        buffer[4],
        torch.arange(1, NUM_LAYERS + 1.0).view(-1, 1, 1, 1, 1).expand_as(buffer[4]),
    )
    assert not buffer[:4].any() and not buffer[5:].any()


def test_connectors_do_not_prefer_cross_layer_blocks_by_default():
    assert KVConnectorBase_V1.prefer_cross_layer_blocks is False


# -- engine --------------------------------------------------------------------------


class CrossLayerProbeConnector(KVConnectorBase_V1):
    """Prefers cross-layer blocks and records what the worker registers."""

    prefer_cross_layer_blocks = True

    def __init__(self, vllm_config, role, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        self.cross_layers = None
        self.per_layer = None

    def register_cross_layers_kv_cache(self, kv_cache, attn_backend, layout):
        self.cross_layers = (kv_cache, attn_backend, layout)

    def register_kv_caches(self, kv_caches):
        self.per_layer = kv_caches

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return 0, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        pass

    def build_connector_meta(self, scheduler_output):
        return KVConnectorMetadata()

    def start_load_kv(self, forward_context, **kwargs):
        pass

    def wait_for_layer_load(self, layer_name):
        pass

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):
        pass

    def wait_for_save(self):
        pass


if "CrossLayerProbeConnector" not in KVConnectorFactory._registry:
    KVConnectorFactory.register_connector(
        "CrossLayerProbeConnector", __name__, CrossLayerProbeConnector.__name__
    )


def run_engine(model, kv_transfer_config):
    from vllm import SamplingParams
    from vllm.distributed.kv_transfer import (
        get_kv_transfer_group,
        has_kv_transfer_group,
    )

    prompts = [
        {"prompt_token_ids": prompt_token_ids(70)},
        {"prompt_token_ids": prompt_token_ids(40, offset=5)},
    ]
    params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=1)
    with tiny_llm(model, kv_transfer_config=kv_transfer_config) as llm:
        outputs = llm.generate(prompts, params, use_tqdm=False)
        kv_caches = llm.collective_rpc(
            lambda worker: [t.clone() for t in worker.model_runner.kv_caches]
        )[0]
        connector = get_kv_transfer_group() if has_kv_transfer_group() else None
        registered = None
        if connector is not None:
            registered = (connector.cross_layers, connector.per_layer)
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    logprobs = [
        [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]
        for o in outputs
    ]
    return tokens, logprobs, kv_caches, registered


def test_engine_cross_layer_blocks_match_stock(tmp_path, monkeypatch):
    from vllm.config import KVTransferConfig

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    model = make_tiny_llama(tmp_path / "model")
    stock = run_engine(model, None)
    cross = run_engine(
        model,
        KVTransferConfig(kv_connector="CrossLayerProbeConnector", kv_role="kv_both"),
    )
    cross_layers, per_layer = cross[3]
    assert per_layer is None, "the worker registered per-layer KV caches"
    buffer, backend, layout = cross_layers
    assert backend is CPUAttentionBackend
    assert layout.dims[:2] == ("blocks", "layers")
    assert layout.num_layers == 2
    assert tuple(buffer.shape) == layout.shape
    # the same tokens, and the same KV bytes in every layer, only laid out
    # with all layers of a block together
    assert cross[0] == stock[0]
    assert cross[1] == stock[1]
    assert len(cross[2]) == len(stock[2]) == 2
    for cross_kv, stock_kv in zip(cross[2], stock[2]):
        assert cross_kv.shape == stock_kv.shape
        assert stock_kv.any()
        assert torch.equal(cross_kv, stock_kv)
