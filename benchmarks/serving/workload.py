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
    python benchmarks/serving/workload.py --simulate --seed 2026 --turns 6 10

``--simulate`` counts the prompt tokens a round-robin router and a sticky
one (each conversation on one node) leave to prefill, for each number of
nodes: a prefix cache of unbounded size per node, hit in whole blocks of
``--block`` tokens, requests taken in sending order (round-robin: the next
node for each request).  Their ratio bounds what any KV sharing between the
nodes can save over round-robin on this workload: its TTFT gain is at most
that ratio when prefill sets TTFT.
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


def prefilled_tokens(workload: dict, nodes: int, sticky: bool, block: int) -> int:
    """Prompt tokens left to prefill when each node caches every full block
    it computed (no eviction): sticky sends a conversation to one node,
    round-robin each request to the next node."""
    cached: list[set] = [set() for _ in range(nodes)]
    total = 0
    for i, turn in enumerate(workload["turns"]):
        node = cached[turn.conversation % nodes if sticky else i % nodes]
        prompt, hit = turn.prompt, 0
        for end in range(block, len(prompt) + 1, block):
            key = hash(tuple(prompt[:end]))
            if hit == end - block and key in node:
                hit = end
            node.add(key)
        total += len(prompt) - hit
    return total


def simulate(spec: WorkloadSpec, seeds, nodes_list, block: int) -> None:
    print(
        f"# turns {spec.turns[0]}-{spec.turns[1]} per conversation, "
        f"{spec.conversations} conversations, {block}-token blocks"
    )
    print(f"| nodes | round-robin / sticky prefilled tokens (seeds {list(seeds)}) |")
    print("|---|---|")
    for nodes in nodes_list:
        ratios = []
        for seed in seeds:
            workload = generate(spec, seed)
            rr = prefilled_tokens(workload, nodes, False, block)
            ratios.append(rr / prefilled_tokens(workload, nodes, True, block))
        print(f"| {nodes} | {' / '.join(f'{r:.2f}' for r in ratios)} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--simulate", action="store_true", help="prefill by router")
    ap.add_argument("--nodes", type=int, nargs="+", default=[2, 3, 4])
    ap.add_argument("--turns", type=int, nargs=2, help="per conversation (3 5)")
    ap.add_argument(
        "--seeds", type=int, default=3, help="--simulate: N seeds from --seed"
    )
    ap.add_argument("--block", type=int, default=128, help="cache block tokens")
    args = ap.parse_args()
    if min(args.nodes) < 1 or args.block < 1 or args.seeds < 1:
        ap.error("--nodes, --block and --seeds must be at least 1")
    if args.turns and not 1 <= args.turns[0] <= args.turns[1]:
        ap.error("--turns MIN MAX: 1 <= MIN <= MAX")
    spec = WorkloadSpec(turns=tuple(args.turns) if args.turns else (3, 5))
    if args.simulate:
        simulate(spec, range(args.seed, args.seed + args.seeds), args.nodes, args.block)
        return
    print(json.dumps(summary(generate(spec, args.seed)), indent=1))


if __name__ == "__main__":
    main()
