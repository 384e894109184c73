"""How the e2e runner scripts hand their result to the test process.

Printed after ``RESULT:`` for people, and written to the file named by
``OVERLAY_RESULT_FILE`` for the tests: with PP or a multiprocess engine,
worker processes share stdout and their log lines can land on the same line.
"""

from __future__ import annotations

import json
import os


def emit(result) -> None:
    text = json.dumps(result)
    if os.environ.get("OVERLAY_RESULT_FILE"):
        with open(os.environ["OVERLAY_RESULT_FILE"], "w") as f:
            f.write(text)
    print("RESULT:" + text, flush=True)


def records(outs) -> list[dict]:
    """Per request of ``LLM.generate``'s outputs: its prompt's length, the
    greedy tokens, their logprobs (``SamplingParams(logprobs=1)``) and the
    cached prompt tokens."""
    return [
        {
            "prompt_tokens": len(o.prompt_token_ids),
            "tokens": list(o.outputs[0].token_ids),
            "logprobs": [
                lp[t].logprob
                for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)
            ],
            "cached_tokens": o.num_cached_tokens or 0,
        }
        for o in outs
    ]
