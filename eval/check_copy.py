"""Greedy copy accuracy of eval/model/copy_llama in real vLLM.

16 prompts: a random sequence of 250-400 tokens, the separator, its first
5-50 tokens; the next 20 generated tokens are compared with the sequence.

    python eval/check_copy.py {stock,cross} [--break-layout]

``cross`` uses CrossLayerProbeConnector (cross-layer blocks);
``--break-layout`` aliases every layer's view to layer 0's cache.
"""

import os
import pathlib
import random
import sys

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

if __name__ == "__main__":
    from vllm_overlay.testing import cpu_defaults

    cpu_defaults()
    if "--break-layout" in sys.argv:
        from vllm_overlay.core.kv_layout import CrossLayerKVLayout

        views = CrossLayerKVLayout.layer_views
        CrossLayerKVLayout.layer_views = (
            lambda self, b: [views(self, b)[0]] * self.num_layers
        )
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    kv = (
        KVTransferConfig(kv_connector="CrossLayerProbeConnector", kv_role="kv_both")
        if sys.argv[1] == "cross"
        else None
    )
    llm = LLM(
        model=str(pathlib.Path(__file__).parent / "model" / "copy_llama"),
        dtype="float32",
        max_model_len=1024,
        num_gpu_blocks_override=64,
        enforce_eager=True,
        kv_transfer_config=kv,
    )
    rng = random.Random(7)
    prompts, wants = [], []
    for _ in range(16):
        seq = [f"t{rng.randrange(64):02d}" for _ in range(rng.randint(250, 400))]
        k = rng.randint(5, 50)
        prompts.append(" ".join(seq) + " | " + " ".join(seq[:k]))
        wants.append(seq[k : k + 20])
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=20))
    ok = sum(
        a == b
        for o, w in zip(outs, wants)
        for a, b in zip(o.outputs[0].text.split(), w)
    )
    print(f"COPY ACC {ok / sum(len(w) for w in wants):.3f}")
