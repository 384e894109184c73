"""tests/support/spawn_shim.py + spawn_zygote.py, the test harness's
spawn-from-a-zygote (tox turns it on for every suite): a spawned child is
forked by the zygote and gets what spawn gives a fresh one (its pickled
Connection, environment, working directory); its parent sees it end as
it ended (exit code, signal, exception); a killed wrapper takes its child;
a zygote that cannot start, or OVERLAY_TESTS_FORK=0, means a fresh child.
Runs plain-Python children (the zygote preloads a module that reads one
variable at import, not vLLM), each case a process of its own
(tests/unit/run_spawn_shim.py)."""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import re
import signal
import subprocess
import sys

import pytest

HERE = pathlib.Path(__file__).parent
RUN = HERE / "run_spawn_shim.py"
SHIM = HERE.parent / "support" / "spawn_shim.py"


PRELOADED = """import os
READ_AT_IMPORT = os.environ.get("SPAWN_SHIM_READ_AT_IMPORT")
SNAPSHOT = dict(os.environ)  # a walk over everything keys nothing
ITEMS = list(os.environ.items())
"""


@pytest.fixture
def zygotes(tmp_path):
    folder = tmp_path / "zygotes"
    modules = tmp_path / "modules"
    modules.mkdir()
    (modules / "reads_at_import.py").write_text(PRELOADED)
    yield folder
    for log in folder.glob("*.log"):  # the zygotes would idle out in minutes
        for pid in re.findall(r"spawn_zygote (\d+):", log.read_text()):
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)


def run(case: str, folder: pathlib.Path, cwd: pathlib.Path, **env: str):
    """(what the case printed, its stderr)"""
    environ = {
        **{k: v for k, v in os.environ.items() if not k.startswith("OVERLAY_")},
        "OVERLAY_SPAWN_ZYGOTES": str(folder),
        "OVERLAY_SPAWN_SHIM": str(SHIM),
        "OVERLAY_SPAWN_PRELOAD": "reads_at_import",
        "PYTHONPATH": str(folder.parent / "modules"),
        "CASE_MARKER": case,
        **env,
    }
    cwd.mkdir(exist_ok=True)
    done = subprocess.run(
        [sys.executable, str(RUN), case],
        env=environ,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


def test_child_is_forked_from_the_zygote_with_what_spawn_passes(zygotes, tmp_path):
    out, _ = run("exit", zygotes, tmp_path / "work")
    assert out["pid"] != out["wrapper_pid"]
    assert "spawn_zygote.py" in out["parent_cmdline"]
    assert out["got"] == "sent through the pipe"  # a pickled Connection's descriptor
    assert out["exitcode"] == 7
    assert out["marker"] == "exit"
    assert out["cwd"] == str(tmp_path / "work")


def test_terminate_reaches_the_child_and_its_signal_comes_back(zygotes, tmp_path):
    out, _ = run("terminate", zygotes, tmp_path)
    assert out["exitcode"] == -signal.SIGTERM
    assert out["real"] != out["wrapper_pid"] and isinstance(out["real"], int)


def test_a_killed_wrapper_takes_its_child(zygotes, tmp_path):
    out, _ = run("kill", zygotes, tmp_path)
    assert out["exitcode"] == -signal.SIGKILL
    assert isinstance(out["real"], int), out["real"]


def test_a_killed_wrapper_takes_what_its_child_started(zygotes, tmp_path):
    out, _ = run("cascade", zygotes, tmp_path)
    assert out["gone"], out


FRONT_END = """#!{python}
import json, os, sys
print(json.dumps([os.getppid(), sys.argv, os.getcwd()]), flush=True)
sys.exit(5)
"""


def test_vllm_serve_is_handed_to_a_zygote(zygotes, tmp_path):
    """A ``vllm serve`` process (the console script's name) hands itself
    over at start-up (the harness's .pth): the script runs in the zygote's
    child with its argv and working directory; the process exits as it did."""
    subprocess.run([sys.executable, str(SHIM), "--install-pth"], check=True)
    script = tmp_path / "bin" / "vllm"
    script.parent.mkdir()
    script.write_text(FRONT_END.format(python=sys.executable))
    script.chmod(0o755)
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("OVERLAY_")},
        "OVERLAY_SPAWN_ZYGOTES": str(zygotes),
        "OVERLAY_SPAWN_SHIM": str(SHIM),
        "OVERLAY_SPAWN_PRELOAD": "reads_at_import",
        "PYTHONPATH": str(zygotes.parent / "modules"),
    }
    for argv, handed in (["serve", "model"], True), (["--version"], False):
        done = subprocess.run(
            [str(script), *argv], env=env, cwd=tmp_path, capture_output=True, text=True
        )
        assert done.returncode == 5, done.stderr
        ppid, seen, cwd = json.loads(done.stdout)
        assert (ppid != os.getpid()) is handed  # else this test's child
        assert seen == [str(script), *argv] and cwd == str(tmp_path)
    assert len(list(zygotes.glob("*.log"))) == 1


