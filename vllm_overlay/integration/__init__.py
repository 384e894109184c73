"""Adapters between vLLM 0.11.2 and the core: read vLLM's configs, models and
KV caches, and hand the core plain tensors and numbers.

The connectors (``vllm_overlay.connectors``) and the runtime patches
(``vllm_overlay.patches``) are adapters too; they keep their own top-level
packages because users name them in configs (``kv_connector_module_path``)
and ``PATCHES.md`` / ``patches/`` refer to them.
"""
