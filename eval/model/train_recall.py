"""Train the KV-recall model used by the correctness suites (CPU, minutes).

Task: a list of key-value pairs, then queries; the answer to ``? k17 :`` is
the value that followed ``k17`` in the list, hundreds of tokens earlier.  It
can only be answered by attending back through the KV cache, so a wrong
layer, a wrong block or stale bytes make the model fail.

    text:   k17 : v05 ; k03 : v31 ; ... ; ? k03 : v31 ; ? k17 : v05 ;

Word-level tokenizer (built here), Llama architecture (4 layers, hidden 128,
head size 32: CPU_ATTN supports it), trained from a fixed seed with a
curriculum (short lists first).  Writes ``eval/model/recall_llama``.

    python eval/model/train_recall.py [--steps N] [--out DIR]
"""

from __future__ import annotations

import argparse
import math
import pathlib
import random
import time

import torch

HERE = pathlib.Path(__file__).parent
OUT = HERE / "recall_llama"
NUM_KEYS, NUM_VALUES = 128, 32
SEED = 1234


def vocab() -> list[str]:
    return (["<unk>", "<s>", "</s>", ":", ";", "?"]
            + [f"k{i:03d}" for i in range(NUM_KEYS)]
            + [f"v{i:02d}" for i in range(NUM_VALUES)])


def make_tokenizer(out: pathlib.Path):
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders
    from transformers import PreTrainedTokenizerFast

    words = vocab()
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)},
                                     unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins with spaces
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>",
                                   eos_token="</s>", unk_token="<unk>")
    fast.model_max_length = 4096
    fast.save_pretrained(out)
    return fast


def sample(rng: random.Random, pairs: int, queries: int
           ) -> tuple[list[str], list[tuple[str, str]]]:
    keys = rng.sample(range(NUM_KEYS), pairs)
    table = [(f"k{k:03d}", f"v{rng.randrange(NUM_VALUES):02d}") for k in keys]
    asked = [table[rng.randrange(pairs)] for _ in range(queries)]
    return table, asked


def render(table, asked) -> str:
    body = " ".join(f"{k} : {v} ;" for k, v in table)
    return body + " " + " ".join(f"? {k} : {v} ;" for k, v in asked)


def batch(rng, tokenizer, size: int, pairs: int, queries: int):
    ids, mask = [], []
    for _ in range(size):
        table, asked = sample(rng, pairs, queries)
        tokens = [tokenizer.bos_token_id] + tokenizer(render(table, asked))[
            "input_ids"]
        # Loss on the query answers only: positions of "v" after "? k :".
        m = [0] * len(tokens)
        start = 1 + 4 * pairs
        for q in range(queries):
            m[start + 5 * q + 3] = 1
        ids.append(tokens)
        mask.append(m)
    return torch.tensor(ids), torch.tensor(mask, dtype=torch.bool)


def build_model(tokenizer, layers: int = 4, hidden: int = 128):
    from transformers import LlamaConfig, LlamaForCausalLM

    heads = hidden // 32  # head size 32: CPU_ATTN supports it
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=hidden,
        intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=heads,
        head_dim=32, max_position_embeddings=2048, rope_theta=10000.0,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=False,
        torch_dtype="float32")
    return LlamaForCausalLM(config)


@torch.no_grad()
def accuracy(model, tokenizer, pairs: int, n: int = 64) -> float:
    rng = random.Random(999)
    ids, mask = batch(rng, tokenizer, n, pairs, 4)
    logits = model(ids).logits[:, :-1]
    pred = logits.argmax(-1)
    target = ids[:, 1:]
    m = mask[:, 1:]
    return float((pred[m] == target[m]).float().mean())


def train(steps: int, out: pathlib.Path, layers: int, hidden: int,
          lr_max: float) -> None:
    torch.manual_seed(SEED)
    rng = random.Random(SEED)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = make_tokenizer(out)
    model = build_model(tokenizer, layers, hidden)
    opt = torch.optim.AdamW(model.parameters(), lr=lr_max, weight_decay=0.01)
    # Curriculum: (fraction of steps, pairs range, batch size)
    phases = [(0.6, (8, 16), 64), (0.25, (16, 48), 32), (0.15, (48, 100), 16)]
    step, start = 0, time.time()
    for frac, (lo, hi), size in phases:
        for _ in range(int(steps * frac)):
            lr = lr_max * min(1.0, (step + 1) / 100) * (
                0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / steps)))
            for group in opt.param_groups:
                group["lr"] = lr
            ids, mask = batch(rng, tokenizer, size, rng.randint(lo, hi), 16)
            logits = model(ids).logits[:, :-1]
            loss = torch.nn.functional.cross_entropy(
                logits[mask[:, 1:]], ids[:, 1:][mask[:, 1:]])
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            step += 1
            if step % 100 == 0:
                print(f"step {step} loss {loss.item():.3f} acc@20 "
                      f"{accuracy(model, tokenizer, 20):.2f} acc@80 "
                      f"{accuracy(model, tokenizer, 80):.2f} "
                      f"({time.time() - start:.0f}s)", flush=True)
    print(f"final acc@80 pairs: {accuracy(model, tokenizer, 80):.3f}")
    model.save_pretrained(out, safe_serialization=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--out", type=pathlib.Path, default=OUT)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--lr", type=float, default=2e-3)
    args = parser.parse_args()
    torch.set_num_threads(2)
    train(args.steps, args.out, args.layers, args.hidden, args.lr)
