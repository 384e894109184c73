"""patches/tools/run_upstream_tests_032.py: vLLM 0.32.0's (or 0.33.0's) own
tests with and without the overlay must agree test by test (the 0.32 run
itself is in tox's ``patches`` environment)."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "patches" / "tools"))
import run_upstream_tests_032 as runner  # noqa: E402


def test_a_test_that_fails_only_with_the_overlay_is_a_difference():
    stock = {"a": "passed", "b": "failed", "c": "skipped", "d": "passed"}
    overlay = {"a": "passed", "b": "error", "c": "skipped", "d": "failed"}
    both, differ = runner.compare(stock, overlay)
    assert both == ["b"]  # failing in both: listed, not a difference
    assert differ == [
        "  b: stock failed, overlay error",
        "  d: stock passed, overlay failed",
    ]
    assert runner.compare(stock, dict(stock)) == (["b"], [])
    assert runner.compare(stock, {})[1][0] == "  a: stock passed, overlay not run"


def test_the_selection_covers_what_the_overlay_plugs_into():
    assert set(runner.RELEASES) == {"0.32.0", "0.33.0"}
    assert runner.VERSION in runner.RELEASES
    for version, lists in runner.RELEASES.items():
        assert set(lists.select) >= {
            "tests/v1/kv_offload",
            "tests/v1/kv_connector/unit/offloading_connector",
            "tests/engine/test_arg_utils.py",
        }, version
        for path, why in [*lists.deselect.items(), *lists.deselect_tests.items()]:
            assert why and any(path.startswith(s) for s in lists.select), path
        # the tests of what the v0_32 and v0_33 sets patch run whole: the
        # CPU spec and manager (OF32-01), the tiering spec (OF32-02), the
        # factory, the connector's scheduler (OF32-06, PT32-01) and worker
        # (OF32-04)
        touched = [
            "tests/v1/kv_offload/cpu/test_manager.py",
            "tests/v1/kv_offload/tiering/test_tiering_offloading.py",
            "tests/v1/kv_offload/tiering/test_factory.py",
            "tests/v1/kv_offload/test_factory.py",
            "tests/v1/kv_connector/unit/offloading_connector/test_scheduler.py",
            "tests/v1/kv_connector/unit/offloading_connector/test_worker.py",
        ]
        left_out = [*lists.deselect, *lists.deselect_tests]
        for path in touched:
            assert not [o for o in left_out if o.startswith(path)], (version, path)
            assert not [o for o in lists.deselect if path.startswith(o)], path
    # 0.33 leaves out what 0.32 does, and one engine test more
    old, new = runner.RELEASES["0.32.0"], runner.RELEASES["0.33.0"]
    assert new.deselect == old.deselect
    assert set(new.deselect_tests) - set(old.deselect_tests) == {
        "tests/v1/kv_connector/unit/test_offloading_connector.py::"
        "test_tiering_cache_reset_resumes_promotions_on_idle_engine"
    }


def test_each_release_runs_on_its_own_harness(monkeypatch):
    monkeypatch.delenv("OVERLAY_VENV_0_32", raising=False)
    monkeypatch.setenv("OVERLAY_VENV_0_33", "/elsewhere/venv")
    assert runner.default_python() == ROOT / ".venv-0.32" / "bin" / "python"
    assert runner.default_python("0.33.0") == pathlib.Path("/elsewhere/venv/bin/python")
    try:
        runner.release("0.31.0")
    except SystemExit as refused:
        assert "0.32.0, 0.33.0" in str(refused)
    else:
        raise AssertionError("no lists for 0.31.0, yet no refusal")
    # 0.33's Python-only build infers no platform without VLLM_TARGET_DEVICE
    lists = runner.RELEASES["0.33.0"]
    env = runner.run_env(pathlib.Path("/t"), "stock", {}, lists.env)
    assert env["VLLM_TARGET_DEVICE"] == "cpu"
    given = {"VLLM_TARGET_DEVICE": "empty"}
    assert (
        runner.run_env(pathlib.Path("/t"), "stock", given, lists.env)[
            "VLLM_TARGET_DEVICE"
        ]
        == "empty"
    )  # a caller's own value kept
    assert "VLLM_TARGET_DEVICE" not in runner.run_env(
        pathlib.Path("/t"), "stock", {}, runner.RELEASES["0.32.0"].env
    )


def test_the_offline_runs_find_the_models_the_tests_name(tmp_path):
    # huggingface_hub of the 0.32 harness, offline, resolves each model as
    # vLLM does (EngineArgs: a snapshot folder; ModelConfig: its config.json;
    # that vLLM builds each model's config from it, the runs themselves show)
    runner.write_hub(tmp_path / "hub")
    script = (
        "import json, os, sys\n"
        "from huggingface_hub import hf_hub_download, snapshot_download\n"
        "found = {}\n"
        "for repo in sys.argv[1:]:\n"
        "    path = snapshot_download(repo, local_files_only=True,"
        " ignore_patterns='*')\n"
        "    found[repo] = None\n"
        "    if os.path.exists(os.path.join(path, 'config.json')):\n"
        "        with open(hf_hub_download(repo, 'config.json')) as file:\n"
        "            config = json.load(file)\n"
        "        found[repo] = [config['model_type'], config['architectures']]\n"
        "print(json.dumps(found))\n"
    )
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(tmp_path / "hub"))
    done = subprocess.run(
        [str(runner.default_python()), "-c", script, *runner.HUB_MODELS],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    found = json.loads(done.stdout.splitlines()[-1])
    assert found["facebook/opt-125m"] == ["opt", ["OPTForCausalLM"]]
    assert found["Qwen/Qwen3-0.6B"] == ["qwen3", ["Qwen3ForCausalLM"]]
    assert found["dummy"] is None  # a folder, no config: only resolved


# vLLM's tests/conftest.py, in the shape the plugin relies on: a full
# cleanup (gc.collect of every generation, ~1.6-5 s a test with vLLM
# imported) after each test unless it is marked skip_global_cleanup
CONFTEST = """\
import os

