"""``doctor``'s checks of the installation, each one line; none imports
vLLM (the pool check imports redis-py, and only with ``--pool``)."""

from __future__ import annotations

import os
import time
from importlib import metadata

DIST = "vllm-overlay"
POOL_EXTRA = "pool"


def distribution_version(*names: str) -> tuple[str, str] | None:
    """(distribution, version) of the first installed name, no imports."""
    for name in names:
        try:
            return name, metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def plugin_line() -> str:
    """Is the ``vllm.general_plugins`` entry point installed and allowed?"""
    points = [
        p
        for p in metadata.entry_points(group="vllm.general_plugins")
        if p.value.startswith("vllm_overlay")
    ]
    if not points:
        return (
            "not registered (no vllm.general_plugins entry point: "
            "pip install the overlay)"
        )
    line = f"entry point {points[0].name} = {points[0].value}"
    allowed = os.environ.get("VLLM_PLUGINS")
    if allowed is not None and points[0].name not in [
        name.strip() for name in allowed.split(",")
    ]:
        return line + f" (NOT loaded: VLLM_PLUGINS={allowed!r} leaves it out)"
    return line + " (vLLM loads it in every process)"


def expected_outcome(version: str | None) -> str:
    """What ``register()`` will decide in a vLLM process (no vLLM import)."""
    import vllm_overlay
    from vllm_overlay import envs

    if envs.DISABLE.flag():
        return f"disabled by {envs.DISABLE.name}"
    if not vllm_overlay.is_supported_version(version):
        refused = envs.env_features()
        error = f"; an error: {', '.join(refused)}" if refused else ""
        return f"unsupported vLLM {version}{error}"
    from vllm_overlay.version_gate import (
        REFUSED_HERE,
        UnsupportedVLLMVersion,
        check_installed_release,
        release_entry,
    )

    try:
        check_installed_release(release_entry(version), version)
    except UnsupportedVLLMVersion as exc:
        return f"an error: {exc}"
    refused = [name for name, (where, _) in REFUSED_HERE.items() if where == version]
    if refused:  # the per-feature gate (a set whose record groups by feature)
        return (
            f"applied; refused here: {', '.join(refused)} (their upstream "
            "files differ from the tested ones; --deep names them)"
        )
    return "applied"


def install_problems() -> list[str]:
    """What in this installation stops ``vllm serve`` (vLLM's CPU wheels'
    metadata, CUDA-built add-ons beside a CPU torch), each with its fix;
    ``dist_repair`` finds them."""
    try:
        from vllm_overlay import dist_repair
    except ImportError:
        return []
    found = []
    for check in ("problem", "cuda_addons_problem"):
        fn = getattr(dist_repair, check, None)
        line = fn() if fn is not None else None
        if line:
            found.append(line)
    return found


def pool_requirements() -> list:
    """The ``[pool]`` extra's requirements, from the overlay's own
    distribution metadata (setup.py's ``extras_require``)."""
    from packaging.requirements import Requirement

    try:
        requires = metadata.requires(DIST) or []
    except metadata.PackageNotFoundError:
        return []
    found = []
    for text in requires:
        requirement = Requirement(text)
        marker = requirement.marker
        # Only in the extra: true with extra "pool", false without one.
        if (
            marker is not None
            and marker.evaluate({"extra": POOL_EXTRA})
            and not marker.evaluate({"extra": ""})
        ):
            found.append(requirement)
    return found


def pool_dependencies_line() -> tuple[bool, str]:
    """(all installed, the line): each requirement of ``[pool]`` with the
    version installed, or what is missing and the command that adds it."""
    requirements = pool_requirements()
    if not requirements:
        return False, f"unknown: no metadata of {DIST} (pip install the overlay)"
    have, missing = [], []
    for req in requirements:
        found = distribution_version(req.name)
        if found is None:
            missing.append(str(req))
        elif found[1] not in req.specifier and req.specifier:
            missing.append(f"{req} (found {found[1]})")
        else:
            have.append(f"{req.name} {found[1]}")
    if missing:
        return False, (
            f"missing: {', '.join(missing)} (pip install '{DIST}[{POOL_EXTRA}]')"
        )
    return True, f"installed ({', '.join(have)})"


def server_kind(info: dict) -> str:
    """``Valkey 9.1.2`` or ``Redis 7.0.15`` from ``INFO server``."""
    if info.get("server_name") == "valkey" or "valkey_version" in info:
        return f"Valkey {info.get('valkey_version', info.get('redis_version'))}"
    return f"Redis {info.get('redis_version', '?')}"


def pool_server_line(url: str, deadline_s: float = 2.0) -> tuple[bool, str]:
    """(answered, the line) for the pool server at URL, asked once through
    the overlay's own client (``core.pool.transport.make_client``): connect
    and reply each within DEADLINE_S."""
    from vllm_overlay.core.pool.config import PoolConfig

    try:
        config = PoolConfig.from_dict(
            {"url": url, "connect_timeout_s": deadline_s, "timeout_s": deadline_s}
        )
    except (TypeError, ValueError) as exc:
        return False, f"{url}: not a pool URL ({exc})"
    where = config.redacted_url
    try:
        import redis  # noqa: F401  (imported before the clock starts)

        from vllm_overlay.core.pool.transport import make_client

        start = time.monotonic()
        client = make_client(config, single_node=True)
        try:
            info = client.info("server")
        finally:
            client.close()
        took = time.monotonic() - start
    except ImportError as exc:
        return False, (
            f"{where}: not asked: {exc.name} is not installed "
            f"(pip install '{DIST}[{POOL_EXTRA}]')"
        )
    except Exception as exc:  # noqa: BLE001 - any failure is the answer
        detail = config.redact(f"{type(exc).__name__}: {exc}")
        return False, f"{where}: no answer within {deadline_s:g} s ({detail})"
    mode = info.get("redis_mode", "standalone")
    return True, (
        f"{where}: answers ({took * 1000:.0f} ms to connect and reply): "
        f"{server_kind(info)}, {mode}"
    )
