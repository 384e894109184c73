"""vllm/v1/worker/cpu_worker.py: respect --kv-cache-memory-bytes on CPU.

Stock ``CPUWorker.determine_available_memory`` always returns
``VLLM_CPU_KVCACHE_SPACE`` and ignores ``kv_cache_memory_bytes``.  An explicit
``kv_cache_memory_bytes`` now wins (and is split by layers when
``--enable-pp-prop-kv-cache`` is on); without it, stock behaviour.
"""

import logging

from vllm_overlay.core.patching import REGISTRY, Patch
from vllm_overlay.integration import pp_kv

MODULE = "vllm.v1.worker.cpu_worker"
logger = logging.getLogger("vllm.overlay")


def determine_available_memory(self) -> int:
    explicit = self.cache_config.kv_cache_memory_bytes
    if not explicit:
        return REGISTRY.original("PP-05")(self)
    logger.info(
        "vllm-overlay: CPU KV cache budget from "
        "kv_cache_memory_bytes=%d (not VLLM_CPU_KVCACHE_SPACE)",
        explicit,
    )
    self.vllm_overlay_kv_budget = pp_kv.rank_budget(self.vllm_config, explicit)
    return self.vllm_overlay_kv_budget


PATCHES = [
    Patch(
        id="PP-05",
        module=MODULE,
        target="CPUWorker.determine_available_memory",
        new=determine_available_memory,
        feature="pipeline-parallel KV budget",
        why="The CPU platform ignored kv_cache_memory_bytes; the PP split "
        "(and anyone setting the option) needs it respected.",
        upstream="none found for the CPU worker; part of the #25164 port",
        removal="Drop when upstream CPUWorker honours "
        "kv_cache_memory_bytes and PP-01..03 are gone.",
    ),
]
