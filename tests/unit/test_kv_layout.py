"""CrossLayerKVLayout validates itself and derives transfer facts."""

from __future__ import annotations

import pytest
import torch

from vllm_overlay.core.kv_layout import CrossLayerKVLayout

GOOD = dict(
    dims=("blocks", "layers", "kv", "heads", "tokens", "head_size"),
    shape=(7, 3, 2, 4, 16, 64),
    logical_dims=("kv", "blocks", "heads", "tokens", "head_size"),
    dtype=torch.bfloat16,
    layer_names=("a", "b", "c"),
    block_size=32,
    kernel_block_size=16,
)


def test_derived_sizes():
    layout = CrossLayerKVLayout(**GOOD)
    per_layer = 2 * 4 * 16 * 64 * 2
    assert layout.block_bytes == 3 * per_layer
    assert layout.cache_block_bytes == 2 * layout.block_bytes
    assert layout.num_cache_blocks == 3  # 7 kernel blocks, 2 per cache block
    assert layout.layer_offsets == (0, per_layer, 2 * per_layer)
    assert layout.kv_offsets == (0, per_layer // 2)
    assert layout.layer_contiguous_in_block
    assert layout.total_bytes == 7 * layout.block_bytes
    d = layout.to_dict()
    assert d["dtype"] == "bfloat16" and d["layer_names"] == ["a", "b", "c"]
    assert "blocks=7, layers=3" in layout.describe()


def test_mla_layout_has_no_kv_split():
    layout = CrossLayerKVLayout(
        dims=("blocks", "layers", "tokens", "head_size"),
        shape=(4, 2, 16, 576),
        logical_dims=("blocks", "tokens", "head_size"),
        dtype=torch.float16,
        layer_names=("a", "b"),
        block_size=16,
        kernel_block_size=16,
    )
    assert layout.kv_offsets is None
    assert layout.block_bytes == 2 * 16 * 576 * 2


@pytest.mark.parametrize(
    "change,message",
    [
        (dict(shape=(7, 3, 2, 4, 16)), "differ in length"),
        (
            dict(dims=("blocks", "layers", "kv", "heads", "tokens", "tokens")),
            "must be unique",
        ),
        (
            dict(dims=("layers", "blocks", "kv", "heads", "tokens", "head_size")),
            "'blocks' must be outermost",
        ),
        (dict(layer_names=("a", "b")), "2 layer names for 3 layers"),
        (dict(block_size=24), "not a multiple of kernel block size"),
        (dict(kernel_block_size=8, block_size=32), "'tokens' dim is 16"),
        (
            dict(logical_dims=("kv", "blocks", "heads", "tokens")),
            "must be a permutation",
        ),
    ],
)
def test_bad_layouts_are_rejected(change, message):
    with pytest.raises(ValueError, match=message):
        CrossLayerKVLayout(**{**GOOD, **change})


def test_layer_views_need_the_physical_shape():
    layout = CrossLayerKVLayout(**GOOD)
    with pytest.raises(ValueError, match="does not match layout"):
        layout.layer_views(torch.zeros(3, 3))
