"""Engine-building helpers for the tests, benchmarks and eval suites.

Not the overlay itself and not the demo: what every harness that starts a
vLLM engine on the CPU build needs (environment defaults, the model paths,
the tiny Llama's engine arguments, a quiet start-up, a throwaway
redis-server) in ``common`` and ``redis``, and what differs by release in
``v0_11_2`` (the overlay's connectors) and ``v0_32`` (upstream's
``OffloadingConnector``, the layout switch).  Shipped with the package, so
an installed overlay finds its tiny Llama too.

Nothing here imports vLLM at import time.
"""

from vllm_overlay.testing.common import (
    copy_model_path,
    cpu_defaults,
    in_process_engine,
    quiet,
    tiny_deepseek_path,
    tiny_engine_args,
    tiny_mla_engine_args,
    tiny_model_path,
)

__all__ = [
    "copy_model_path",
    "cpu_defaults",
    "in_process_engine",
    "quiet",
    "tiny_deepseek_path",
    "tiny_engine_args",
    "tiny_mla_engine_args",
    "tiny_model_path",
]
