"""vllm-overlay: cross-layer KV blocks and fast KV transfers for vLLM 0.11.2,
and on vLLM 0.32 what upstream still lacks.

``register`` is the ``vllm.general_plugins`` entry point.  vLLM calls it in the
front end, in the EngineCore and in every worker; it may be called more than
once per process and is re-entrant.
"""

from __future__ import annotations

import logging
import threading

from vllm_overlay import envs
from vllm_overlay.envs import env_features  # noqa: F401  (re-exported)
from vllm_overlay.version_gate import (  # noqa: F401  (re-exported)
    REFUSED_HERE,
    RELEASES,
    SUPPORTED_RELEASES,
    UnsupportedVLLMVersion,
    feature_runs_on,
    installed_vllm_version,
    is_supported_version,
    release_entry,
    supported_text,
    unsupported_error,
    unsupported_message,
)

__version__ = "0.1.0"
SUPPORTED_VLLM = supported_text()  # the list: version_gate.SUPPORTED_RELEASES

logger = logging.getLogger("vllm.overlay")

_lock = threading.Lock()
_outcome: str | None = None  # why register() did what it did, once decided


def vllm_version() -> str | None:
    return installed_vllm_version()


def register() -> str:
    """Apply the overlay once per process; returns what happened (for logs).

    On a vLLM it does not support, nothing is patched and stock vLLM runs,
    but configuring an overlay feature (a connector, the PP flag, an
    overlay environment switch) is a startup error naming the supported
    versions (``vllm_overlay.unsupported``).
    """
    global _outcome
    with _lock:
        if _outcome is not None:
            return _status(_outcome)
        if envs.DISABLE.flag():
            _outcome = f"disabled by {envs.DISABLE.name}"
            logger.info("vllm-overlay: %s; stock vLLM", _outcome)
            return _outcome
        version = vllm_version()
        entry = release_entry(version)
        if entry is None:
            refused = env_features()
            if refused:
                raise unsupported_error(refused, version)
            from vllm_overlay import unsupported

            unsupported.install()
            logger.warning(
                "%s: nothing patched, stock vLLM (an overlay connector or "
                "option configured is an error)",
                unsupported_message(version),
            )
            _outcome = f"unsupported vLLM {version}"
            return _outcome
        from vllm_overlay import patch_features
        from vllm_overlay.patches import apply_all
        from vllm_overlay.version_gate import check_installed_release

        form = check_installed_release(entry, version)
        for feature, (where, text) in REFUSED_HERE.items():
            if where == version:
                logger.warning("vllm-overlay: %s refused: %s", feature, text)
        apply_all(entry)
        patch_features.install()
        if feature_runs_on("connectors", version):
            from vllm_overlay.connectors import register_connectors

            register_connectors()
        else:  # what runs on other releases only is refused at startup
            from vllm_overlay import unsupported

            unsupported.install()
        _outcome = "applied"
        logger.info(
            "vllm-overlay %s applied to vLLM %s (patch set %s)",
            __version__,
            version,
            RELEASES[entry],
        )
        if form:
            logger.info("vllm-overlay: upstream files as tested: %s", form)
        return _status(_outcome)


def _status(outcome: str) -> str:
    """``"applied"``, or which patches did not apply (their target was gone
    when their module loaded: patches wait for it, so a later call may say
    more), each with the feature that is refused at startup for it."""
    if outcome != "applied":
        return outcome
    from vllm_overlay.core.patching import REGISTRY

    failed = [
        f"{s.patch.id} ({s.patch.feature}: {s.detail})" for s in REGISTRY.failed()
    ]
    return f"applied; not applied: {'; '.join(failed)}" if failed else outcome
