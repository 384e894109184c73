"""A weight update as an RL loop makes it in a serving engine, run in a
0.32 chaos node's worker through ``LLM.apply_model`` (the in-process
executor runs it in the node): the token embeddings changed through the
model's own ``load_weights`` (on CPU the linear layers run from weights
packed at load time, so their ``.weight`` is not what they compute with).
The same seeds in the same order give the same weights in every node and
in the stock node."""

from __future__ import annotations

NOISE = 0.05  # a weight update: this times N(0, 1) added to each embedding


def perturb(model, seed: int) -> list[str]:
    """New token embeddings through the model's ``load_weights`` (in the
    worker: the in-process executor runs it here)."""
    import torch

    weight = model.model.embed_tokens.weight
    noise = torch.randn(weight.shape, generator=torch.Generator().manual_seed(seed))
    new = (weight.detach() + NOISE * noise).to(weight.dtype)
    return sorted(model.load_weights([("model.embed_tokens.weight", new)]))


def embeddings(model):
    return model.model.embed_tokens.weight.detach().clone()


def restore(model, base) -> list[str]:
    return sorted(model.load_weights([("model.embed_tokens.weight", base)]))
