"""scripts/test_report.py: the closing table of scripts/test.sh, read from
tox's result json and pytest's junit files."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

import test_report  # noqa: E402

JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites name="pytest tests"><testsuite name="pytest" errors="1" failures="1"
 skipped="2" tests="6" time="12.5">
<testcase classname="tests.unit.test_a" name="test_ok" time="0.1"/>
<testcase classname="tests.unit.test_a" name="test_ok_too" time="0.1"/>
<testcase classname="tests.unit.test_a" name="test_bad" time="0.2">
  <failure message="assert 1 == 2">trace</failure>
  <error message="teardown failed">trace</error>
</testcase>
<testcase classname="tests.unit.test_b" name="test_setup_error" time="0.0">
  <error message="fixture blew up">trace</error>
</testcase>
<testcase classname="tests.unit.test_b" name="test_gpu" time="0.0">
  <skipped type="pytest.skip" message="needs a GPU">test_b.py:9: needs a GPU</skipped>
</testcase>
<testcase classname="tests.unit.test_b" name="test_tls[valkey]" time="0.0">
  <skipped type="pytest.skip"
   message="this valkey-server has no TLS&#10;1:M log">x</skipped>
</testcase>
</testsuite></testsuites>
"""


def _tox_json(envs: dict[str, tuple[bool, float] | None]) -> dict:
    testenvs = {}
    for name, outcome in envs.items():
        if outcome is None:  # in env_list, not run by this call
            testenvs[name] = {}
            continue
        ok, seconds = outcome
        testenvs[name] = {
            "result": {
                "success": ok,
                "exit_code": 0 if ok else 1,
                "duration": seconds,
                "skipped": False,
            },
            "test": [],
        }
    return {"reportversion": "1", "toxversion": "4", "testenvs": testenvs}


def test_junit_counts_each_test_once_with_its_skip_reason(tmp_path):
    junit = tmp_path / "unit.xml"
    junit.write_text(JUNIT)
    counts = test_report.junit_counts(junit)
    assert (counts.passed, counts.failed, counts.errors, counts.skipped) == (
        2,
        1,
        1,
        2,
    )
    assert counts.skips == [
        ("tests.unit.test_b::test_gpu", "needs a GPU"),
        ("tests.unit.test_b::test_tls[valkey]", "this valkey-server has no TLS"),
    ]


def test_table_has_every_suite_that_ran_the_set_up_and_the_total(tmp_path):
    (tmp_path / "unit.xml").write_text(JUNIT)
    (tmp_path / "01.tox.json").write_text(
        json.dumps(
            _tox_json({"lint": (True, 9.4), "unit": (False, 301.0), "e2e": None})
        )
    )
    (tmp_path / "02.tox.json").write_text(
        json.dumps(_tox_json({"patches": (False, 75.0), "eval": (True, 5.0)}))
    )
    (tmp_path / "eval.xml").write_text("<testsuites><testsuite>")  # cut short
    suites = test_report.collect(tmp_path)
    assert [(s.name, s.ok) for s in suites] == [
        ("lint", True),
        ("unit", False),
        ("patches", False),
        ("eval", True),
    ]
    table = test_report.render(suites, setup_seconds=65, total_seconds=452)
    rows = {line.split()[0]: line.split() for line in table.splitlines() if line}
    assert rows["lint"] == ["lint", "ok", "0:09", "-", "-", "-", "-"]
    assert rows["unit"] == ["unit", "FAILED", "5:01", "2", "1", "1", "2"]
    assert rows["harness"] == ["harness", "set-up", "1:05"]
    assert rows["total"] == ["total", "7:32", "2", "1", "1", "2"]
    assert "e2e" not in rows  # listed by tox, not run
    # patches failed without a junit file: said, not shown as zero tests
    assert "no test counts for failed suite(s) patches" in table
    assert "eval: eval.xml unreadable" in table
    assert rows["eval"] == ["eval", "ok", "0:05", "-", "-", "-", "-"]
    assert "[unit] tests.unit.test_b::test_gpu: needs a GPU" in table
    assert "skipped tests (2)" in table


def test_cli_prints_the_table_and_no_skips_line(tmp_path):
    (tmp_path / "01.tox.json").write_text(
        json.dumps(_tox_json({"kernels": (True, 20.0)}))
    )
    (tmp_path / "kernels.xml").write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="k" name="t"/></testsuite></testsuites>'
    )
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "test_report.py"),
            "--reports",
            str(tmp_path),
            "--setup-seconds",
            "3",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    lines = done.stdout.splitlines()
    assert lines[0].split() == [
        "suite",
        "result",
        "wall",
        "passed",
        "failed",
        "errors",
        "skipped",
    ]
    assert any(
        line.split() == ["kernels", "ok", "0:20", "1", "0", "0", "0"] for line in lines
    )
    assert any(line.split() == ["total", "0:23", "1", "0", "0", "0"] for line in lines)
    assert "skipped tests: none" in done.stdout


def test_no_result_json_is_an_error(tmp_path):
    assert test_report.main(["--reports", str(tmp_path)]) == 1


def test_every_file_and_test_quick_names_exists():
    """--quick names files and tests by path: one renamed or merged away
    must be renamed here too, not left out (or run) unnoticed."""
    import re

    script = (ROOT / "scripts" / "test.sh").read_text()
    files = set(re.findall(r"tests/[\w/]+\.py", script))
    assert "tests/e2e/test_cross_layer_e2e.py" in files
    assert "tests/v0_32/test_cross_layer_cpu.py" in files
    for name in files:
        assert (ROOT / name).is_file(), name
    for path, test in re.findall(r"--deselect=(tests/[\w/]+\.py)::(\w+)", script):
        assert f"def {test}(" in (ROOT / path).read_text(), (path, test)
    e2e = (ROOT / "tests/e2e/test_cross_layer_e2e.py").read_text()
    assert "def test_cross_layer_tokens_equal_stock(" in e2e and '"float32"' in e2e
    v032 = (ROOT / "tests/v0_32/test_cross_layer_cpu.py").read_text()
    assert "def test_blhnc_is_one_buffer_with_blocks_outermost(" in v032
