"""The tiny DeepSeek (MLA, vllm_overlay/models/build_tiny_deepseek.py) on
the installed vLLM, greedy, printed as JSON: each prompt's tokens and
logprobs.  On vLLM 0.11.2's CPU platform the engine does not start (no MLA
attention backend: test_mla_refused_e2e.py).

    python run_mla.py '{}'
"""

from __future__ import annotations

import json
import sys

from result_out import records
from run_llm import prompts

from vllm_overlay.testing import cpu_defaults, in_process_engine, tiny_mla_engine_args


def main(config: dict) -> dict:
    cpu_defaults()
    in_process_engine(rpc=False)
    from vllm import LLM, SamplingParams

    llm = LLM(**tiny_mla_engine_args())
    params = SamplingParams(temperature=0.0, max_tokens=4, logprobs=1)
    return {"passes": [records(llm.generate(prompts(), params, use_tqdm=False))]}


if __name__ == "__main__":
    from result_out import emit

    emit(main(json.loads(sys.argv[1])))
