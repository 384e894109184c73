"""Bad input a new user gives ``vllm serve`` on vLLM 0.32 (CPU) is refused
in the front end (``EngineArgs.create_engine_config``, patch PP32-03, in
the process that parses the arguments), before any engine process starts
or any model loads, with one line naming the key and the fix.  Without the
checks each got past startup and failed later: after the model loaded,
inside three tracebacks (``cpu_bytes_to_use``, the pool tier's options)
or on the first request (PP without compilation).

The overlay's 0.11.2 connectors and spec configured here are refused the
same way, naming what does their job on 0.32 (upstream's
``OffloadingConnector`` with ``cpu_bytes_to_use``; the pool tier).  Every
refusal, uncaught, prints as its one line: no traceback
(``vllm_overlay.startup_errors``).

``run_front_end.py`` runs the real front end (plugins loaded, the command
line parsed, ``create_engine_config``) for every case in one process; a
real ``vllm serve`` per check shows the same line as its last, exiting
without starting EngineCore.
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest
from conftest import run

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
from support.served_vllm import free_port, harness_env, serve_command  # noqa: E402
from support.zygote_client import runner  # noqa: E402

from vllm_overlay.core.pool.config import PoolConfig  # noqa: E402
from vllm_overlay.integration.v0_32.config_check import (  # noqa: E402
    machine_memory_bytes,
)

TINY = {
    "model_name": "vllm_overlay/models/tiny_llama",
    "model_args": {"dtype": "float32", "max_model_len": 512},
}
KEY = "--kv-transfer-config: kv_connector_extra_config['cpu_bytes_to_use']"


def offload(**extra) -> list[str]:
    config = {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": extra,
    }
    return ["--kv-transfer-config", json.dumps(config)]


POOL_TIER = {
    "type": "SharedPoolTier",
    "module_path": "vllm_overlay.integration.v0_32.pool_tier",
    "url": "redis://127.0.0.1:1/0",  # never reached: refused before
}
TIERS = "--kv-transfer-config: kv_connector_extra_config['secondary_tiers'][0]"


def tiered(**tier) -> list[str]:
    return offload(
        cpu_bytes_to_use=2**26,
        spec_name="TieringOffloadingSpec",
        secondary_tiers=[{**POOL_TIER, **tier}],
    )


def misspelled_message() -> str:
    """PoolConfig's own error for the options, after where they are."""
    try:
        PoolConfig.from_dict({"url": POOL_TIER["url"], "namespce": "prod"})
    except ValueError as exc:
        return f"{TIERS} (SharedPoolTier): {exc}"
    raise AssertionError("PoolConfig took a misspelled option")


def huge_message() -> str:
    memory = machine_memory_bytes()
    return (
        f"{KEY} is {2**60} B ({2**60 / 2**30:.1f} GiB), more than this "
        f"machine's memory ({memory} B, {memory / 2**30:.1f} GiB): lower it"
    )


