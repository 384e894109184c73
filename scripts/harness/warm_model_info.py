"""Fill vLLM's model-info cache of one harness before the suites start.

vLLM inspects a model class the first time an engine (or an EngineArgs
config) meets its architecture: in a fresh interpreter that imports vLLM
and the model (``python -m vllm.model_executor.models.registry``, about
10 s of CPU here), then caches the answer in
``$VLLM_CACHE_ROOT/modelinfos`` under the model file's hash.  On a fresh
clone the cache is empty and the first engines of both lanes start at
once: seven such interpreters ran side by side in the first minute of a
clean-clone run, each answering the same question.

This asks each question once, in this process, through vLLM's own cache
code (the registered model's ``inspect_model_cls``, with its subprocess
call made in-process: the same ``_ModelInfo.from_model_cls`` of the same
class), under a lock, so the lanes find it answered.  A marker with the
harness's stamp makes a later call return at once, without importing vLLM.

    VLLM_CACHE_ROOT=.tox/vllm-cache/0.32 .venv-0.32/bin/python \
        scripts/harness/warm_model_info.py     # tox.ini's commands_pre
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import pathlib
import sys
import time

# The architectures the suites' engines and configs use: the tiny and copy
# Llamas, the tiny DeepSeek (MLA), and the models vLLM's own tests name
# (patches/tools/run_upstream_tests*.py: facebook/opt-125m, Qwen/Qwen3-0.6B).
ARCHITECTURES = (
    "LlamaForCausalLM",
    "DeepseekV2ForCausalLM",
    "OPTForCausalLM",
    "Qwen3ForCausalLM",
)


LOCK_S = 300.0  # the longest the other lane waits for the warm-up


def main() -> int:
    cache = pathlib.Path(os.environ["VLLM_CACHE_ROOT"]) / "modelinfos"
    cache.mkdir(parents=True, exist_ok=True)
    stamp_file = pathlib.Path(sys.prefix) / ".harness-stamp"
    stamp = stamp_file.read_text().strip() if stamp_file.exists() else "none"
    asked = hashlib.sha256(",".join(ARCHITECTURES).encode()).hexdigest()[:8]
    marker = cache / f".warm-{stamp}-{asked}"
    if marker.exists():
        return 0
    with open(cache / ".warm.lock", "w") as lock:
        # The other lane waits for the warm-up, then returns; past LOCK_S it
        # warms the cache itself (the same files, written atomically by vLLM).
        deadline = time.monotonic() + LOCK_S
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if marker.exists():
                    return 0
                if time.monotonic() > deadline:
                    print(f"warm_model_info: lock held past {LOCK_S:.0f} s; warming")
                    break
                time.sleep(0.2)
        if marker.exists():
            return 0
        os.environ["VLLM_OVERLAY_DISABLE"] = "1"  # as vLLM's own subprocess
        from vllm.model_executor.models import registry

        registry._run_in_subprocess = lambda fn: fn()
        for arch in ARCHITECTURES:
            model = registry.ModelRegistry.models[arch]
            model.inspect_model_cls()  # cached: a read; else inspected, saved
        marker.touch()
    print(f"warm_model_info: {', '.join(ARCHITECTURES)} in {cache}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
