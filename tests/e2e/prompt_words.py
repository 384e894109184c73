"""Words the e2e runners build their prompts from (the tiny model's
tokenizer was trained on text like this)."""

WORDS = [
    "key",
    "value",
    "block",
    "cache",
    "layer",
    "token",
    "prefix",
    "north",
    "south",
    "river",
    "stone",
    "memory",
    "page",
    "copy",
    "seven",
]
