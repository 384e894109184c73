"""What a configuration asks of the overlay, and the startup error for
what of it does not run on this vLLM (``engine_refusal``).

``EngineArgs`` or a ``VllmConfig`` (or their dict form) is read for the
overlay's connectors and specs, its pool tier, the PP budget's option and
0.32's cross-layer switch; each family runs on the releases
``version_gate.FEATURE_RELEASES`` names.  Importing this module imports
neither vLLM nor torch.
"""

from __future__ import annotations

from vllm_overlay.version_gate import (
    CONNECTORS,
    CROSS_LAYER_LAYOUTS,
    NO_CPU_BUILD,
    OFFLOADING_SPECS,
    RELEASES,
    UnsupportedVLLMVersion,
    feature_runs_on,
    release_entry,
    unsupported_error,
)


def _ours(module_path) -> bool:
    return isinstance(module_path, str) and (
        module_path == "vllm_overlay" or module_path.startswith("vllm_overlay.")
    )


def _field(config, name: str):
    if isinstance(config, dict):
        return config.get(name)
    return getattr(config, name, None)


def kv_transfer_features(kv_transfer_config) -> list[str]:
    """Overlay connectors and specs named in a ``KVTransferConfig`` (or its
    dict form), MultiConnector's nested connectors included."""
    if kv_transfer_config is None:
        return []
    found = []
    name = _field(kv_transfer_config, "kv_connector")
    path = _field(kv_transfer_config, "kv_connector_module_path")
    extra = _field(kv_transfer_config, "kv_connector_extra_config") or {}
    if name in CONNECTORS:
        found.append(f"kv_connector {name!r}")
    if _ours(path):
        found.append(f"kv_connector_module_path {path!r}")
    if isinstance(extra, dict):
        spec = extra.get("spec_name")
        if spec in OFFLOADING_SPECS:
            found.append(f"kv_connector_extra_config spec_name {spec!r}")
        spec_path = extra.get("spec_module_path")
        if _ours(spec_path):
            found.append(f"kv_connector_extra_config spec_module_path {spec_path!r}")
        for nested in extra.get("connectors") or []:
            found += kv_transfer_features(nested)
    return found


def pool_tier_features(kv_transfer_config) -> list[str]:
    """The overlay's pool tier in an OffloadingConnector's
    ``secondary_tiers`` (MultiConnector's nested connectors included)."""
    if kv_transfer_config is None:
        return []
    extra = _field(kv_transfer_config, "kv_connector_extra_config") or {}
    if not isinstance(extra, dict):
        return []
    found = [
        f"kv_connector_extra_config secondary_tiers module_path {tier['module_path']!r}"
        for tier in extra.get("secondary_tiers") or []
        if isinstance(tier, dict) and _ours(tier.get("module_path"))
    ]
    for nested in extra.get("connectors") or []:
        found += pool_tier_features(nested)
    return found


def layout_features(patch_set: str | None) -> list[str]:
    """``VLLM_KV_CACHE_LAYOUT`` set to 0.32's cross-layer switch on a release
    of the 0.11.2 set (which fails on it only when an attention backend
    reads it, naming NHD and HND)."""
    import os

    value = os.environ.get("VLLM_KV_CACHE_LAYOUT")
    if patch_set == "v0_11_2" and value in CROSS_LAYER_LAYOUTS:
        return [f"VLLM_KV_CACHE_LAYOUT={value}"]
    return []


def pp_features(engine_args) -> list[str]:
    from vllm_overlay.integration import pp_kv

    additional = _field(engine_args, "additional_config")
    if isinstance(additional, dict) and pp_kv.FLAG in additional:
        return [
            f"additional_config[{pp_kv.FLAG!r}] = {additional[pp_kv.FLAG]!r} "
            f"({pp_kv.CLI_FLAG})"
        ]
    return []


def connectors(kv_transfer_config) -> list[tuple[str, dict]]:
    """(kv_connector, its extra config) of a config and its MultiConnector's
    nested connectors."""
    if kv_transfer_config is None:
        return []
    extra = _field(kv_transfer_config, "kv_connector_extra_config") or {}
    extra = extra if isinstance(extra, dict) else {}
    found = [(_field(kv_transfer_config, "kv_connector"), extra)]
    for nested in extra.get("connectors") or []:
        found += connectors(nested)
    return found


def on_cpu_platform() -> bool:
    """Whether vLLM runs on its CPU platform (imports vLLM)."""
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def cpu_platform_features(
    engine_args, version: str | None, on_cpu: bool | None = None
) -> list[str]:
    """On the CPU platform of a release with no CPU build (``NO_CPU_BUILD``:
    a Python-only build run with ``VLLM_TARGET_DEVICE=cpu``), what would
    need the overlay's CPU-platform features: upstream's
    ``OffloadingConnector`` (its CPU worker) and 0.32's cross-layer switch
    (CPU_ATTN's).  ON_CPU: the platform (default: vLLM's)."""
    import os

    if release_entry(version) not in NO_CPU_BUILD:
        return []
    if not (on_cpu_platform() if on_cpu is None else on_cpu):
        return []
    found = [
        f"kv_connector {name!r} on the CPU platform"
        for name, _ in connectors(_field(engine_args, "kv_transfer_config"))
        if name == "OffloadingConnector"
    ]
    layout = os.environ.get("VLLM_KV_CACHE_LAYOUT")
    if layout in CROSS_LAYER_LAYOUTS:
        found.append(f"VLLM_KV_CACHE_LAYOUT={layout} on the CPU platform")
    return found


def engine_features(engine_args) -> list[str]:
    """Overlay features configured in ``EngineArgs`` (or a ``VllmConfig``)."""
    return kv_transfer_features(
        _field(engine_args, "kv_transfer_config")
    ) + pp_features(engine_args)


def engine_refusal(
    engine_args, version: str | None, on_cpu: bool | None = None
) -> UnsupportedVLLMVersion | None:
    """The startup error for the overlay features ``engine_args`` configures
    that do not run on ``version`` (None: none).  ON_CPU: whether vLLM runs
    on its CPU platform (default: asked of vLLM where it matters)."""
    kv_transfer_config = _field(engine_args, "kv_transfer_config")
    groups = {
        "connectors": kv_transfer_features(kv_transfer_config),
        "pp_prop_kv_cache": pp_features(engine_args),
        "pool_tier": pool_tier_features(kv_transfer_config),
        "kv_cache_layout": layout_features(RELEASES.get(release_entry(version))),
        "cpu_platform": cpu_platform_features(engine_args, version, on_cpu),
    }
    refused = [
        (family, found)
        for family, found in groups.items()
        if found and not feature_runs_on(family, version)
    ]
    if not refused:
        return None
    features = [text for _, found in refused for text in found]
    return unsupported_error(features, version, refused[0][0])
