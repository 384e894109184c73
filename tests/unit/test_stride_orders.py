"""Every 0.11.2 backend's stride order, with and without a layers dimension.

For each supporting backend: the physical order of the single buffer, and
proof on a real (small) buffer that each block of every layer is one
contiguous run and that writes through one layer's view touch only that
layer's bytes.  Backends without support must refuse with
NotImplementedError (never TypeError).  No GPU needed: only shapes and
strides are exercised.
"""

from __future__ import annotations

import importlib

import pytest
import torch

from vllm_overlay.core.kv_layout import CrossLayerKVLayout
from vllm_overlay.integration.cross_layer import name_kv_cache_dims
from vllm_overlay.patches.v0_11_2 import patch_flashinfer

BACKENDS = "vllm.v1.attention.backends"
N, B, H, D, L = 5, 16, 2, 64, 3  # odd block count on purpose


def backend(path: str):
    module, name = path.rsplit(".", 1)
    return getattr(importlib.import_module(f"{BACKENDS}.{module}"), name)


@pytest.fixture
def cache_layout(monkeypatch):
    from vllm.v1.attention.backends import utils

    def set_layout(name: str) -> None:
        monkeypatch.setattr(utils, "_KV_CACHE_LAYOUT_OVERRIDE", name)
        utils.get_kv_cache_layout.cache_clear()

    yield set_layout
    utils.get_kv_cache_layout.cache_clear()


def build_layout(backend_cls, order) -> CrossLayerKVLayout:
    logical = name_kv_cache_dims(backend_cls, N, B, H, D, "auto")
    shape = backend_cls.get_kv_cache_shape(N, B, H, D, cache_dtype_str="auto")
    full_dims, full_shape = ("layers",) + logical, (L,) + tuple(shape)
    return CrossLayerKVLayout(
        dims=tuple(full_dims[i] for i in order),
        shape=tuple(full_shape[i] for i in order),
        logical_dims=logical,
        dtype=torch.float16,
        layer_names=tuple(f"layer.{i}" for i in range(L)),
        block_size=B,
        kernel_block_size=B,
    )


def assert_blocks_contiguous(layout: CrossLayerKVLayout) -> None:
    buffer = layout.allocate("cpu")
    index = torch.arange(buffer.numel()).view(buffer.shape)
    views = layout.layer_views(index)
    blocks_dim = layout.logical_dims.index("blocks")
    per_block = buffer.numel() // layout.num_blocks
    for b in range(layout.num_blocks):
        elements = torch.cat([v.select(blocks_dim, b).flatten() for v in views])
        assert torch.equal(
            elements.sort().values, torch.arange(b * per_block, (b + 1) * per_block)
        )
    # Writing through one layer's view changes that layer's bytes only.
    layer_views = layout.layer_views(buffer)
    layer_views[1].fill_(1.0)
    for i, view in enumerate(layer_views):
        assert bool((view == 1.0).all()) is (i == 1)
    assert int((buffer == 1.0).sum()) == buffer.numel() // L
    # Per-layer views keep the backend's logical shape.
    shape = tuple(layout.size(d) for d in layout.logical_dims)
    assert all(tuple(v.shape) == shape for v in layer_views)


SUPPORTED = [
    # (backend, cache layout, physical dims with layers)
    pytest.param(
        "flash_attn.FlashAttentionBackend",
        "NHD",
        ("blocks", "layers", "kv", "tokens", "heads", "head_size"),
        marks=pytest.mark.patch_test("CL-02"),
    ),
    pytest.param(
        "flash_attn.FlashAttentionBackend",
        "HND",
        ("blocks", "heads", "layers", "kv", "tokens", "head_size"),
        marks=pytest.mark.patch_test("CL-02"),
    ),
    pytest.param(
        "mla.triton_mla.TritonMLABackend",
        None,
        ("blocks", "layers", "tokens", "head_size"),
        marks=pytest.mark.patch_test("CL-04"),
    ),
    pytest.param(
        "mla.flashmla.FlashMLABackend",
        None,
        ("blocks", "layers", "tokens", "head_size"),
        marks=pytest.mark.patch_test("CL-04"),
    ),
    pytest.param(
        "cpu_attn.CPUAttentionBackend",
        None,
        ("blocks", "layers", "kv", "heads", "tokens", "head_size"),
        marks=pytest.mark.patch_test("CL-06"),
    ),
]


@pytest.mark.parametrize("path,layout_name,physical", SUPPORTED)
def test_supported_backend_order(overlay, cache_layout, path, layout_name, physical):
    if layout_name:
        cache_layout(layout_name)
    cls = backend(path)
    order = cls.get_kv_cache_stride_order(include_num_layers_dimension=True)
    layout = build_layout(cls, order)
    assert layout.dims == physical
    assert layout.block_bytes * N == layout.total_bytes
    assert_blocks_contiguous(layout)


@pytest.mark.parametrize(
    "layout_name,stock", [("NHD", (0, 1, 2, 3, 4)), ("HND", (0, 1, 3, 2, 4))]
)
def test_flash_attn_order_without_layers_is_stock(
    overlay, cache_layout, layout_name, stock
):
    from vllm_overlay.core.patching import REGISTRY

    cache_layout(layout_name)
    cls = backend("flash_attn.FlashAttentionBackend")
    assert cls.get_kv_cache_stride_order() == stock
    assert REGISTRY.original("CL-02")() == stock  # what 0.11.2 returns


