"""patches/upstream-tests: the series' tests as vLLM would have them (vLLM's
tests/v1 layout, SPDX header, vLLM's ruff settings, no overlay import), and
every series has some (run_upstream_tests.TESTS)."""

from __future__ import annotations

import ast
import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
UPSTREAM_TESTS = ROOT / "patches" / "upstream-tests"
SPDX = (
    "# SPDX-License-Identifier: Apache-2.0\n"
    "# SPDX-FileCopyrightText: Copyright contributors to the vLLM project\n"
)
SERIES = ["cross-layer", "kv-pressure", "offloading", "shared-pool", "pp-kv-budget"]
# what an upstream test may import: vLLM, vLLM's tests, and their dependencies
ALLOWED_IMPORTS = {
    "vllm",
    "tests",
    "torch",
    "numpy",
    "pytest",
    "redis",
    "regex",
    "transformers",
    "tokenizers",
}


def _load(name: str):
    for folder in ("patches", "patches/tools"):
        path = str(ROOT / folder)
        if path not in sys.path:
            sys.path.insert(0, path)
    return __import__(name)


@pytest.fixture(scope="module")
def runner():
    return _load("run_upstream_tests")


def _all_files():
    """The files of patches/upstream-tests, without caches (__pycache__,
    .ruff_cache, .pytest_cache: not in git)."""
    return sorted(
        p
        for p in UPSTREAM_TESTS.rglob("*")
        if p.is_file()
        and not any(
            part == "__pycache__" or part.startswith(".")
            for part in p.relative_to(UPSTREAM_TESTS).parts
        )
    )


def _python_files():
    return [p for p in _all_files() if p.suffix == ".py"]


def test_every_file_is_a_vllm_test_file_of_a_series(runner):
    listed = [f for files in runner.TESTS.values() for f in files]
    assert len(listed) == len(set(listed)), "a file is listed for two series"
    on_disk = [str(p.relative_to(UPSTREAM_TESTS)) for p in _python_files()]
    assert sorted(on_disk) == sorted(listed)
    for path in on_disk:
        assert path.startswith("tests/v1/"), path
    # besides the tests only the ruff settings that make this project's lint
    # check them as vLLM does (vllm first-party, line length 88)
    others = [p for p in _all_files() if p.suffix != ".py"]
    assert others == [UPSTREAM_TESTS / "ruff.toml"]
    assert (UPSTREAM_TESTS / "ruff.toml").read_text() == _load("generate").VLLM_RUFF


def test_every_series_has_a_test_file(runner):
    assert list(runner.TESTS) == SERIES
    for series, files in runner.TESTS.items():
        assert any(pathlib.PurePosixPath(f).name.startswith("test_") for f in files), (
            series
        )
    listed = {line.split("/")[0] for line in runner.series()}
    assert listed == set(SERIES)


@pytest.mark.parametrize(
    "path",
    _python_files(),
    ids=lambda p: str(p.relative_to(UPSTREAM_TESTS)),
)
def test_spdx_header_and_imports(path):
    text = path.read_text()
    assert text.startswith(SPDX)
    assert "vllm_overlay" not in text and "vllm-overlay" not in text
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: inside vLLM's tests
                continue
            names = [node.module]
        else:
            continue
        for name in names:
            top = name.split(".")[0]
            assert top in ALLOWED_IMPORTS or top in sys.stdlib_module_names, name
            assert name != "re", "vLLM imports regex as re"
            if top == "tests":
                assert (UPSTREAM_TESTS / (name.replace(".", "/") + ".py")).exists(), (
                    f"{name}: not one of the series' test files"
                )


def test_vllm_ruff_settings_pass(tmp_path):
    """ruff check and ruff format --check with vLLM's settings
    (generate.VLLM_RUFF), from a copy laid out as vLLM's repository root
    (tests/ first-party, as ruff finds it there)."""
    (tmp_path / "ruff.toml").write_text(_load("generate").VLLM_RUFF)
    shutil.copytree(
        UPSTREAM_TESTS / "tests",
        tmp_path / "tests",
        ignore=shutil.ignore_patterns("__pycache__"),
    )
    for args in (["check"], ["format", "--check"]):
        done = subprocess.run(
            [sys.executable, "-m", "ruff", *args, "--config", "ruff.toml", "tests"],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            check=False,
        )
        assert done.returncode == 0, f"ruff {args[0]}:\n{done.stdout}{done.stderr}"
