"""vllm/v1/worker/gpu_worker.py: this stage's share of the KV budget.

With the flag on, ``Worker.determine_available_memory`` returns the stage's
share of ``--kv-cache-memory-bytes`` (by layers) instead of all of it.
"""

from vllm_overlay.core.patching import REGISTRY, Patch
from vllm_overlay.integration import pp_kv

MODULE = "vllm.v1.worker.gpu_worker"


def determine_available_memory(self) -> int:
    budget = pp_kv.rank_budget(self.vllm_config, REGISTRY.original("PP-04")(self))
    self.vllm_overlay_kv_budget = budget
    return budget


PATCHES = [
    Patch(
        id="PP-04",
        module=MODULE,
        target="Worker.determine_available_memory",
        new=determine_available_memory,
        feature="pipeline-parallel KV budget",
        why="Each pipeline stage reserves its share of the budget by "
        "layers, so all stages fit the same number of blocks.",
        upstream="vllm-project/vllm#25164 (flag version)",
        removal="Drop with PP-01..03.",
    ),
]
