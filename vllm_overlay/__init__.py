"""vllm-overlay: cross-layer KV blocks and fast KV transfers for vLLM 0.11.2.

``register`` is the ``vllm.general_plugins`` entry point.  vLLM calls it in the
front end, in the EngineCore and in every worker; it may be called more than
once per process and is re-entrant.
"""

from __future__ import annotations

import logging
import threading

from vllm_overlay import envs

__version__ = "0.1.0"
SUPPORTED_VLLM = "0.11.2"

logger = logging.getLogger("vllm.overlay")

_lock = threading.Lock()
_outcome: str | None = None  # why register() did what it did, once decided


class UnsupportedVLLMVersion(RuntimeError):
    pass


def vllm_version() -> str | None:
    try:
        import vllm
    except ImportError:
        return None
    return getattr(vllm, "__version__", None)


def is_supported_version(version: str | None) -> bool:
    """vLLM 0.11.2 exactly; local tags (``+cpu``) and post releases allowed."""
    from packaging.version import InvalidVersion, Version

    if version is None:
        return False
    try:
        parsed = Version(version)
    except InvalidVersion:
        return False
    return parsed.release == (0, 11, 2) and parsed.pre is None and parsed.dev is None


def register() -> str:
    """Apply the overlay once per process; returns what happened (for logs)."""
    global _outcome
    with _lock:
        if _outcome is not None:
            return _outcome
        if envs.DISABLE.flag():
            _outcome = f"disabled by {envs.DISABLE.name}"
            logger.info("vllm-overlay: %s; stock vLLM", _outcome)
            return _outcome
        version = vllm_version()
        if not is_supported_version(version):
            message = (
                f"vllm-overlay {__version__} supports vLLM "
                f"{SUPPORTED_VLLM} only; found vLLM {version}: "
                "nothing patched"
            )
            if envs.STRICT.flag():
                raise UnsupportedVLLMVersion(
                    message + f" ({envs.STRICT.name}=1 makes this an error)"
                )
            logger.warning("%s", message)
            _outcome = f"unsupported vLLM {version}"
            return _outcome
        from vllm_overlay.connectors import register_connectors
        from vllm_overlay.patches import apply_all

        apply_all()
        register_connectors()
        _outcome = "applied"
        logger.info("vllm-overlay %s applied to vLLM %s", __version__, version)
        return _outcome
