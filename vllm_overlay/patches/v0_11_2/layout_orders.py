"""Stride orders keyed by vLLM's KV cache layout (NHD / HND), shared by the
backend patches whose order depends on ``get_kv_cache_layout()``."""

from __future__ import annotations

# layout -> (order without layers, order with a leading layers dimension)
Orders = dict[str, tuple[tuple[int, ...], tuple[int, ...]]]


def order_for_layout(
    orders: Orders, cache_layout: str, include_num_layers_dimension: bool
) -> tuple[int, ...]:
    if cache_layout not in orders:
        raise ValueError(f"Unknown cache layout format {cache_layout}.")
    return orders[cache_layout][int(include_num_layers_dimension)]
