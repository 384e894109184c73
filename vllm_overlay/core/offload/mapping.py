"""Pair up source and destination sub-blocks of an offload transfer.

An offloaded (host) block holds ``factor`` cache blocks.  A transfer names
whole blocks on both sides; expanded to cache-block granularity the two
lists may differ in length when a request's device prefix hit is not aligned
to the offloaded block size: the first sub-blocks of the larger side are
then already in place and are skipped.  (vLLM 0.11.2 skipped only on the
destination side and asserted otherwise, so such loads crashed; 0.12 skips
on the source side.  This handles both.)
"""

from __future__ import annotations

import numpy as np


def expand(block_ids: np.ndarray, factor: int) -> np.ndarray:
    """[0, 1, 3] with factor 4 -> [0..3, 4..7, 12..15]."""
    ids = np.asarray(block_ids, dtype=np.int64)
    return (ids[:, None] * factor + np.arange(factor, dtype=np.int64)).reshape(-1)


def pair_sub_blocks(
    src_ids, src_factor: int, dst_ids, dst_factor: int
) -> tuple[np.ndarray, np.ndarray]:
    src = expand(src_ids, src_factor)
    dst = expand(dst_ids, dst_factor)
    extra = len(src) - len(dst)
    if extra > 0:
        if extra >= src_factor:
            raise ValueError(
                f"transfer of {len(src_ids)}x{src_factor} "
                f"source sub-blocks into {len(dst)}: more than "
                "one block too many"
            )
        src = src[extra:]
    elif extra < 0:
        if -extra >= dst_factor:
            raise ValueError(
                f"transfer of {len(src)} sub-blocks into "
                f"{len(dst_ids)}x{dst_factor}: more than one "
                "block too many"
            )
        dst = dst[-extra:]
    return src, dst