def test_an_uncaught_exception_is_reported_as_a_process_top_level(zygotes, tmp_path):
    out, stderr = run("raises", zygotes, tmp_path)
    assert out["exitcode"] == 1
    assert "RuntimeError: raised in the spawned child" in stderr


def test_a_variable_read_at_import_keys_the_zygote(zygotes, tmp_path):
    first, _ = run("exit", zygotes, tmp_path, SPAWN_SHIM_READ_AT_IMPORT="a")
    again, _ = run("exit", zygotes, tmp_path, SPAWN_SHIM_READ_AT_IMPORT="a")
    other, _ = run("exit", zygotes, tmp_path, SPAWN_SHIM_READ_AT_IMPORT="b")
    unset, _ = run("exit", zygotes, tmp_path)
    runtime, _ = run(
        "exit", zygotes, tmp_path, SPAWN_SHIM_READ_AT_IMPORT="a", LATER="1"
    )
    zygote_pids = {first["ppid"], other["ppid"], unset["ppid"]}
    assert len(zygote_pids) == 3  # one per value, unset included
    assert again["ppid"] == runtime["ppid"] == first["ppid"]  # not read at import
    assert runtime["runtime_variable"] == "1"  # the child's environment is its own
    assert len(list(zygotes.glob("*.log"))) == 3
    names = next(zygotes.glob("names-*.json")).read_text()
    assert "SPAWN_SHIM_READ_AT_IMPORT" in names and "LATER" not in names


def test_fresh_child_when_no_zygote_starts(zygotes, tmp_path):
    out, _ = run(
        "fresh", zygotes, tmp_path, OVERLAY_SPAWN_PRELOAD="no_such_module_here"
    )
    assert out["pid"] == out["wrapper_pid"]  # the wrapper exec'd the interpreter
    assert "run_spawn_shim.py" in out["parent_cmdline"]
    assert out["got"] == "sent through the pipe" and out["exitcode"] == 7
    assert list(zygotes.glob("*.failed"))
    assert (
        "No module named 'no_such_module_here'"
        in next(zygotes.glob("*.log")).read_text()
    )


def test_off_with_overlay_tests_fork_0(zygotes, tmp_path):
    out, _ = run("fresh", zygotes, tmp_path, OVERLAY_TESTS_FORK="0")
    assert out["pid"] == out["wrapper_pid"]
    assert "run_spawn_shim.py" in out["parent_cmdline"]
    assert not zygotes.exists()


def test_the_cap_counts_running_zygotes_not_past_ones(zygotes, tmp_path):
    """Zygotes idle out; a later start-up still gets one.  Six that are
    running (marked with live pids) make a seventh start-up a fresh child."""
    zygotes.mkdir()
    for n in range(6):  # six zygotes that ran and exited (their logs, stale marks)
        (zygotes / f"zygote-{n}.log").write_text("idle: exiting\n")
        (zygotes / f"running-{2**22 + n}").touch()  # above pid_max: not running
    later, _ = run("exit", zygotes, tmp_path)
    assert later["pid"] != later["wrapper_pid"]  # forked by a zygote
    assert "spawn_zygote.py" in later["parent_cmdline"]
    assert (zygotes / f"running-{later['ppid']}").exists()

    sleepers = [subprocess.Popen(["sleep", "60"]) for _ in range(5)]
    try:  # with the one above, six running
        for sleeper in sleepers:
            (zygotes / f"running-{sleeper.pid}").touch()
        full, _ = run("fresh", zygotes, tmp_path, SPAWN_SHIM_READ_AT_IMPORT="c")
    finally:
        for sleeper in sleepers:
            sleeper.kill()
            sleeper.wait()
    assert full["pid"] == full["wrapper_pid"]  # the wrapper exec'd the interpreter
    assert len(list(zygotes.glob("zygote-*.log"))) == 7
