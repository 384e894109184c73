"""vllm/model_executor/layers/rotary_embedding/base.py: rotary embedding of
``[tokens, heads, head_size]`` queries and keys on the CPU platform.

``RotaryEmbedding.forward_cpu`` calls the CPU kernel
``torch.ops._C.rotary_embedding`` (csrc/cpu/pos_encoding.cpp, the same in
vLLM 0.32.0 and 0.33.0).  The kernel reads its query and key as ``[tokens,
heads * head_size]``: the heads from ``size(-1) / head_size``, the token
stride from ``stride(-2)``.  Given a 3-D ``[tokens, heads, head_size]``
tensor, it rotates one head per token at the head stride, so it rotates
other tokens' and heads' values and leaves most of the tensor's own values
unrotated.  (The GPU kernel takes both shapes.)  DeepSeek's MLA passes
3-D tensors (``MultiHeadLatentAttentionWrapper``: the rope part of the
query, ``q[..., qk_nope_head_dim:]``, and ``k_pe.unsqueeze(1)``, whose head
stride is not its token stride).  On the CPU platform (``CPU_MLA``), every
DeepSeek-V2/V3-style model then attends with wrong positions, and a
request's logprobs depend on the other requests in its batch.  Measured
with the tiny DeepSeek (tests/v0_32/test_mla_cpu.py), without the patch:
the first logprobs of 5 prompts are up to 0.20 away from transformers'
DeepseekV2, they move by up to 0.19 between a batch and one prompt at a
time, and a greedy token changes.  With the patch: 7e-7 from transformers,
2e-6 between batch and alone.

The patched method gives the kernel each tensor as ``[tokens, heads *
head_size]``.  Where such a view exists, the kernel rotates it in place.
Otherwise it rotates a contiguous copy, which is written back.  2-D tensors
(Llama and most models) pass through unchanged.
"""

from vllm_overlay.core.patching import REGISTRY, Patch

MODULE = "vllm.model_executor.layers.rotary_embedding.base"
PATCH_ID = "MLA32-01"


def _rows(x, tokens: int):
    """``x`` as ``[tokens, heads * head_size]`` rows, each contiguous, and
    whether that is a copy (to be written back) rather than a view."""
    if x.dim() == 2 and x.stride(-1) == 1:
        return x, False
    try:
        rows = x.view(tokens, -1)
        if rows.stride(-1) == 1:
            return rows, False
    except RuntimeError:
        pass
    return x.reshape(tokens, -1).contiguous(), True


def forward_cpu(self, positions, query, key=None):
    tokens = positions.numel()
    q_rows, q_copied = _rows(query, tokens)
    k_rows, k_copied = (None, False) if key is None else _rows(key, tokens)
    REGISTRY.original(PATCH_ID)(self, positions, q_rows, k_rows)
    if q_copied:
        query.copy_(q_rows.view(query.shape))
    if k_copied:
        key.copy_(k_rows.view(key.shape))
    return query, key


PATCHES = [
    Patch(
        id=PATCH_ID,
        module=MODULE,
        target="RotaryEmbedding.forward_cpu",
        new=forward_cpu,
        feature="DeepSeek MLA on the CPU platform",
        why="The CPU rotary kernel reads a [tokens, heads, head_size] query "
        "or key as [tokens, heads*head_size] (heads from size(-1), token "
        "stride from stride(-2)), so it rotates the wrong values; DeepSeek's "
        "MLA passes such tensors, and on CPU_MLA its outputs are wrong and "
        "depend on the batch. The patch hands the kernel 2-D rows.",
        upstream="none: to be proposed (the GPU kernel took both shapes in "
        "vllm#12777; csrc/cpu/pos_encoding.cpp still takes 2-D only in 0.33.0)",
        removal="Drop once the CPU kernel derives heads and the token stride "
        "from a 3-D tensor's shape.",
    ),
]
