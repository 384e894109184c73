"""A patch that did not apply is a startup error for the feature that needs it.

Every ``Patch`` names its feature (``Patch.feature``).  ``FEATURE_NEEDS``
says, for each feature, what in a configuration uses it (``[]``: nothing).
``install()`` wraps ``EngineArgs.create_engine_config`` (the front end:
``LLM``, ``vllm serve``): once the config is built, the target modules of
the patches of the features it uses are imported (applying patches that
were waiting for them), and if one of those patches failed (its target is
gone: ``core.patching``), the config is refused with one line naming the
patch, the feature and what configured it.  A feature with no entry in
``FEATURE_NEEDS`` counts as always used, so a new feature is never
unguarded (``tests/unit/test_patch_features.py`` asks for an entry).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

from vllm_overlay.configured import (
    _field,
    _ours,
    connectors,
    engine_refusal,
    on_cpu_platform,
    pp_features,
)
from vllm_overlay.core.patching import (
    REGISTRY,
    PatchState,
    import_target,
    when_imported,
)
from vllm_overlay.version_gate import (
    CONNECTORS,
    OFFLOADING_SPECS,
    installed_vllm_version,
    supported_text,
)

logger = logging.getLogger("vllm.overlay")

_GUARD = "_vllm_overlay_patch_guard"


class PatchNotApplied(RuntimeError):
    one_line_startup_error = True  # startup_errors: printed as its line


def _offloading_on_cpu(config) -> list[str]:
    found = connectors(_field(config, "kv_transfer_config"))
    if any(name == "OffloadingConnector" for name, _ in found) and on_cpu_platform():
        return ["kv_connector 'OffloadingConnector' on the CPU platform"]
    return []


def _pool_tier(config) -> list[str]:
    return [
        f"secondary tier {tier.get('module_path')!r}"
        for name, extra in connectors(_field(config, "kv_transfer_config"))
        if name == "OffloadingConnector"
        for tier in extra.get("secondary_tiers") or []
        if isinstance(tier, dict) and _ours(tier.get("module_path"))
    ]


def _overlayconnectors(config) -> list[str]:
    found = []
    for name, extra in connectors(_field(config, "kv_transfer_config")):
        if name in CONNECTORS:
            found.append(f"kv_connector {name!r}")
        if extra.get("spec_name") in OFFLOADING_SPECS:
            found.append(f"spec_name {extra['spec_name']!r}")
    return found


def _async_loaders(config) -> list[str]:
    return [
        text for text in _overlayconnectors(config) if "CrossLayerProbe" not in text
    ]


def _mla_on_cpu(config) -> list[str]:
    model = _field(config, "model_config")
    if model is not None and getattr(model, "use_mla", False) and on_cpu_platform():
        return [f"the MLA model {model.model!r} on the CPU platform"]
    return []


# Patch.feature -> what in a config (VllmConfig) uses it
FEATURE_NEEDS: dict[str, Callable[[Any], list[str]]] = {
    # 0.11.2: the overlay's connectors; 0.32: upstream's on the CPU platform
    "cross-layer KV blocks": lambda c: _overlayconnectors(c) + _offloading_on_cpu(c),
    "pipeline-parallel KV budget": pp_features,
    "async KV loads under KV pressure": _async_loaders,
    "async KV loads (shared pool, offloading)": _async_loaders,
    "host offloading on the CPU platform": _offloading_on_cpu,
    "shared KV pool tier": _pool_tier,
    "async KV loads (CPU offloading, the pool tier)": _offloading_on_cpu,
    "DeepSeek MLA on the CPU platform": _mla_on_cpu,
}


def uses(feature: str, config) -> list[str]:
    """What in CONFIG uses FEATURE (an unknown feature: always used)."""
    needs = FEATURE_NEEDS.get(feature)
    if needs is None:
        return ["any configuration (a feature with no entry in FEATURE_NEEDS)"]
    return needs(config)


def refusal(config) -> PatchNotApplied | None:
    """The startup error for the first feature CONFIG uses whose patch did
    not apply (None: none).  Imports the target modules of the patches of
    the features it uses, so a waiting patch is applied and judged now."""
    used: dict[str, list[str]] = {}
    states: list[PatchState] = REGISTRY.states()
    for state in states:
        feature = state.patch.feature
        if feature not in used:
            used[feature] = uses(feature, config)
        if used[feature] and state.status == "pending":
            import_target(state.patch.module)
    for state in states:
        what = used[state.patch.feature]
        unit = REGISTRY.unit(state.patch.id)
        if what and state.status == "skipped" and unit:
            return PatchNotApplied(
                f"vllm-overlay: {state.patch.feature} ({', '.join(what)}) needs "
                f"patches {', '.join(unit)}, which work only together; "
                f"{state.patch.id} is {state.detail}. Apply them all (leave them "
                f"out of VLLM_OVERLAY_SKIP_PATCHES), or remove {', '.join(what)}."
            )
        if what and state.status == "failed":
            patch = state.patch
            return PatchNotApplied(
                f"vllm-overlay: {patch.feature} ({', '.join(what)}) needs patch "
                f"{patch.id} ({patch.symbol}), which did not apply on vLLM "
                f"{installed_vllm_version()}: {state.detail}. Install vLLM "
                f"{supported_text()} as tested, or remove {', '.join(what)}."
            )
    return None


def _guard(arg_utils) -> None:
    engine_args = arg_utils.EngineArgs
    original = engine_args.create_engine_config
    if getattr(original, _GUARD, False):
        return

    def create_engine_config(self, *args, **kwargs):
        # What runs on another supported release only (e.g. the pool tier
        # on 0.11.2), before vLLM builds anything from it.
        error = engine_refusal(self, installed_vllm_version())
        if error is not None:
            raise error
        config = original(self, *args, **kwargs)
        error = refusal(config)
        if error is not None:
            raise error
        return config

    functools.update_wrapper(create_engine_config, original, updated=())
    setattr(create_engine_config, _GUARD, True)
    engine_args.create_engine_config = create_engine_config


def install() -> None:
    """Refuse, in the front end, a configuration whose feature's patch did
    not apply (when ``vllm.engine.arg_utils`` is imported, after the patch
    set's own changes to it), or that uses what runs on another supported
    release only; an uncaught refusal prints as its one line."""
    from vllm_overlay.startup_errors import install_hook

    install_hook()
    when_imported("vllm.engine.arg_utils", _guard)
