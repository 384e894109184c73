"""An in-process vLLM 0.32 engine with ``TieringOffloadingSpec`` (the CPU
primary tier in its shared region, upstream's ``fs`` tier in ``fs_dir``),
shut down while the interpreter lives; printed as JSON.

Reports the mappings of the primary tier's file in ``/proc/self/maps``
(``vllm_offload_<engine_id>.mmap``; its name is removed once mapped, so
the kernel lists it as ``(deleted)``) while the engine serves and after
``engine_core.shutdown()`` and a garbage collection, and the file's
/dev/shm entry at the end.

    python run_region_release.py '{"fs_dir": "/tmp/kv"}'
"""

from __future__ import annotations

import gc
import json
import os
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "e2e"))
sys.path.insert(0, str(pathlib.Path(__file__).parent))  # this run_offload
from run_llm import prompts  # noqa: E402
from run_offload import extra_config  # noqa: E402

from vllm_overlay.testing import cpu_defaults, tiny_engine_args  # noqa: E402


def mappings(engine_id: str) -> int:
    name = f"vllm_offload_{engine_id}.mmap"
    with open("/proc/self/maps") as maps:
        return sum(1 for line in maps if name in line)


def main(config: dict) -> dict:
    cpu_defaults()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    kv = KVTransferConfig(
        kv_connector="OffloadingConnector",
        kv_role="kv_both",
        kv_connector_extra_config=extra_config({"fs_dir": config["fs_dir"]}),
    )
    llm = LLM(**tiny_engine_args(kv_transfer_config=kv))
    engine_id = llm.llm_engine.vllm_config.kv_transfer_config.engine_id
    out = llm.generate(
        [prompts()[-1]],  # several blocks: stored to the primary tier
        SamplingParams(temperature=0.0, max_tokens=16),
        use_tqdm=False,
    )
    result = {
        "tokens": list(out[0].outputs[0].token_ids),
        "serving": mappings(engine_id),
    }
    if config.get("shutdown", True):
        llm.llm_engine.engine_core.shutdown()
    del llm, out
    gc.collect()
    result["after_shutdown"] = mappings(engine_id)
    result["file_left"] = pathlib.Path(
        f"/dev/shm/vllm_offload_{engine_id}.mmap"
    ).exists()
    return result


if __name__ == "__main__":
    from result_out import emit

    emit(main(json.loads(sys.argv[1])))
