"""Train the copy model for the correctness suites (CPU, about 10 minutes).

Task: a random token sequence, a separator, then the same sequence again.
Each token of the copy is only predictable by attending back through the KV
cache to the token after its previous occurrence (an induction head), so a
wrong layer, a wrong block or stale bytes in the cache break it.

    text:  t12 t05 t63 ... t40 | t12 t05 t63 ... t40

2-layer Llama (hidden 64, head size 32: CPU_ATTN supports it), word-level
tokenizer built here, fixed seed, curriculum over lengths (16..64, then up
to 200, then up to 400 tokens).  Writes ``eval/model/copy_llama``.

Measured with this script on the 2-core machine: 2000 steps in 79 s; copy
accuracy 0.991 at 150 tokens and 0.999 at 350 (its last output line).

    python eval/model/train_copy.py [--out DIR]
"""

from __future__ import annotations

import argparse
import pathlib
import random
import time

import torch

HERE = pathlib.Path(__file__).parent
OUT = HERE / "copy_llama"
NUM_TOKENS = 64
SPECIAL = ["<unk>", "<s>", "</s>", "|"]
SEED = 0
# (steps, min length, max length, batch)
PHASES = [(1000, 16, 64, 32), (500, 64, 200, 8), (500, 200, 400, 4)]


def words() -> list[str]:
    return SPECIAL + [f"t{i:02d}" for i in range(NUM_TOKENS)]


def make_tokenizer(out: pathlib.Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(words())}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    fast.model_max_length = 2048
    fast.save_pretrained(out)
    return fast


def batch(size: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    first = len(SPECIAL)
    x = torch.randint(first, first + NUM_TOKENS, (size, length))
    bos = torch.full((size, 1), SPECIAL.index("<s>"))
    sep = torch.full((size, 1), SPECIAL.index("|"))
    ids = torch.cat([bos, x, sep, x], 1)
    mask = torch.zeros_like(ids, dtype=torch.bool)
    mask[:, length + 2 :] = True  # loss on the copy only
    return ids, mask


@torch.no_grad()
def accuracy(model, length: int) -> float:
    ids, mask = batch(16, length)
    pred = model(ids).logits[:, :-1].argmax(-1)
    m = mask[:, 1:]
    return float((pred[m] == ids[:, 1:][m]).float().mean())


def train(out: pathlib.Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(SEED)
    rng = random.Random(SEED)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = make_tokenizer(out)
    config = LlamaConfig(
        vocab_size=len(words()),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=2048,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    model = LlamaForCausalLM(config)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    step, start = 0, time.time()
    for steps, lo, hi, size in PHASES:
        for _ in range(steps):
            for group in opt.param_groups:
                group["lr"] = 3e-3 * min(1.0, (step + 1) / 50)
            ids, mask = batch(size, rng.randint(lo, hi))
            logits = model(ids).logits[:, :-1]
            loss = torch.nn.functional.cross_entropy(
                logits[mask[:, 1:]], ids[:, 1:][mask[:, 1:]]
            )
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            step += 1
            if step % 100 == 0:
                print(
                    f"step {step} loss {loss.item():.3f} acc@150 "
                    f"{accuracy(model, 150):.2f} acc@350 "
                    f"{accuracy(model, 350):.2f} "
                    f"({time.time() - start:.0f}s)",
                    flush=True,
                )
    model.save_pretrained(out, safe_serialization=True)
    print(
        f"saved {out}: acc@150 {accuracy(model, 150):.3f} acc@350 "
        f"{accuracy(model, 350):.3f}"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=pathlib.Path, default=OUT)
    args = parser.parse_args()
    torch.set_num_threads(2)
    train(args.out)
