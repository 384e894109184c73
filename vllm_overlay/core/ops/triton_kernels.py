"""Triton jit code only: copy KV blocks between a paged cache and a packed
buffer.  Wrappers (checks, launch) live in ``block_copy.py``.

A cache block is a list of *segments*: contiguous runs of words at
``seg_src[s] + block_id * seg_stride[s]`` (words, relative to ``cache_ptr``).
The packed buffer holds block i at ``packed_ids[i] * packed_block_words``,
segment s at ``seg_dst[s]`` inside it.  One program copies CHUNK words of one segment of
one block; the grid is (blocks, segments, chunks per longest segment).

``VEC`` > 1 is the aligned variant: the host promises that every offset,
stride and length above (and both base pointers) is a multiple of ``VEC``
words, so Triton may move ``VEC`` words per access (int32 words and VEC=4:
128-bit ``ld.global.v4.b32`` / ``st.global.v4.b32``).  The offsets come from
memory, so without these hints the compiler must assume any alignment and
issues one scalar access per word.  ``VEC=1`` is the fallback for any
alignment.
"""

import triton
import triton.language as tl


@triton.jit
def copy_blocks_kernel(
    cache_ptr,  # reference pointer for all segment offsets
    packed_ptr,
    block_ids_ptr,  # int64 [num_blocks_to_copy]: cache block ids
    packed_ids_ptr,  # int64 [num_blocks_to_copy]: packed block positions
    seg_src_ptr,  # int64 [num_segments]: word offset of block 0
    seg_stride_ptr,  # int64 [num_segments]: words between blocks
    seg_dst_ptr,  # int64 [num_segments]: word offset inside a packed block
    seg_len_ptr,  # int64 [num_segments]: words per block
    packed_block_words,
    TO_PACKED: tl.constexpr,  # True: gather (cache -> packed); else scatter
    CHUNK: tl.constexpr,
    VEC: tl.constexpr = 1,  # alignment promise in words (see module doc)
):
    i = tl.program_id(0)
    s = tl.program_id(1)
    c = tl.program_id(2)
    seg_len = tl.load(seg_len_ptr + s)
    if VEC > 1:
        seg_len = tl.multiple_of(seg_len, VEC)
    start = c.to(tl.int64) * CHUNK
    if start < seg_len:
        block = tl.load(block_ids_ptr + i)
        cache_off = (
            tl.load(seg_src_ptr + s) + block * tl.load(seg_stride_ptr + s) + start
        )
        packed_off = (
            tl.load(packed_ids_ptr + i) * packed_block_words
            + tl.load(seg_dst_ptr + s)
            + start
        )
        if VEC > 1:
            cache_off = tl.multiple_of(cache_off, VEC)
            packed_off = tl.multiple_of(packed_off, VEC)
        offs = tl.max_contiguous(tl.multiple_of(tl.arange(0, CHUNK), CHUNK), CHUNK)
        mask = offs < seg_len - start
        if TO_PACKED:
            words = tl.load(cache_ptr + cache_off + offs, mask=mask)
            tl.store(packed_ptr + packed_off + offs, words, mask=mask)
        else:
            words = tl.load(packed_ptr + packed_off + offs, mask=mask)
            tl.store(cache_ptr + cache_off + offs, words, mask=mask)
