"""The chaos test's requests: a seeded, bounded mix of prompts that share a
prefix (a few families of 2-3 KV blocks each, so one node loads what the
other computed) and unrelated prompts, for the tiny model (about one
token per word)."""

from __future__ import annotations

import dataclasses
import random

BLOCK_TOKENS = 128  # vLLM's CPU block size for the tiny model
# Words the tiny model's tokenizer was trained on: about one token each.
_VOCABULARY = (
    "the a one two three four five six seven eight nine ten block cache layer "
    "key value token model page copy host device fast slow memory prefix "
    "request node pool write read load store offload swap kernel stream event "
    "scatter"
)
WORDS = _VOCABULARY.split()


@dataclasses.dataclass
class Request:
    id: str
    node: int  # which pool node serves it
    prompt: str
    max_tokens: int
    kind: str  # family | unrelated | seed | member (probes, victims)
    family: str | None = None


class Workload:
    """Requests for nodes ``0 .. nodes-1``; ``tag`` keeps the prompts of two
    workloads apart (no shared prefix between them)."""

    def __init__(
        self,
        seed: int,
        tag: str = "w",
        nodes: int = 2,
        families: int = 6,
        family_share: float = 0.6,
    ) -> None:
        self.rng = random.Random(seed)
        self.tag = tag
        self.nodes = nodes
        self.family_share = family_share
        self._n = 0
        self._fresh = 0
        self.families = {
            f"{tag}-f{i}": self._words(self.rng.randint(260, 380), f"{tag} f{i}")
            for i in range(families)
        }
        self._background = sorted(self.families)  # fresh ones stay apart

    def _words(self, n: int, head: str) -> str:
        # The head makes the first block unique to this family or prompt.
        return head + " " + " ".join(self.rng.choice(WORDS) for _ in range(n))

    def _id(self, kind: str) -> str:
        self._n += 1
        return f"{self.tag}-{kind}-{self._n}"

    def background(self) -> Request:
        """The next request of the steady mix."""
        node = self.rng.randrange(self.nodes)
        max_tokens = self.rng.randint(4, 12)
        if self.rng.random() < self.family_share:
            family = self.rng.choice(self._background)
            prompt = self.families[family] + " " + self._suffix()
            return Request(self._id("fam"), node, prompt, max_tokens, "family", family)
        prompt = self._words(self.rng.randint(60, 420), f"{self.tag} u{self._n}")
        return Request(self._id("uni"), node, prompt, max_tokens, "unrelated")

    def _suffix(self) -> str:
        return " ".join(self.rng.choice(WORDS) for _ in range(self.rng.randint(8, 60)))

    def fresh_family(self) -> str:
        """A new prefix (3 blocks) no request has used: only the pool can
        give it to a node that did not compute it."""
        self._fresh += 1
        name = f"{self.tag}-g{self._fresh}"
        head = f"{self.tag} g{self._fresh}"
        self.families[name] = self._words(3 * BLOCK_TOKENS + 20, head)
        return name

    def member(self, family: str, node: int, kind: str = "member") -> Request:
        prompt = self.families[family] + " " + self._suffix()
        return Request(self._id(kind), node, prompt, 8, kind, family)
