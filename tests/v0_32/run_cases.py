"""Several cases of a runner (``run_gate.py``, ``run_pp.py``'s config
check) in one process, each in a forked child; prints JSON.

    python run_cases.py '{"script": "run_gate.py",
                          "cases": {"NAME": {"config": {...}, "env": {...}}}}'

The process imports vLLM once (the bulk of a runner's start-up on CPU:
about 14 s of CPU here) and registers nothing.  Each case's child sets its
``env`` (read by the overlay when the case registers it), runs the
script's ``main(config)`` as its own process would, writes the result and
exits, so no case sees another's patches, version or deleted attributes.
For cases that build no engine: a child of a forked process is no place
for one.  A case's result: ``result`` (``main``'s return, or None),
``log`` (its output), ``rc`` (0, or 1 with the traceback in the log, or
-9 past its deadline).
"""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import signal
import sys
import tempfile
import time

HERE = pathlib.Path(__file__).parent
sys.path.insert(0, str(HERE.parents[0] / "e2e"))

from vllm_overlay.testing.forked import fork_child  # noqa: E402

DEADLINE_S = 120.0  # per case, generous (the machine is shared); LLMRun: 300 s


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(
        f"case_{pathlib.Path(name).stem}", HERE / name
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def one_case(script: str, case: dict, out: pathlib.Path) -> None:
    """In the child: the case's environment, then the runner's main."""
    for name, value in case.get("env", {}).items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    result = load_script(script).main(case.get("config", {}))
    out.write_text(json.dumps(result))


def wait(pid: int, deadline_s: float) -> int:
    end = time.monotonic() + deadline_s
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() > end:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return -9
        time.sleep(0.05)


def main(config: dict) -> dict:
    import vllm.engine.arg_utils  # noqa: F401 - imported once, for the children

    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, case in config["cases"].items():
            out = pathlib.Path(tmp) / f"{name}.json"
            log = pathlib.Path(tmp) / f"{name}.log"
            pid = fork_child(
                lambda case=case, out=out: one_case(config["script"], case, out),
                str(log),
            )
            rc = wait(pid, DEADLINE_S)
            results[name] = {
                "rc": rc,
                "result": json.loads(out.read_text()) if out.exists() else None,
                "log": log.read_text(errors="replace") if log.exists() else "",
            }
    return results


if __name__ == "__main__":
    from result_out import emit

    emit(main(json.loads(sys.argv[1])))