@pytest.mark.patch_test("CL-04", "CL-06")
def test_cpu_and_mla_orders_without_layers_are_identity(overlay):
    # Stock 0.11.2 had none, and its allocator then used the identity.
    assert backend("cpu_attn.CPUAttentionBackend").get_kv_cache_stride_order() == (
        0,
        1,
        2,
        3,
        4,
    )
    assert backend("mla.triton_mla.TritonMLABackend").get_kv_cache_stride_order() == (
        0,
        1,
        2,
    )


@pytest.mark.parametrize(
    "layout_name,with_layers,physical",
    [
        (
            "NHD",
            (1, 0, 2, 3, 4, 5),
            ("blocks", "layers", "kv", "tokens", "heads", "head_size"),
        ),
        (
            "HND",
            (1, 2, 4, 0, 3, 5),
            ("blocks", "kv", "heads", "layers", "tokens", "head_size"),
        ),
    ],
)
def test_flashinfer_order(layout_name, with_layers, physical):
    """flashinfer is not installed in the CPU build, so its backend class
    cannot be imported; the patch's order is checked against FlashInfer's
    per-layer shape (blocks, 2, tokens, heads, head_size)."""
    order = patch_flashinfer.stride_order_for_layout(layout_name, True)
    assert order == with_layers
    logical = ("blocks", "kv", "tokens", "heads", "head_size")
    full = ("layers",) + logical
    assert tuple(full[i] for i in order) == physical
    assert patch_flashinfer.stride_order_for_layout(layout_name, False) == (
        (0, 1, 2, 3, 4) if layout_name == "NHD" else (0, 1, 3, 2, 4)
    )
    # No GPU: TRT-LLM kernels cannot run, so nothing is refused.
    assert patch_flashinfer.trtllm_refusal() is None
    with pytest.raises(ValueError, match="Unknown cache layout"):
        patch_flashinfer.stride_order_for_layout("XYZ", True)


@pytest.fixture(scope="module")
def flashinfer_backend(overlay):
    """vLLM's real FlashInferBackend, imported with a stand-in ``flashinfer``
    package (the CPU build has none), so that CL-03 is applied to it when
    its module is imported, as on a GPU.  Imported once: the overlay patches
    a module on its first import only."""
    import sys
    import types

    name = f"{BACKENDS}.flashinfer"
    stubs = (
        "flashinfer",
        "flashinfer.decode",
        "flashinfer.prefill",
        "flashinfer.utils",
    )
    assert name not in sys.modules and not any(s in sys.modules for s in stubs)
    for stub in stubs:
        module = types.ModuleType(stub)
        module.__getattr__ = lambda attr: type(attr, (), {})
        sys.modules[stub] = module
    try:
        cls = importlib.import_module(name).FlashInferBackend
    finally:
        for stub in (name, *stubs):
            sys.modules.pop(stub, None)
    return cls


@pytest.mark.patch_test("CL-03")
@pytest.mark.parametrize("layout_name", ["NHD", "HND"])
def test_flashinfer_backend_has_the_order(
    flashinfer_backend, cache_layout, layout_name
):
    cache_layout(layout_name)
    cls = flashinfer_backend
    assert cls.get_kv_cache_stride_order(
        include_num_layers_dimension=True
    ) == patch_flashinfer.stride_order_for_layout(layout_name, True)
    assert cls.get_kv_cache_stride_order() == patch_flashinfer.stride_order_for_layout(
        layout_name, False
    )


UNSUPPORTED = [
    # Inherit AttentionBackend's order (CL-01), except the indexer (CL-05).
    *(
        pytest.param(path, marks=pytest.mark.patch_test("CL-01"))
        for path in (
            "triton_attn.TritonAttentionBackend",
            "flex_attention.FlexAttentionBackend",
            "tree_attn.TreeAttentionBackend",
            "xformers.XFormersAttentionBackend",
            "mla.flashmla_sparse.FlashMLASparseBackend",
        )
    ),
    pytest.param(
        "mla.indexer.DeepseekV32IndexerBackend", marks=pytest.mark.patch_test("CL-05")
    ),
]


@pytest.mark.parametrize("path", UNSUPPORTED)
def test_unsupported_backend_says_so(overlay, path):
    cls = backend(path)
    with pytest.raises(NotImplementedError) as info:
        cls.get_kv_cache_stride_order(include_num_layers_dimension=True)
    assert "cross-layer" in str(info.value) or cls.__name__ in str(info.value)


def test_indexer_keeps_its_order_without_layers(overlay):
    cls = backend("mla.indexer.DeepseekV32IndexerBackend")
    assert cls.get_kv_cache_stride_order() == (0, 1, 2)


def test_dim_naming_rejects_unexplained_shapes():
    class Padded:
        @staticmethod
        def get_kv_cache_shape(
            num_blocks, block_size, num_kv_heads, head_size, cache_dtype_str="auto"
        ):
            return (num_blocks, block_size, 3, head_size)

    with pytest.raises(ValueError, match="cannot name dim 2"):
        name_kv_cache_dims(Padded, N, B, H, D, "auto")
