"""What a user turns on, on each supported release, and the way to it.

One table, read by ``doctor`` (the features usable on the installed vLLM,
one line each) and by the startup refusals (``version_gate``): an overlay
connector, spec or flag configured on a release where it does not run
names what does the same job there, when something does.  Imports neither
vLLM nor torch.
"""

from __future__ import annotations

import dataclasses
import json

HOST_BYTES = 8589934592  # 8 GiB: the examples' host memory for offloaded KV
POOL_URL = "redis://pool-host:6379/0"
POOL_TIER_MODULE = "vllm_overlay.integration.v0_32.pool_tier"
POOL_TIER_CLASS = "SharedPoolTier"


def kv_transfer_config(connector: str, **extra) -> str:
    """``--kv-transfer-config '...'`` for CONNECTOR with EXTRA as its
    ``kv_connector_extra_config``."""
    config = {"kv_connector": connector, "kv_role": "kv_both"}
    if extra:
        config["kv_connector_extra_config"] = extra
    return f"--kv-transfer-config '{json.dumps(config)}'"


# vLLM 0.32: upstream's OffloadingConnector (host memory), and with it the
# overlay's pool as a secondary tier of upstream's TieringOffloadingSpec.
HOST_OFFLOAD_032 = kv_transfer_config(
    "OffloadingConnector", cpu_bytes_to_use=HOST_BYTES
)
POOL_TIER_032 = kv_transfer_config(
    "OffloadingConnector",
    cpu_bytes_to_use=HOST_BYTES,
    spec_name="TieringOffloadingSpec",
    secondary_tiers=[
        {"type": POOL_TIER_CLASS, "module_path": POOL_TIER_MODULE, "url": POOL_URL}
    ],
)
# vLLM 0.11.2: the overlay's own connectors.
HOST_OFFLOAD_0112 = kv_transfer_config(
    "OverlayOffloadingConnector", cpu_bytes=HOST_BYTES
)
POOL_0112 = kv_transfer_config("SharedKVPoolConnector", url=POOL_URL)
PROBE_0112 = kv_transfer_config("CrossLayerProbeConnector")
PP_BUDGET = (
    "--pipeline-parallel-size 2 --enable-pp-prop-kv-cache --kv-cache-memory-bytes 8G"
)


@dataclasses.dataclass(frozen=True)
class Feature:
    name: str
    how: str  # the command-line words (or the condition) that turn it on


# Per patch set (version_gate.RELEASES' values): what the overlay gives there.
FEATURES: dict[str, tuple[Feature, ...]] = {
    "v0_11_2": (
        Feature("host offloading", HOST_OFFLOAD_0112),
        Feature("shared KV pool", POOL_0112),
        Feature(
            "cross-layer KV blocks",
            "a connector that asks for them (the two above; the layout "
            f"probe: {PROBE_0112})",
        ),
        Feature("PP KV budget", PP_BUDGET),
        Feature(
            "async loads, KV pressure",
            "on with the overlay's connectors (KV-01..04)",
        ),
    ),
    "v0_32": (
        Feature("host offloading", HOST_OFFLOAD_032),
        Feature("shared KV pool", POOL_TIER_032),
        Feature(
            "cross-layer on CPU_ATTN",
            "VLLM_KV_CACHE_LAYOUT=BLHNC vllm serve ... (or a connector that "
            "asks for them)",
        ),
        Feature("PP KV budget", PP_BUDGET),
        Feature(
            "MLA on CPU",
            "on by itself for an MLA model (MLA32-01)",
        ),
    ),
    "v0_33": (
        Feature("shared KV pool", POOL_TIER_032),
        Feature("PP KV budget", PP_BUDGET),
    ),
}

