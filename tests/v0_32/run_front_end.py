"""vLLM 0.32's front end with the overlay, as ``vllm serve`` runs it:
plugins loaded, the command line parsed (``EngineArgs.add_cli_args``,
``from_cli_args``), then ``create_engine_config``; prints JSON.

    python run_front_end.py '{"cases": {"NAME": {"argv": [...], "env": {...}}},
                              "cli": [...]}'

Each case gets the tiny Llama as ``--model``; ``env`` is set for that case
only (``null`` removes a variable).  Its outcome: the error (type, message,
and what the process's ``sys.excepthook`` prints for it, as when it reaches
the top of ``vllm serve``) or the engine config's KV budget and the PP
flag's per-stage blocks, the seconds it took, and the processes it left
(none: no engine started).  ``vllm_version`` is the running vLLM's;
``cli`` (optional) runs vLLM's own ``vllm serve`` entry point in this
process with those arguments after the model (``cli_serve``).
"""

from __future__ import annotations

import contextlib
import io
import json
import multiprocessing
import os
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "e2e"))

from vllm_overlay.testing import cpu_defaults, tiny_model_path  # noqa: E402


def configured(config) -> dict:
    from vllm_overlay.integration import pp_kv

    out = {"kv_cache_memory_bytes": config.cache_config.kv_cache_memory_bytes}
    if pp_kv.enabled(config):
        out["stage_blocks"] = [b.blocks for b in pp_kv.stage_budgets(config)]
    return out


def one_case(argv: list[str], env: dict) -> dict:
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    saved = {name: os.environ.get(name) for name in env}
    for name, value in env.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    start = time.monotonic()
    try:
        parser = EngineArgs.add_cli_args(FlexibleArgumentParser(exit_on_error=False))
        args = parser.parse_args(["--model", tiny_model_path(), *argv])
        config = EngineArgs.from_cli_args(args).create_engine_config()
        out = {"error": None, "value": configured(config)}
    except Exception as exc:  # noqa: BLE001 - the error is the result
        out = {"error": type(exc).__name__, "message": str(exc)}
        printed = io.StringIO()
        with contextlib.redirect_stderr(printed):
            sys.excepthook(type(exc), exc, exc.__traceback__)
        out["printed"] = printed.getvalue()
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    out["seconds"] = time.monotonic() - start
    out["children"] = len(multiprocessing.active_children())
    return out


def cli_serve(argv: list[str]) -> dict:
    """vLLM's own CLI (``vllm serve MODEL ARGV``) in this process: the
    exception that reaches its top, and what ``sys.excepthook`` prints
    for it.  Only for configurations refused before any engine starts."""
    import socket

    from vllm.entrypoints.cli.main import main as vllm_main

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    saved = sys.argv
    sys.argv = ["vllm", "serve", tiny_model_path(), "--port", str(port), *argv]
    try:
        vllm_main()
        return {"error": None}
    except BaseException as exc:  # noqa: BLE001 - the error is the result
        printed = io.StringIO()
        with contextlib.redirect_stderr(printed):
            sys.excepthook(type(exc), exc, exc.__traceback__)
        return {
            "error": type(exc).__name__,
            "message": str(exc),
            "printed": printed.getvalue(),
            "children": len(multiprocessing.active_children()),
        }
    finally:
        sys.argv = saved


def main(config: dict) -> dict:
    cpu_defaults()
    from vllm.plugins import load_general_plugins

    load_general_plugins()  # as vllm serve does before building its parser
    import vllm

    out = {
        name: one_case(case.get("argv", []), case.get("env", {}))
        for name, case in config["cases"].items()
    }
    result = {"vllm_version": vllm.__version__, "cases": out}
    if "cli" in config:
        result["cli"] = cli_serve(config["cli"])
    return result


if __name__ == "__main__":
    from result_out import emit

    emit(main(json.loads(sys.argv[1])))
