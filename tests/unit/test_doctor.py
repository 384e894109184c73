"""``python -m vllm_overlay doctor``: fast by default, one block of report.

Each case runs the command in a fresh interpreter.  The default report comes
from metadata and the overlay's own modules (vLLM is not imported); ``--deep``
imports every patch target module and holds vLLM's log lines back, so
stdout is the report alone, warnings summarised at its end.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest

from vllm_overlay.patches import all_patches

# A vLLM log line (optionally prefixed by a process tag such as
# "(EngineCore_DP0 pid=1)"), or torch's glog-style lines ("W1122 18:01:54").
LOG_LINE = re.compile(
    r"^(\x1b\[[0-9;]*m)?(\(\w+ pid=\d+\)\S*\s*)?"
    r"((INFO|WARNING|DEBUG|ERROR) \d\d-\d\d |[IWEF]\d{4} )"
)
HEADS = (
    "vllm-overlay ",
    "vLLM ",
    "torch ",
    "plugin ",
    "environment ",
    "platform ",
    "register() ",
    "patches",
    "warnings logged",
)

PROBE = """
import json, sys
from vllm_overlay.__main__ import main
status = main(["doctor", *sys.argv[1:]])
print("MODULES:" + json.dumps(sorted(m for m in sys.modules
                                      if m == "vllm" or m.startswith("vllm."))))
sys.exit(status)
"""


def run_doctor(*args: str, **env: str):
    base = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("VLLM_OVERLAY_") and k != "VLLM_PLUGINS"
    }
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, *args],
        env={**base, **env},
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = proc.stdout.splitlines()
    assert out and out[-1].startswith("MODULES:"), proc.stdout + proc.stderr
    return proc.returncode, out[:-1], json.loads(out[-1][8:]), proc.stderr


def assert_one_block(report: list[str]) -> None:
    """The report is every line of stdout, and nothing else is in it."""
    assert report[0].startswith("vllm-overlay 0.1.0")
    for line in report:
        assert not LOG_LINE.match(line), f"log line in the report: {line!r}"
        assert line == "" or line.startswith("  ") or line.startswith(HEADS), (
            f"not a report line: {line!r}"
        )
    # Sections in order, each once.
    starts = [
        next(i for i, ln in enumerate(report) if ln.startswith(head))
        for head in HEADS[:8]
    ]
    assert starts == sorted(starts)


def patch_lines(report: list[str]) -> dict[str, tuple[str, str]]:
    """patch id -> (status, detail line)."""
    found = {}
    for i, line in enumerate(report):
        parts = line.split()
        if line.startswith("  ") and len(parts) == 3 and "." in parts[2]:
            found[parts[0]] = (parts[1], report[i + 1].strip())
    return found


def test_default_report_without_importing_vllm():
    status, report, modules, _ = run_doctor()
    assert status == 0, report
    assert modules == []  # no vLLM module imported: answers in seconds
    assert_one_block(report)
    text = "\n".join(report)
    assert re.search(
        r"^vLLM +0\.11\.2\S* \(supported; overlay targets "
        r"0\.11\.2",
        text,
        re.M,
    )
    assert (
        "plugin       entry point vllm_overlay = vllm_overlay:register "
        "(vLLM loads it in every process)"
    ) in report
    assert "register()   will be: applied (--deep runs it)" in report
    patches = patch_lines(report)
    assert list(patches) == [p.id for p in all_patches()]
    assert {status for status, _ in patches.values()} == {"ready"}


def test_default_report_follows_the_environment():
    _, report, _, _ = run_doctor(VLLM_OVERLAY_SKIP_PATCHES="CL-06,KV-03")
    patches = patch_lines(report)
    assert patches["CL-06"] == ("skipped", "skipped by VLLM_OVERLAY_SKIP_PATCHES")
    assert patches["KV-03"][0] == "skipped"
    assert patches["CL-01"][0] == "ready"
    assert "environment  VLLM_OVERLAY_SKIP_PATCHES=CL-06,KV-03" in report

    _, report, _, _ = run_doctor(VLLM_OVERLAY_DISABLE="1")
    assert (
        "register()   will be: disabled by VLLM_OVERLAY_DISABLE "
        "(--deep runs it)" in report
    )
    assert {s for s, _ in patch_lines(report).values()} == {"skipped"}

    _, report, _, _ = run_doctor(VLLM_PLUGINS="some_other_plugin")
    plugin = next(ln for ln in report if ln.startswith("plugin "))
    assert "NOT loaded: VLLM_PLUGINS='some_other_plugin'" in plugin

    status, report, _, _ = run_doctor(VLLM_OVERLAY_SKIP_PATCHES="XX-99")
    assert status == 1
    assert any("unknown patch ids ['XX-99']" in ln for ln in report)


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM")
def test_deep_report_is_one_block_with_vllm_logs_held_back():
    status, report, modules, stderr = run_doctor("--deep")
    assert status == 0, "\n".join(report) + stderr
    assert "vllm.v1.worker.gpu_model_runner" in modules
    assert_one_block(report)
    assert "register()   applied" in report
    assert any(re.match(r"platform +\w+Platform \(device ", ln) for ln in report)
    patches = patch_lines(report)
    assert list(patches) == [p.id for p in all_patches()]
    for pid in ("CL-01", "CL-06", "CL-09", "PP-05", "KV-01", "KV-03"):
        assert patches[pid][0] == "applied", (pid, patches[pid])
    assert not any(LOG_LINE.match(ln) for ln in stderr.splitlines()), stderr
    # Held warnings (e.g. "Pin memory is not supported on CPU") come last.
    if any(ln.startswith("warnings logged") for ln in report):
        tail = report[
            next(i for i, ln in enumerate(report) if ln.startswith("warnings logged"))
            + 1 :
        ]
        assert tail and all(ln.startswith("  ") for ln in tail)
