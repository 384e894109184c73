"""An uncaught startup refusal prints as its one line, without a traceback
(``vllm_overlay.startup_errors``); any other exception keeps Python's
traceback, and ``VLLM_LOGGING_LEVEL=DEBUG`` keeps it for a refusal too.

Each case is a fresh interpreter that raises, uncaught, the error the
overlay's front-end check raises (from two levels of the overlay's own
functions, as ``create_engine_config``'s wrappers do)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from vllm_overlay import version_gate

SCRIPT = """
import sys
from vllm_overlay import envs, version_gate
from vllm_overlay.startup_errors import install_hook
install_hook()
install_hook()  # re-entrant: one hook

def refuse(kind):
    if kind == "unsupported":
        raise version_gate.unsupported_error(
            ["kv_connector 'OverlayOffloadingConnector'"], "0.32.0", "connectors")
    if kind == "setting":
        raise envs.BadSetting("VLLM_OVERLAY_SKIP_PATCHES=CL-06: a setting")
    raise KeyError("not a refusal")

def create_engine_config(kind):
    refuse(kind)

create_engine_config(sys.argv[1])
"""


def run(kind: str, **env: str) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k != "VLLM_LOGGING_LEVEL"}
    return subprocess.run(
        [sys.executable, "-c", SCRIPT, kind],
        env={**base, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_refusal_is_one_line_naming_the_fix():
    proc = run("unsupported")
    expected = version_gate.unsupported_error(
        ["kv_connector 'OverlayOffloadingConnector'"], "0.32.0", "connectors"
    )
    assert proc.returncode == 1
    assert proc.stderr.splitlines() == [f"UnsupportedVLLMVersion: {expected}"]
    assert "Traceback" not in proc.stderr
    assert "OffloadingConnector with cpu_bytes_to_use" in proc.stderr


def test_a_bad_setting_is_one_line():
    proc = run("setting")
    assert proc.returncode == 1
    assert proc.stderr.splitlines() == [
        "BadSetting: VLLM_OVERLAY_SKIP_PATCHES=CL-06: a setting"
    ]


@pytest.mark.parametrize(
    "kind,env", [("other", {}), ("unsupported", {"VLLM_LOGGING_LEVEL": "DEBUG"})]
)
def test_other_errors_and_debug_keep_the_traceback(kind, env):
    proc = run(kind, **env)
    assert proc.returncode == 1
    assert proc.stderr.startswith("Traceback (most recent call last):")
    assert "in create_engine_config" in proc.stderr
