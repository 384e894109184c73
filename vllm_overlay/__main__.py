"""``python -m vllm_overlay {doctor,catalogue,demo}`` (also ``vllm-overlay``)."""

from __future__ import annotations

import argparse
import sys


def doctor() -> int:
    """Report the vLLM version, the platform and every patch's state."""
    import vllm_overlay
    from vllm_overlay.patches import all_patches
    from vllm_overlay.core.patching import REGISTRY, import_target

    version = vllm_overlay.vllm_version()
    print(f"vllm-overlay {vllm_overlay.__version__}")
    print(f"vLLM         {version or 'not installed'} "
          f"({'supported' if vllm_overlay.is_supported_version(version) else 'unsupported'}; "
          f"overlay targets {vllm_overlay.SUPPORTED_VLLM})")
    if version is None:
        return 1
    from vllm.platforms import current_platform

    print(f"platform     {type(current_platform).__name__} "
          f"(device {current_platform.device_type or 'none'})")
    outcome = vllm_overlay.register()
    print(f"register()   {outcome}")
    import_errors = {}
    if outcome == "applied":
        for module in sorted({p.module for p in all_patches()}):
            error = import_target(module)
            if error is not None:
                import_errors[module] = error
    print("\npatches:")
    states = {s.patch.id: s for s in REGISTRY.states()}
    for patch in all_patches():
        state = states.get(patch.id)
        if state is None:
            status, detail = "skipped", outcome
        elif state.status == "pending" and patch.module in import_errors:
            status = "skipped"
            detail = f"module not importable here ({import_errors[patch.module]})"
        else:
            status, detail = state.status, state.detail
        print(f"  {patch.id:6} {status:8} {patch.symbol}\n"
              f"  {'':6} {'':8} {detail}")
    failed = [s for s in REGISTRY.states() if s.status == "failed"]
    return 1 if failed else 0


def catalogue() -> int:
    from vllm_overlay.catalogue import render_markdown

    sys.stdout.write(render_markdown())
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="vllm-overlay")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("doctor", help="vLLM version, platform, patch states")
    sub.add_parser("catalogue", help="print the patch catalogue (Markdown)")
    demo = sub.add_parser("demo", help="run vLLM with the overlay on the "
                          "built-in tiny model")
    demo.add_argument("--dtype", default="float32",
                      choices=["float32", "bfloat16"])
    demo.add_argument("--max-tokens", type=int, default=24)
    args = parser.parse_args(argv)
    if args.command == "doctor":
        return doctor()
    if args.command == "catalogue":
        return catalogue()
    from vllm_overlay.demo import run_demo

    return run_demo(dtype=args.dtype, max_tokens=args.max_tokens)


if __name__ == "__main__":
    sys.exit(main())
