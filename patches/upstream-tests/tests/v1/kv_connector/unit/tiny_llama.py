# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A tiny random-weight Llama with a word-level tokenizer, written to a local
directory: engine tests on CPU without downloading a model."""

import contextlib
from pathlib import Path

VOCAB_SIZE = 256


def make_tiny_llama(path: Path, num_layers: int = 2, seed: int = 0) -> str:
    """Write the model and its tokenizer to PATH; returns the path."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>"]
    words = specials + [f"w{i}" for i in range(VOCAB_SIZE - len(specials))]
    tokenizer = Tokenizer(
        models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>")
    )
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    ).save_pretrained(path)

    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=num_layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    LlamaForCausalLM(config).save_pretrained(path)
    return str(path)


def prompt_token_ids(num_tokens: int, offset: int = 0) -> list[int]:
    """A prompt of NUM_TOKENS ordinary word ids (no special tokens)."""
    return [3 + (offset + 7 * i) % (VOCAB_SIZE - 3) for i in range(num_tokens)]


def run_once(llm, prompt, params):
    """(generated token ids, their logprobs, cached prompt tokens) of one
    prompt (PARAMS must ask for logprobs)."""
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    tokens = list(out.outputs[0].token_ids)
    logprobs = [lp[t].logprob for lp, t in zip(out.outputs[0].logprobs, tokens)]
    return tokens, logprobs, out.num_cached_tokens


@contextlib.contextmanager
def tiny_llm(model: str, num_gpu_blocks: int = 32, **kwargs):
    """An in-process engine (set VLLM_ENABLE_V1_MULTIPROCESSING=0) on MODEL,
    shut down with its KV connector on exit so the next one starts clean."""
    from vllm import LLM
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    llm = LLM(
        model=model,
        dtype="float32",
        max_model_len=256,
        block_size=16,
        num_gpu_blocks_override=num_gpu_blocks,
        enforce_eager=True,
        seed=0,
        **kwargs,
    )
    try:
        yield llm
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        cleanup_dist_env_and_memory()
