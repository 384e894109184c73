"""A seeded synthetic multi-turn chat workload, in token ids.

Shared system prompts; conversations of several turns, each opening with
one of the system prompts; every turn's prompt is the previous turn's
prompt + the assistant's answer to it + a new user message, so each turn
extends a prefix that the node which served the previous turn holds.  The
answers are scripted (part of the workload, as in a replayed chat log), so
every configuration sends exactly the same prompts whatever the model
generated.  The turns of all conversations are merged into one seeded
order, as many users would send them: a turn is sent only after its
conversation's previous turn was answered (the client's job).

Token ids, not text: a prompt sent as ids is the exact extension of the
previous prompt (no re-tokenization at the joins), so a cached prefix is
hit up to its last full block.

    python benchmarks/serving/workload.py --seed 1    # prints a summary
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random


@dataclasses.dataclass(frozen=True)
class WorkloadSpec:
    conversations: int = 12
    system_prompts: int = 3
    system_tokens: int = 1024
    turns: tuple[int, int] = (3, 5)  # per conversation, inclusive range
    user_tokens: tuple[int, int] = (64, 256)
    answer_tokens: tuple[int, int] = (64, 192)  # scripted assistant turns
    vocab: int = 512
    first_id: int = 3  # ids below are special tokens


@dataclasses.dataclass
class Turn:
    conversation: int
    index: int  # 0-based turn number within its conversation
    system: int  # which system prompt
    prompt: list[int]


def _ids(rng: random.Random, spec: WorkloadSpec, n: int) -> list[int]:
    return [rng.randrange(spec.first_id, spec.vocab) for _ in range(n)]


def generate(spec: WorkloadSpec, seed: int) -> dict:
    """The workload: system prompts, and the turns in sending order."""
    rng = random.Random(seed)
    systems = [_ids(rng, spec, spec.system_tokens) for _ in range(spec.system_prompts)]
    conversations = []
    for c in range(spec.conversations):
        system = rng.randrange(spec.system_prompts)
        prompt = list(systems[system])
        turns = []
        for t in range(rng.randint(*spec.turns)):
            if t:
                prompt = prompt + _ids(rng, spec, rng.randint(*spec.answer_tokens))
            prompt = prompt + _ids(rng, spec, rng.randint(*spec.user_tokens))
            turns.append(Turn(c, t, system, prompt))
        conversations.append(turns)
    # Interleave: repeatedly pick a conversation at random (weighted by its
    # turns left) and take its next turn.
    order, cursors = [], [0] * len(conversations)
    left = sum(len(turns) for turns in conversations)
    while left:
        pick = rng.randrange(left)
        for c, turns in enumerate(conversations):
            remaining = len(turns) - cursors[c]
            if pick < remaining:
                order.append(turns[cursors[c]])
                cursors[c] += 1
                break
            pick -= remaining
        left -= 1
    return {
        "seed": seed,
        "spec": dataclasses.asdict(spec),
        "systems": systems,
        "turns": order,
    }


def summary(workload: dict) -> dict:
    lengths = [len(t.prompt) for t in workload["turns"]]
    return {
        "seed": workload["seed"],
        "requests": len(lengths),
        "conversations": workload["spec"]["conversations"],
        "prompt_tokens_total": sum(lengths),
        "prompt_tokens_min_max": [min(lengths), max(lengths)],
        "order": [f"c{t.conversation}.{t.index}" for t in workload["turns"]],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    print(json.dumps(summary(generate(WorkloadSpec(), args.seed)), indent=1))


if __name__ == "__main__":
    main()
