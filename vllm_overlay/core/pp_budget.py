"""Split one KV-cache byte budget across pipeline stages by their layers.

Knows nothing of vLLM.  With an uneven layer partition (say 56,8) every
stage getting the same ``--kv-cache-memory-bytes`` wastes memory: the stage
with more layers fits fewer blocks, and the engine uses the minimum.  Given
the budget for the whole pipeline, stage r gets ``total * layers_r /
total_layers`` (largest-remainder rounding, so the shares add up to the
total exactly and every rank computes the same split), and every stage fits
the same number of blocks.
"""

from __future__ import annotations

import dataclasses


def split_budget(total_bytes: int, layers_per_rank: list[int]) -> list[int]:
    if total_bytes <= 0:
        raise ValueError(f"KV cache budget must be > 0 bytes, got {total_bytes}")
    if not layers_per_rank or any(n <= 0 for n in layers_per_rank):
        raise ValueError(
            f"every pipeline stage needs at least one layer, "
            f"got partition {layers_per_rank}"
        )
    total_layers = sum(layers_per_rank)
    shares = [total_bytes * n // total_layers for n in layers_per_rank]
    remainders = [total_bytes * n % total_layers for n in layers_per_rank]
    leftover = total_bytes - sum(shares)
    for rank in sorted(range(len(shares)), key=lambda r: (-remainders[r], r))[
        :leftover
    ]:
        shares[rank] += 1
    return shares


@dataclasses.dataclass(frozen=True)
class StageBudget:
    rank: int
    layers: int
    bytes: int
    page_bytes_per_layer: int  # one block of one layer
    block_size: int  # tokens per block

    @property
    def blocks(self) -> int:
        return self.bytes // (self.page_bytes_per_layer * self.layers)

    def check(self) -> None:
        need = self.page_bytes_per_layer * self.layers
        if self.bytes < need:
            raise ValueError(
                f"pipeline stage {self.rank} ({self.layers} layers) gets "
                f"{self.bytes} B of KV cache, less than one block for its "
                f"layers ({need} B): raise --kv-cache-memory-bytes"
            )

    def describe(self, max_model_len: int) -> str:
        tokens = self.blocks * self.block_size
        return (
            f"PP rank {self.rank}: {self.layers} layers, "
            f"{self.bytes / 2**30:.3f} GiB ({self.bytes} B), "
            f"{self.blocks} blocks = {tokens} tokens, max concurrency "
            f"{tokens / max_model_len:.2f}x for {max_model_len}-token "
            "requests"
        )