import pytest


@pytest.fixture()
def should_do_global_cleanup_after_test(request) -> bool:
    return not request.node.get_closest_marker("skip_global_cleanup")


@pytest.fixture(autouse=True)
def cleanup_fixture(should_do_global_cleanup_after_test: bool):
    yield
    if should_do_global_cleanup_after_test:
        with open(os.environ["CALLS"], "a") as out:
            out.write("full cleanup\\n")
"""
# stand-ins for the vLLM functions the plugin calls, each writing its name
STAND_IN = """\
import os


def _record(name):
    with open(os.environ["CALLS"], "a") as out:
        out.write(name + "\\n")
"""
STAND_INS = {
    "vllm/__init__.py": "",
    "vllm/plugins.py": "def load_general_plugins():\n    _record('plugins')\n",
    "vllm/envs.py": "def disable_envs_cache():\n    _record('envs cache')\n",
    "vllm/distributed/__init__.py": "",
    "vllm/distributed/parallel_state.py": (
        "def destroy_model_parallel():\n    _record('model parallel')\n\n\n"
        "def destroy_distributed_environment():\n    _record('distributed')\n"
    ),
    "vllm_overlay/__init__.py": "def register():\n    return 'applied'\n",
}
TESTS = """\
import pytest


def test_passes():
    pass


def test_fails():
    assert False


@pytest.mark.skip(reason="here")
def test_skipped():
    pass
"""


def test_the_plugin_records_outcomes_and_skips_only_the_full_collection(tmp_path):
    (tmp_path / "_outcomes.py").write_text(runner.PLUGIN)
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "test_it.py").write_text(TESTS)
    for name, text in STAND_INS.items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(STAND_IN + "\n\n" + text if text else "")
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    calls, outcomes = tmp_path / "calls.txt", tmp_path / "outcomes.json"
    env = dict(os.environ, PYTHONPATH=str(tmp_path), CALLS=str(calls))
    env["OUTCOMES"] = str(outcomes)
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    command += ["-p", "_outcomes", "-c", str(tmp_path / "pytest.ini")]
    done = subprocess.run(
        [*command, "--rootdir", str(tmp_path), "test_it.py"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 1, done.stdout[-2000:]  # test_fails failed
    lines = [json.loads(line) for line in outcomes.read_text().splitlines()]
    assert lines[0][:2] == ["register()", "applied"]
    phases: dict[str, list[str]] = {}
    for test, outcome, _ in lines[1:]:
        phases.setdefault(test.split("::")[-1], []).append(outcome)
    assert phases == {
        "test_passes": ["passed"] * 3,
        "test_fails": ["passed", "failed", "passed"],
        "test_skipped": ["skipped", "passed"],
    }
    # vLLM's plugins loaded once; after each test run, the cleanup less the
    # full collection; upstream's full cleanup never
    light = ["envs cache", "model parallel", "distributed"]
    assert calls.read_text().split("\n")[:-1] == ["plugins", *light * 2]


def test_each_run_reads_no_configuration_of_this_project(tmp_path):
    environ = {
        "PATH": "/bin",
        "PYTEST_ADDOPTS": "--junitxml=.tox/reports/patches.xml",
        "VLLM_OVERLAY_SKIP_PATCHES": "OF32-02",
        "VLLM_OVERLAY_DISABLE": "1",
        "HF_HUB_OFFLINE": "0",
    }
    stock = runner.run_env(tmp_path, "stock", environ)
    overlay = runner.run_env(tmp_path, "overlay", environ)
    for env in (stock, overlay):
        assert "PYTEST_ADDOPTS" not in env and "VLLM_OVERLAY_SKIP_PATCHES" not in env
        assert env["HF_HUB_CACHE"] == str(tmp_path / "hf-hub")
        assert env["HF_HUB_OFFLINE"] == "0"  # given: kept
        assert env["PATH"] == "/bin"
    assert stock["VLLM_OVERLAY_DISABLE"] == "1"
    assert "VLLM_OVERLAY_DISABLE" not in overlay
    assert stock["OUTCOMES"] != overlay["OUTCOMES"]
    assert environ["PYTEST_ADDOPTS"]  # the caller's environment is untouched
