"""Cross-layer KV buffers: the physical layout, described explicitly.

Knows nothing of vLLM.  A ``CrossLayerKVLayout`` says how one buffer holding
the KV cache of every layer is laid out: the physical dimension order (named),
the shape, the dtype, which layer sits at which index, and what follows from
that for block transfers: the bytes of one block for all layers, each layer's
byte offset inside a block, and where K and V start inside a layer.

Dimension names: ``blocks`` (KV blocks as the attention kernel indexes them),
``layers``, ``kv`` (K then V; absent for MLA's joint latent), ``heads``,
``tokens`` (positions inside a block), ``head_size``.
"""

from __future__ import annotations

import dataclasses
import math

import torch

DIM_NAMES = ("blocks", "layers", "kv", "heads", "tokens", "head_size")


@dataclasses.dataclass(frozen=True)
class CrossLayerKVLayout:
    dims: tuple[str, ...]  # physical order, outermost first
    shape: tuple[int, ...]  # physical shape, same order as dims
    logical_dims: tuple[str, ...]  # dim order of one layer's view
    dtype: torch.dtype
    layer_names: tuple[str, ...]  # index along "layers" -> layer name
    block_size: int  # tokens per cache block (the scheduler's block)
    kernel_block_size: int  # tokens per block as stored ("tokens" dim)

    def __post_init__(self) -> None:
        if len(self.dims) != len(self.shape):
            raise ValueError(
                f"dims {self.dims} and shape {self.shape} differ in length"
            )
        unknown = set(self.dims) - set(DIM_NAMES)
        if unknown or len(set(self.dims)) != len(self.dims):
            raise ValueError(
                f"dims {self.dims}: names must be unique and among {DIM_NAMES}"
            )
        if sorted(("layers",) + self.logical_dims) != sorted(self.dims):
            raise ValueError(
                f"logical dims {self.logical_dims} plus 'layers' "
                f"must be a permutation of {self.dims}"
            )
        if self.dims[0] != "blocks":
            raise ValueError(
                f"dims {self.dims}: 'blocks' must be outermost "
                "so that each block is one contiguous run"
            )
        if self.size("layers") != len(self.layer_names):
            raise ValueError(
                f"{len(self.layer_names)} layer names for {self.size('layers')} layers"
            )
        if self.kernel_block_size <= 0 or self.block_size % self.kernel_block_size:
            raise ValueError(
                f"block size {self.block_size} is not a multiple "
                f"of kernel block size {self.kernel_block_size}"
            )
        if self.size("tokens") != self.kernel_block_size:
            raise ValueError(
                f"'tokens' dim is {self.size('tokens')}, kernel "
                f"block size is {self.kernel_block_size}"
            )

    # -- sizes ----------------------------------------------------------
    def size(self, dim: str) -> int:
        return self.shape[self.dims.index(dim)]

    def stride(self, dim: str) -> int:
        """Stride of ``dim`` in elements (the buffer is contiguous)."""
        return math.prod(self.shape[self.dims.index(dim) + 1 :])

    @property
    def element_size(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def num_layers(self) -> int:
        return len(self.layer_names)

    @property
    def num_blocks(self) -> int:
        """Blocks as stored (kernel blocks)."""
        return self.size("blocks")

    @property
    def blocks_per_cache_block(self) -> int:
        return self.block_size // self.kernel_block_size

    @property
    def num_cache_blocks(self) -> int:
        return self.num_blocks // self.blocks_per_cache_block

    @property
    def block_bytes(self) -> int:
        """Bytes of one stored block for all layers: one contiguous run."""
        return self.stride("blocks") * self.element_size

    @property
    def cache_block_bytes(self) -> int:
        """Bytes of one cache block (all its kernel blocks, all layers)."""
        return self.block_bytes * self.blocks_per_cache_block

    @property
    def total_bytes(self) -> int:
        return math.prod(self.shape) * self.element_size

    @property
    def layer_contiguous_in_block(self) -> bool:
        """True when each layer's part of a block is one run (layers is
        the second dim); False for head-major orders."""
        return self.dims[1] == "layers"

    @property
    def layer_offsets(self) -> tuple[int, ...]:
        """Byte offset of each layer's first element inside a block."""
        step = self.stride("layers") * self.element_size
        return tuple(i * step for i in range(self.num_layers))

    @property
    def kv_offsets(self) -> tuple[int, int] | None:
        """Byte offsets of K and V relative to a layer's first element,
        or None when the cache has no separate K and V (MLA)."""
        if "kv" not in self.dims:
            return None
        return (0, self.stride("kv") * self.element_size)

    # -- views ----------------------------------------------------------
    def logical_order(self) -> tuple[int, ...]:
        """Permutation taking ``("layers", *logical_dims)`` to ``dims``."""
        logical = ("layers",) + self.logical_dims
        return tuple(logical.index(d) for d in self.dims)

    def allocate(self, device: torch.device | str) -> torch.Tensor:
        """One zeroed, contiguous buffer with the physical shape."""
        raw = torch.zeros(self.total_bytes, dtype=torch.int8, device=device)
        return raw.view(self.dtype).view(self.shape)

    def layer_views(self, buffer: torch.Tensor) -> list[torch.Tensor]:
        """Per-layer views with the logical shape and physical strides.

        ``buffer`` needs the physical shape; any dtype (tests view index
        tensors through the same strides)."""
        if tuple(buffer.shape) != self.shape:
            raise ValueError(
                f"buffer shape {tuple(buffer.shape)} does not match layout {self.shape}"
            )
        order = self.logical_order()
        inverse = [order.index(i) for i in range(len(order))]
        logical = buffer.permute(*inverse)
        return [logical[i] for i in range(self.num_layers)]

    # -- reporting --------------------------------------------------------
    def describe(self) -> str:
        dims = ", ".join(f"{d}={n}" for d, n in zip(self.dims, self.shape))
        return (
            f"[{dims}] {str(self.dtype).removeprefix('torch.')}, "
            f"{self.num_layers} layers, {self.block_bytes} B per block "
            f"for all layers"
        )

    def to_dict(self) -> dict:
        return {
            "dims": list(self.dims),
            "shape": list(self.shape),
            "logical_dims": list(self.logical_dims),
            "dtype": str(self.dtype).removeprefix("torch."),
            "layer_names": list(self.layer_names),
            "block_size": self.block_size,
            "kernel_block_size": self.kernel_block_size,
            "block_bytes": self.block_bytes,
            "cache_block_bytes": self.cache_block_bytes,
            "layer_offsets": list(self.layer_offsets),
            "layer_contiguous_in_block": self.layer_contiguous_in_block,
            "kv_offsets": (None if self.kv_offsets is None else list(self.kv_offsets)),
        }
