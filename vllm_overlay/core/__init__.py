"""The vLLM-free core: KV layout description, block copies, the offload
mover, the shared-pool client, the PP budget arithmetic, the engine's idle
wait and the patch helper.

Nothing under this package imports vLLM (``tests/unit/test_core_boundary.py``
imports every module here with ``import vllm`` blocked); the adapters that
talk to vLLM live in ``vllm_overlay.integration``, ``vllm_overlay.connectors``
and ``vllm_overlay.patches``.
"""