# name -> (command line after --model, environment, the error line or None)
CASES = {
    "negative_host_bytes": (
        offload(cpu_bytes_to_use=-8589934592),
        {},
        f"{KEY} is -8589934592: give a positive number of bytes of host "
        "memory for offloaded KV (e.g. 8589934592 or 8G for 8 GiB)",
    ),
    "huge_host_bytes": (offload(cpu_bytes_to_use=2**60), {}, huge_message),
    "text_host_bytes": (
        offload(cpu_bytes_to_use="8 GiB"),
        {},
        f"{KEY} must be a whole number of bytes, got '8 GiB' (e.g. "
        "8589934592 or 8G for 8 GiB)",
    ),
    "no_host_bytes": (
        offload(),
        {},
        f"{KEY} is missing: give the bytes of host memory for offloaded KV "
        "(e.g. 8589934592 or 8G for 8 GiB)",
    ),
    "good_host_bytes": (offload(cpu_bytes_to_use=2**26), {}, None),
    "multi_connector_host_bytes": (
        [
            "--kv-transfer-config",
            json.dumps(
                {
                    "kv_connector": "MultiConnector",
                    "kv_role": "kv_both",
                    "kv_connector_extra_config": {
                        "connectors": [
                            json.loads(offload(cpu_bytes_to_use=0)[1]),
                        ]
                    },
                }
            ),
        ],
        {},
        "--kv-transfer-config: kv_connector_extra_config.connectors[0]"
        ".kv_connector_extra_config['cpu_bytes_to_use'] is 0: give a positive "
        "number of bytes of host memory for offloaded KV (e.g. 8589934592 or "
        "8G for 8 GiB)",
    ),
    "misspelled_pool_option": (tiered(namespce="prod"), {}, misspelled_message),
    "pool_tier_type": (
        tiered(type="SharedPool"),
        {},
        f"{TIERS}: module_path 'vllm_overlay.integration.v0_32.pool_tier' "
        "holds the tier 'SharedPoolTier', not type 'SharedPool': set "
        '"type": "SharedPoolTier"',
    ),
    "good_pool_tier": (tiered(namespace="prod"), {}, None),
    # PP without compilation: vLLM 0.32's CPU worker skips its warm-up and
    # the first request kills the engine (stock too).
    "pp_enforce_eager": (
        ["--pipeline-parallel-size", "2", "--enforce-eager"],
        {},
        "--pipeline-parallel-size 2 with --enforce-eager is a vLLM 0.32 CPU "
        "limit: without compilation the CPU worker skips its warm-up, the "
        "later stages never allocate their intermediate-tensor buffers and "
        "the first request kills the engine (assert self.intermediate_tensors "
        "is not None): remove --enforce-eager (compilation on, e.g. "
        "-cc.mode=1) or use --pipeline-parallel-size 1",
    ),
    "pp_compilation_off": (
        ["--pipeline-parallel-size", "2", "-cc.mode=0"],
        {},
        "--pipeline-parallel-size 2 with compilation mode NONE (-cc.mode=0) is "
        "a vLLM 0.32 CPU limit: without compilation the CPU worker skips its "
        "warm-up, the later stages never allocate their intermediate-tensor "
        "buffers and the first request kills the engine (assert "
        "self.intermediate_tensors is not None): turn compilation on (e.g. "
        "-cc.mode=1) or use --pipeline-parallel-size 1",
    ),
    "pp_compiled": (["--pipeline-parallel-size", "2", "-cc.mode=1"], {}, None),
    "eager_without_pp": (["--enforce-eager"], {}, None),
    # --enable-pp-prop-kv-cache: the explicit budget wins over the CPU
    # platform's VLLM_CPU_KVCACHE_SPACE (1 GiB here), split 12 + 4 MiB.
    "pp_budget_over_env": (
        [
            *("--dtype", "float32", "--pipeline-parallel-size", "2"),
            *("--enable-pp-prop-kv-cache", "--kv-cache-memory-bytes", "16M"),
        ],
        {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_PP_LAYER_PARTITION": "3,1"},
        None,
    ),
}


def expected(name: str) -> str | None:
    message = CASES[name][2]
    return message() if callable(message) else message


# The overlay's 0.11.2 connectors and spec -> the connector 0.32 names
# instead and its kv_connector_extra_config keys.
OVERLAY_CASES = {
    "overlay_offloading_connector": (
        "kv_connector 'OverlayOffloadingConnector'",
        {"kv_connector": "OverlayOffloadingConnector", "kv_role": "kv_both"},
        ["cpu_bytes_to_use"],
    ),
    "overlay_offloading_spec": (
        "kv_connector_extra_config spec_name 'OverlayCPUOffloadingSpec'",
        {
            "kv_connector": "OffloadingConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"spec_name": "OverlayCPUOffloadingSpec"},
        },
        ["cpu_bytes_to_use"],
    ),
    "shared_pool_connector": (
        "kv_connector 'SharedKVPoolConnector'",
        {
            "kv_connector": "SharedKVPoolConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"url": "redis://127.0.0.1:1/0"},
        },
        ["cpu_bytes_to_use", "spec_name", "secondary_tiers"],
    ),
}


@pytest.fixture(scope="module")
def front_end_run():
    cases = {name: {"argv": argv, "env": env} for name, (argv, env, _) in CASES.items()}
    for name, (_, config, _) in OVERLAY_CASES.items():
        cases[name] = {"argv": ["--kv-transfer-config", json.dumps(config)], "env": {}}
    # vLLM's CLI entry point itself, with the 0.11.2 connector (refused
    # before any engine starts).
    cli = cases["overlay_offloading_connector"]["argv"]
    return run("run_front_end.py", {"cases": cases, "cli": cli}).result


@pytest.fixture(scope="module")
def front_end(front_end_run):
    return front_end_run["cases"]


def one_line(got: dict) -> None:
    """Uncaught, the refusal prints as ``Type: message`` alone."""
    assert got["printed"].splitlines() == [f"{got['error']}: {got['message']}"]
    assert "Traceback" not in got["printed"]


@pytest.mark.parametrize("name", [n for n in CASES if CASES[n][2] is not None])
def test_refused_in_create_engine_config(front_end, name):
    got = front_end[name]
    assert (got["error"], got["message"]) == ("ConfigRefused", expected(name))
    assert "\n" not in got["message"]
    one_line(got)
    assert got["children"] == 0  # no engine process started
    assert got["seconds"] < 60  # generous: the machine is shared


def _config_in(message: str) -> dict:
    start = message.index("--kv-transfer-config '") + len("--kv-transfer-config '")
    return json.loads(message[start : message.index("'", start)])


@pytest.mark.parametrize("name", list(OVERLAY_CASES))
def test_overlay_connectors_name_the_0_32_way(front_end_run, name):
    from vllm_overlay.version_gate import unsupported_error

    what, _, keys = OVERLAY_CASES[name]
    got = front_end_run["cases"][name]
    version = front_end_run["vllm_version"]
    assert got["error"] == "UnsupportedVLLMVersion"
    assert got["message"] == str(unsupported_error([what], version, "connectors"))
    assert f"On vLLM {version} use " in got["message"]
    config = _config_in(got["message"])
    assert config["kv_connector"] == "OffloadingConnector"
    assert sorted(config["kv_connector_extra_config"]) == sorted(keys)
    one_line(got)
    assert got["children"] == 0


def test_vllm_cli_lets_the_refusal_reach_the_top_as_one_line(front_end_run):
    """``vllm serve`` (vLLM's CLI ``main``, in process) does not wrap the
    refusal: it reaches the top, where it prints as its one line."""
    got = front_end_run["cli"]
    assert got["error"] == "UnsupportedVLLMVersion"
    assert (
        got["message"]
        == front_end_run["cases"]["overlay_offloading_connector"]["message"]
    )
    one_line(got)
    assert got["children"] == 0


@pytest.mark.parametrize("name", [n for n in CASES if CASES[n][2] is None])
def test_good_configurations_pass(front_end, name):
    assert front_end[name]["error"] is None, front_end[name]


def test_the_explicit_pp_budget_wins_over_the_cpu_kv_space(front_end):
    """With the flag, --kv-cache-memory-bytes 16M is the pipeline's budget
    although VLLM_CPU_KVCACHE_SPACE=1 is set (the CPU platform replaced it
    with 1 GiB): 64 blocks per stage (test_pp_budget_cpu runs the engine)."""
    got = front_end["pp_budget_over_env"]["value"]
    assert got == {"kv_cache_memory_bytes": 16 * 2**20, "stage_blocks": [64, 64]}


def serve_refusal(name: str, tmp_path: pathlib.Path) -> tuple[int, str]:
    """``vllm serve`` of the tiny Llama with the case's flags: its exit
    status and log (it must exit by itself, well before a model load).
    The ``vllm`` command runs forked from the session's zygote (vLLM
    imported once) when the harness has it and forks are on."""
    argv, env, _ = CASES[name]
    log = tmp_path / f"serve-{name}.log"
    command = serve_command(TINY, free_port(), argv)
    fork = runner()
    if fork is not None and pathlib.Path(command[0]).name == "vllm":
        rc = fork(command[0], command[1:], harness_env(**env), log, 300, tmp_path)
        return rc, log.read_text(errors="replace")
    with open(log, "w") as out:
        proc = subprocess.run(
            command,
            env=harness_env(**env),
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=tmp_path,
            timeout=300,
        )
    return proc.returncode, log.read_text(errors="replace")


@pytest.mark.parametrize(
    "name", ["negative_host_bytes", "misspelled_pool_option", "pp_enforce_eager"]
)
def test_vllm_serve_exits_with_the_line(name, tmp_path):
    rc, log = serve_refusal(name, tmp_path)
    lines = [ln for ln in log.splitlines() if ln.strip()]
    assert rc != 0
    assert lines[-1] == f"ConfigRefused: {expected(name)}", log[-3000:]
    assert "Traceback" not in log  # the line alone
    # Refused in the API server process: no EngineCore, no model load.
    assert "EngineCore" not in log
    assert "Starting to load model" not in log


def test_vllm_serve_with_a_0_11_2_connector_exits_with_the_0_32_way(tmp_path):
    _, config, _ = OVERLAY_CASES["overlay_offloading_connector"]
    CASES["serve_overlay_connector"] = (
        ["--kv-transfer-config", json.dumps(config)],
        {},
        None,
    )
    try:
        rc, log = serve_refusal("serve_overlay_connector", tmp_path)
    finally:
        del CASES["serve_overlay_connector"]
    lines = [ln for ln in log.splitlines() if ln.strip()]
    assert rc == 1
    assert lines[-1].startswith(
        "UnsupportedVLLMVersion: kv_connector 'OverlayOffloadingConnector': "
        "this overlay feature runs on vLLM 0.11.2 only"
    ), log[-3000:]
    assert _config_in(lines[-1])["kv_connector"] == "OffloadingConnector"
    assert "Traceback" not in log
    assert "EngineCore" not in log
