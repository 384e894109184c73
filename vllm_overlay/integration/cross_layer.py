"""Deciding on, and allocating, the cross-layer KV buffer (vLLM adapter).

``plan_cross_layer_kv_cache`` checks every condition for one KV buffer of all
layers and returns either a layout or the reason for the stock layout:

1. a KV connector is configured and prefers cross-layer blocks;
2. the model is uniform: one KV cache group, one attention backend, a plain
   attention spec (full, sliding-window or MLA), one tensor per layer;
3. the backend gives a stride order with a layers dimension that keeps
   blocks outermost (each block one contiguous run for all layers).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from vllm_overlay.core.kv_layout import CrossLayerKVLayout

logger = logging.getLogger("vllm.overlay")


@dataclasses.dataclass(frozen=True)
class CrossLayerPlan:
    reason: str  # why this layout was chosen
    layout: CrossLayerKVLayout | None = None
    backend: Any = None  # attention backend class when layout is set

    @property
    def enabled(self) -> bool:
        return self.layout is not None


def _stock(reason: str) -> CrossLayerPlan:
    return CrossLayerPlan(reason=reason)


def name_kv_cache_dims(
    backend,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_size: int,
    cache_dtype: str,
) -> tuple[str, ...]:
    """Name each dim of ``backend.get_kv_cache_shape`` by varying one input
    at a time; the dim left over with size 2 is K/V.  Raises ValueError when
    the shape cannot be explained that way."""
    args = dict(
        num_blocks=num_blocks,
        block_size=block_size,
        num_kv_heads=num_kv_heads,
        head_size=head_size,
    )
    base = tuple(backend.get_kv_cache_shape(**args, cache_dtype_str=cache_dtype))
    names: list[str | None] = [None] * len(base)
    for arg, dim in (
        ("num_blocks", "blocks"),
        ("block_size", "tokens"),
        ("num_kv_heads", "heads"),
        ("head_size", "head_size"),
    ):
        varied = tuple(
            backend.get_kv_cache_shape(
                **{**args, arg: args[arg] * 2}, cache_dtype_str=cache_dtype
            )
        )
        changed = [i for i, (a, b) in enumerate(zip(base, varied)) if a != b]
        if len(varied) != len(base) or len(changed) > 1:
            raise ValueError(f"{arg} changes dims {changed} of {base}")
        if changed:
            if names[changed[0]] is not None:
                raise ValueError(f"dim {changed[0]} of {base} depends on two inputs")
            names[changed[0]] = dim
    for i, name in enumerate(names):
        if name is None:
            if base[i] != 2 or "kv" in names:
                raise ValueError(f"cannot name dim {i} of {base}")
            names[i] = "kv"
    if "blocks" not in names or "tokens" not in names:
        raise ValueError(f"no blocks/tokens dim in {base}")
    return tuple(names)  # type: ignore[arg-type]


def plan_cross_layer_kv_cache(
    runner, kv_cache_config, kernel_block_sizes: list[int]
) -> CrossLayerPlan:
    from vllm.distributed.kv_transfer import (
        get_kv_transfer_group,
        has_kv_transfer_group,
    )
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    if not has_kv_transfer_group():
        return _stock("no KV connector is configured")
    connector = get_kv_transfer_group()
    if not getattr(connector, "prefer_cross_layer_blocks", False):
        return _stock(
            f"KV connector {type(connector).__name__} does not "
            "prefer cross-layer blocks"
        )
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        return _stock(
            f"the model has {len(groups)} KV cache groups; "
            "cross-layer blocks need exactly one"
        )
    attn_groups = runner.attn_groups
    if len(attn_groups) != 1 or len(attn_groups[0]) != 1:
        return _stock("the layers use more than one attention backend or KV spec")
    group = attn_groups[0][0]
    spec, backend = group.kv_cache_spec, group.backend
    if not isinstance(spec, (FullAttentionSpec, SlidingWindowSpec)):
        return _stock(f"KV spec {type(spec).__name__} is not plain attention")
    if runner.runner_only_attn_layers:
        return _stock("some attention layers are runner-only")

    tensors = kv_cache_config.kv_cache_tensors
    sizes = {t.size for t in tensors}
    if not tensors or len(sizes) != 1:
        return _stock(f"per-layer KV tensors differ in size: {sorted(sizes)}")
    size = sizes.pop()
    if size % spec.page_size_bytes:
        return _stock(
            f"tensor size {size} is not a multiple of the page "
            f"size {spec.page_size_bytes}"
        )
    kernel_block_size = kernel_block_sizes[0]
    kernel_num_blocks = (
        size // spec.page_size_bytes * (spec.block_size // kernel_block_size)
    )
    cache_dtype = runner.cache_config.cache_dtype
    name = backend.get_name()
    try:
        order = tuple(
            backend.get_kv_cache_stride_order(include_num_layers_dimension=True)
        )
    except (AttributeError, NotImplementedError, TypeError) as exc:
        return _stock(
            f"attention backend {name} has no stride order with a "
            f"layers dimension ({exc})"
        )
    try:
        logical_dims = name_kv_cache_dims(
            backend,
            kernel_num_blocks,
            kernel_block_size,
            spec.num_kv_heads,
            spec.head_size,
            cache_dtype,
        )
    except ValueError as exc:
        return _stock(f"cannot read the KV cache shape of {name}: {exc}")
    if sorted(order) != list(range(len(logical_dims) + 1)):
        return _stock(
            f"attention backend {name} returned {order}, not a "
            f"permutation of {len(logical_dims) + 1} dims"
        )
    shape = backend.get_kv_cache_shape(
        kernel_num_blocks,
        kernel_block_size,
        spec.num_kv_heads,
        spec.head_size,
        cache_dtype_str=cache_dtype,
    )
    full_dims = ("layers",) + logical_dims
    full_shape = (len(tensors),) + tuple(shape)
    try:
        layout = CrossLayerKVLayout(
            dims=tuple(full_dims[i] for i in order),
            shape=tuple(full_shape[i] for i in order),
            logical_dims=logical_dims,
            dtype=spec.dtype,
            layer_names=tuple(t.shared_by[0] for t in tensors),
            block_size=spec.block_size,
            kernel_block_size=kernel_block_size,
        )
    except ValueError as exc:
        return _stock(f"attention backend {name}: {exc}")
    if layout.total_bytes != size * len(tensors):
        return _stock(
            f"layout needs {layout.total_bytes} B, the KV cache "
            f"config has {size * len(tensors)} B"
        )
    return CrossLayerPlan(
        reason=f"connector {type(connector).__name__} prefers it, the model "
        f"is uniform and {name} supports a layers dimension",
        layout=layout,
        backend=backend,
    )


def allocate_cross_layer_kv_cache(
    plan: CrossLayerPlan, kv_cache_config, device
) -> tuple[Any, dict[str, Any]]:
    """One buffer for all layers, and each layer's view into it (every name
    in a tensor's ``shared_by`` gets that tensor's view, as stock does)."""
    assert plan.layout is not None
    buffer = plan.layout.allocate(device)
    views = plan.layout.layer_views(buffer)
    kv_caches = {}
    for tensor, view in zip(kv_cache_config.kv_cache_tensors, views):
        for layer_name in tensor.shared_by:
            kv_caches[layer_name] = view
    return buffer, kv_caches


def log_plan(plan: CrossLayerPlan) -> None:
    if plan.enabled:
        logger.info(
            "vllm-overlay: KV cache layout: cross-layer blocks (%s); buffer %s",
            plan.reason,
            plan.layout.describe(),
        )
    else:
        logger.info(
            "vllm-overlay: KV cache layout: stock per-layer tensors (%s)", plan.reason
        )
