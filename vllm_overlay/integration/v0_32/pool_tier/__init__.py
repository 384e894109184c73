"""The shared Redis/Valkey pool as a secondary tier of vLLM 0.32's tiered
offloading (``TieringOffloadingSpec``), loaded by upstream through
``module_path``: ``{"type": "SharedPoolTier", "module_path":
"vllm_overlay.integration.v0_32.pool_tier", "url": ...}``.

Python runs this file first, so importing the tier on a vLLM it does not
run on is the startup error naming the versions it runs on."""

from __future__ import annotations

from vllm_overlay.version_gate import (
    feature_runs_on,
    installed_vllm_version,
    unsupported_error,
)

_version = installed_vllm_version()
if _version is not None and not feature_runs_on("pool_tier", _version):
    raise unsupported_error(
        [f"the KV pool tier (module {__name__})"], _version, "pool_tier"
    )

from vllm_overlay.integration.v0_32.pool_tier.tier import (  # noqa: E402
    SharedPoolTier,
)

__all__ = ["SharedPoolTier"]