# Per patch set: what the table above leaves out, and how far what it has
# was checked (doctor prints these under the table; the README says the same).
NOTES: dict[str, tuple[str, ...]] = {
    "v0_33": (
        "the pool tier and the PP KV budget were checked against vLLM 0.33's "
        "own scheduler-side code (a Python-only build of its sdist: the "
        "tiering manager, get_kv_cache_configs, EngineArgs), never run in a "
        "0.33 GPU engine",
        "host offloading, cross-layer on CPU_ATTN, MLA on CPU: refused, no CPU "
        "build of vLLM 0.33 exists (they run on 0.32.x)",
    ),
}

_UPSTREAM_PP = (
    "upstream's own stage sizing (every stage gets the smallest stage's "
    "block count, no flag): drop the flag"
)
# What was configured (a name in the refusal's text) -> on a release of
# this patch set, what does its job (None: nothing does).
_INSTEAD: dict[str, dict[str, str]] = {
    "v0_32": {
        "OverlayOffloadingConnector": (
            f"upstream's OffloadingConnector with cpu_bytes_to_use: {HOST_OFFLOAD_032}"
        ),
        "OverlayCPUOffloadingSpec": (
            "upstream's OffloadingConnector with its default spec and "
            f"cpu_bytes_to_use: {HOST_OFFLOAD_032}"
        ),
        "SharedKVPoolConnector": (
            "the pool tier: upstream's OffloadingConnector with spec_name "
            f"TieringOffloadingSpec and secondary_tiers [{POOL_TIER_CLASS}]: "
            f"{POOL_TIER_032}"
        ),
        "CrossLayerProbeConnector": (
            "upstream's cross-layer blocks (OffloadingConnector asks for "
            "them; on CPU_ATTN set VLLM_KV_CACHE_LAYOUT=BLHNC)"
        ),
        "vllm_overlay.connectors": (
            "upstream's OffloadingConnector for host memory "
            f"({HOST_OFFLOAD_032}), with the pool tier for a shared pool"
        ),
    },
    "v0_11_2": {
        "VLLM_KV_CACHE_LAYOUT": (
            "cross-layer blocks through a connector that asks for them "
            f"(VLLM_KV_CACHE_LAYOUT unset), e.g. {HOST_OFFLOAD_0112}"
        ),
        POOL_TIER_MODULE: (
            "the overlay's SharedKVPoolConnector (host memory in front: a "
            f"MultiConnector with OverlayOffloadingConnector first): {POOL_0112}"
        ),
    },
    # A release newer than every supported one (e.g. 0.34): upstream's.
    "newer": {
        "OverlayOffloadingConnector": (
            "upstream's OffloadingConnector with cpu_bytes_to_use (CUDA, ROCm "
            f"and XPU only): {HOST_OFFLOAD_032}"
        ),
        "OverlayCPUOffloadingSpec": (
            "upstream's OffloadingConnector with cpu_bytes_to_use (CUDA, ROCm "
            f"and XPU only): {HOST_OFFLOAD_032}"
        ),
        "CrossLayerProbeConnector": (
            "upstream's cross-layer blocks (OffloadingConnector asks for them)"
        ),
        "enable-pp-prop-kv-cache": _UPSTREAM_PP,
        "enable_pp_prop_kv_cache": _UPSTREAM_PP,
    },
}


# vLLM 0.33: upstream's host offloading (GPU), with the pool tier for a
# shared pool; the PP flag runs there.
_INSTEAD["v0_33"] = {
    **{
        k: v
        for k, v in _INSTEAD["newer"].items()
        if "pp-prop" not in k.replace("_", "-")
    },
    "SharedKVPoolConnector": _INSTEAD["v0_32"]["SharedKVPoolConnector"],
    "vllm_overlay.connectors": _INSTEAD["v0_32"]["vllm_overlay.connectors"],
}


def instead(configured: list[str], patch_set: str | None) -> list[str]:
    """For each refused item of CONFIGURED (the refusal's texts, which
    quote what was configured), the way to its job on a release of
    PATCH_SET ("newer": a release newer than every supported one); each
    way once, in the order found."""
    table = _INSTEAD.get(patch_set or "", {})
    found: list[str] = []
    for text in configured:
        for name, way in table.items():
            if name in text and way not in found:
                found.append(way)
                break
    return found
