"""The runtime patches: one set per supported vLLM release.

Each set is a package (``v0_11_2``, ``v0_32``) of ``patch_<module>.py``
files, one per upstream module, and a manifest (``MODULES``, in the order
the patches are applied).  ``version_gate.RELEASES`` says which set runs on
which vLLM; ``PATCHES.md`` is generated from all of them
(``python -m vllm_overlay catalogue``).
"""

from __future__ import annotations

import importlib
from types import ModuleType

from vllm_overlay import envs
from vllm_overlay.core.patching import REGISTRY, Patch, unit_skips
from vllm_overlay.version_gate import (
    REFUSED_HERE,
    RELEASES,
    installed_vllm_version,
    release_entry,
)


def patch_set(entry: str | None = None) -> ModuleType:
    """The patch package of a supported release (``"0.11.2"``, ``"0.32.x"``;
    default: the running vLLM's)."""
    if entry is None:
        entry = release_entry(installed_vllm_version())
        if entry is None:
            raise RuntimeError(f"vLLM {installed_vllm_version()} has no patch set")
    return importlib.import_module(f"{__name__}.{RELEASES[entry]}")


def modules(entry: str | None = None) -> tuple[ModuleType, ...]:
    return patch_set(entry).MODULES


def all_patches(entry: str | None = None) -> list[Patch]:
    return [patch for module in modules(entry) for patch in module.PATCHES]


def apply_all(entry: str | None = None) -> None:
    """Register every patch of the set (applied when its module is
    imported)."""
    patches = all_patches(entry)
    error = envs.skip_patches_error(
        entry or release_entry(installed_vllm_version()), [p.id for p in patches]
    )
    if error:
        from vllm_overlay.startup_errors import install_hook

        install_hook()  # uncaught: printed as its one line
        raise envs.BadSetting(error)
    # A patch of a unit (Patch.unit) skipped: its whole unit is.
    skipped = unit_skips(
        patches, envs.SKIP_PATCHES.items(), f"skipped by {envs.SKIP_PATCHES.name}"
    )
    refused = refused_patches(entry)
    for patch in patches:
        REGISTRY.add(patch, skip_reason=refused.get(patch.id, skipped.get(patch.id)))


def refused_patches(entry: str | None = None) -> dict[str, str]:
    """Patch id -> why it is not applied: the patches of the features the
    per-feature gate refused on the installed vLLM (a set's ``FEATURES``:
    feature -> its patch modules; ``version_gate.REFUSED_HERE``)."""
    version = installed_vllm_version()
    out = {}
    for feature, patch_modules in getattr(patch_set(entry), "FEATURES", {}).items():
        refused = REFUSED_HERE.get(feature)
        if refused is None or refused[0] != version:
            continue
        for module in patch_modules:
            # A module serving several features names each one's patches.
            owned = getattr(module, "FEATURE_PATCHES", {}).get(feature)
            for patch in module.PATCHES:
                if owned is None or patch.id in owned:
                    out[patch.id] = f"refused: {feature}'s upstream files differ"
    return out
