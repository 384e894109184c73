"""Build the tiny Llama-style model shipped in ``vllm_overlay/models/tiny_llama``.

No hub: the tokenizer is a byte-level BPE trained here on a generated corpus,
the weights are random from a fixed seed.  4 layers (so a layer mix-up shows),
head size 32 (CPU_ATTN supports 32, 64, ...), 2 KV heads for 4 query heads.

    python -m vllm_overlay.models.build_tiny_llama [OUT_DIR]
"""

from __future__ import annotations

import json
import pathlib
import random
import sys

DEFAULT_DIR = pathlib.Path(__file__).with_name("tiny_llama")
SEED = 20251121
VOCAB_SIZE = 512

_WORDS = [
    "the",
    "a",
    "one",
    "two",
    "three",
    "four",
    "five",
    "six",
    "seven",
    "eight",
    "nine",
    "ten",
    "block",
    "cache",
    "layer",
    "key",
    "value",
    "token",
    "model",
    "page",
    "copy",
    "host",
    "device",
    "fast",
    "slow",
    "memory",
    "prefix",
    "request",
    "node",
    "pool",
    "write",
    "read",
    "load",
    "store",
    "offload",
    "swap",
    "kernel",
    "stream",
    "event",
    "scatter",
    "gather",
    "contiguous",
    "transfer",
    "bytes",
    "time",
    "step",
    "decode",
    "prefill",
    "attention",
    "head",
    "size",
    "order",
    "stride",
    "shape",
    "view",
    "tensor",
    "buffer",
    "index",
    "hash",
    "red",
    "green",
    "blue",
    "river",
    "stone",
    "cloud",
    "light",
    "dark",
    "north",
    "south",
    "east",
    "west",
    "apple",
    "bread",
    "water",
    "fire",
    "earth",
    "wind",
    "city",
    "road",
    "house",
    "door",
    "window",
    "tree",
]


def _corpus(rng: random.Random, lines: int = 4000) -> list[str]:
    out = []
    for _ in range(lines):
        words = rng.choices(_WORDS, k=rng.randint(4, 16))
        number = str(rng.randint(0, 9999))
        words.insert(rng.randint(0, len(words)), number)
        out.append(" ".join(words).capitalize() + rng.choice(".!?,;:"))
    return out


TOKENIZER_CLASS = "PreTrainedTokenizerFast"


def build_tokenizer(out_dir: pathlib.Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus(random.Random(SEED)), trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    fast.model_max_length = 4096
    fast.save_pretrained(out_dir)
    # transformers 5 (vLLM 0.32's) names the class "TokenizersBackend", which
    # transformers 4 (vLLM 0.11.2's) cannot load; both load this name, so a
    # model built by either release's environment serves on both.
    config_path = pathlib.Path(out_dir) / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["tokenizer_class"] = TOKENIZER_CLASS
    config_path.write_text(json.dumps(config, indent=2) + "\n")
    return fast


def write_random_llama(
    out_dir: pathlib.Path,
    *,
    hidden: int,
    intermediate: int,
    layers: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    max_positions: int,
    init_range: float,
    seed: int,
) -> pathlib.Path:
    """A random-weight LlamaForCausalLM of this shape with this module's
    tokenizer, saved (safetensors) to OUT_DIR."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out_dir = pathlib.Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(out_dir)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=max_positions,
        initializer_range=init_range,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


def build(out_dir: pathlib.Path = DEFAULT_DIR) -> pathlib.Path:
    return write_random_llama(
        out_dir,
        hidden=128,
        intermediate=256,
        layers=4,
        heads=4,
        kv_heads=2,
        head_dim=32,
        max_positions=4096,
        init_range=0.08,
        seed=SEED,
    )


if __name__ == "__main__":
    print(build(pathlib.Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_DIR))
