"""Build a tiny DeepSeek-V2-shaped model (MLA attention) with random weights.

No hub: the tokenizer is the tiny Llama's (trained here, see
build_tiny_llama), the weights are random from a fixed seed.  The
attention is DeepSeek's multi-head latent attention: per token and layer
the KV cache holds one latent vector of ``kv_lora_rank +
qk_rope_head_dim`` values and no separate K and V.  Those two sizes are
DeepSeek-V2's own (512 + 64 = 576): vLLM 0.32's CPU MLA decode kernel is
compiled for that head size only.  Everything else is tiny: hidden size
128, 2 layers (the first dense, the second a small mixture of experts, as
DeepSeek-V2 has), 4 heads, a query low-rank projection of 64.

    python -m vllm_overlay.models.build_tiny_deepseek [OUT_DIR]
"""

from __future__ import annotations

import pathlib
import sys

from vllm_overlay.models.build_tiny_llama import build_tokenizer

DEFAULT_DIR = pathlib.Path(__file__).with_name("tiny_deepseek")
SEED = 20261125
KV_LORA_RANK = 512
QK_ROPE_HEAD_DIM = 64
LAYERS = 2


def build(out_dir: pathlib.Path = DEFAULT_DIR) -> pathlib.Path:
    import torch
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    out_dir = pathlib.Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(out_dir)
    config = DeepseekV2Config(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=64,
        kv_lora_rank=KV_LORA_RANK,
        qk_nope_head_dim=32,
        qk_rope_head_dim=QK_ROPE_HEAD_DIM,
        v_head_dim=32,
        first_k_dense_replace=1,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        moe_intermediate_size=64,
        n_group=2,  # vLLM routes DeepSeek-V2's experts by group
        topk_group=1,
        topk_method="group_limited_greedy",
        max_position_embeddings=4096,
        initializer_range=0.08,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    torch.manual_seed(SEED)
    model = DeepseekV2ForCausalLM(config)
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


if __name__ == "__main__":
    print(build(pathlib.Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_DIR))
