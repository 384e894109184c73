"""Which vLLM releases the overlay supports, and the error on the others.

``SUPPORTED_RELEASES`` is the one list of them: every message, the gate in
``register()``, the connectors' import check and ``doctor`` read it.  An
entry is a release as users write it: ``"0.11.2"`` is that release exactly
(local tags such as ``+cpu`` and post releases included, pre and dev
releases not); ``"0.32.x"`` would be every 0.32 release.

Importing this module imports neither vLLM nor torch.
"""

from __future__ import annotations

SUPPORTED_RELEASES: tuple[str, ...] = ("0.11.2",)

# What a user can configure that only the overlay provides: the names vLLM's
# factories resolve (and the PP KV budget's option, integration/pp_kv).
CONNECTORS = {
    # name in kv_transfer_config -> (module, class)
    "CrossLayerProbeConnector": (
        "vllm_overlay.connectors.probe",
        "CrossLayerProbeConnector",
    ),
    "OverlayOffloadingConnector": (
        "vllm_overlay.connectors.offloading",
        "OverlayOffloadingConnector",
    ),
    "SharedKVPoolConnector": (
        "vllm_overlay.connectors.shared_pool",
        "SharedKVPoolConnector",
    ),
}
OFFLOADING_SPECS = {
    # spec_name for stock OffloadingConnector -> (module, class)
    "OverlayCPUOffloadingSpec": (
        "vllm_overlay.connectors.offloading",
        "OverlayCPUOffloadingSpec",
    ),
}


class UnsupportedVLLMVersion(RuntimeError):
    pass


def _parse(entry: str) -> tuple[tuple[int, ...], bool]:
    """``"0.11.2"`` -> ((0, 11, 2), exact); ``"0.32.x"`` -> ((0, 32), prefix)."""
    prefix = entry.endswith(".x")
    parts = entry[:-2] if prefix else entry
    return tuple(int(part) for part in parts.split(".")), prefix


def is_supported_version(version: str | None) -> bool:
    from packaging.version import InvalidVersion, Version

    if version is None:
        return False
    try:
        parsed = Version(version)
    except InvalidVersion:
        return False
    if parsed.pre is not None or parsed.dev is not None:
        return False
    for entry in SUPPORTED_RELEASES:
        release, prefix = _parse(entry)
        if prefix and parsed.release[: len(release)] == release:
            return True
        if not prefix and parsed.release == release:
            return True
    return False


def supported_text() -> str:
    """``0.11.2``; ``0.11.2 or 0.32.x`` once there are two."""
    if len(SUPPORTED_RELEASES) == 1:
        return SUPPORTED_RELEASES[0]
    return ", ".join(SUPPORTED_RELEASES[:-1]) + " or " + SUPPORTED_RELEASES[-1]


def installed_vllm_version() -> str | None:
    """``vllm.__version__`` (what the running vLLM says), None without vLLM."""
    try:
        import vllm
    except ImportError:
        return None
    return getattr(vllm, "__version__", None)


def unsupported_message(version: str | None) -> str:
    from vllm_overlay import __version__

    return (
        f"vllm-overlay {__version__} supports vLLM {supported_text()} only; "
        f"found vLLM {version}"
    )


def unsupported_error(
    features: list[str], version: str | None
) -> UnsupportedVLLMVersion:
    """The startup error for overlay features configured on this vLLM."""
    them = "it" if len(features) == 1 else "them"
    return UnsupportedVLLMVersion(
        f"{unsupported_message(version)}. This configuration uses the overlay, "
        f"which does not run on it: {', '.join(features)}. Install vLLM "
        f"{supported_text()}, or remove {them} to run stock vLLM."
    )


def require_supported(*features: str) -> None:
    """Raise the startup error if the running vLLM is not supported."""
    version = installed_vllm_version()
    if not is_supported_version(version):
        raise unsupported_error(list(features), version)


def env_features() -> list[str]:
    """The overlay's environment switches set to something only the overlay
    can do (``VLLM_OVERLAY_DISABLE=1`` asks for stock vLLM: not one)."""
    from vllm_overlay import envs

    found = []
    if envs.STRICT.flag():
        found.append(f"{envs.STRICT.name}={envs.STRICT.raw()}")
    if envs.SKIP_PATCHES.items():
        found.append(f"{envs.SKIP_PATCHES.name}={envs.SKIP_PATCHES.raw()}")
    return found


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


def engine_features(engine_args) -> list[str]:
    """Overlay features configured in ``EngineArgs`` (or a ``VllmConfig``)."""
    from vllm_overlay.integration import pp_kv

    found = kv_transfer_features(_field(engine_args, "kv_transfer_config"))
    additional = _field(engine_args, "additional_config")
    if isinstance(additional, dict) and pp_kv.FLAG in additional:
        found.append(
            f"additional_config[{pp_kv.FLAG!r}] = {additional[pp_kv.FLAG]!r} "
            f"({pp_kv.CLI_FLAG})"
        )
    return found
