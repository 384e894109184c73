"""Run the series' upstream tests on a patched vLLM tree, overlay disabled.

    python patches/tools/run_upstream_tests.py            # all of tests/v1
    python patches/tools/run_upstream_tests.py --keep -k pool -x
    python patches/tools/run_upstream_tests.py --skip-diff NAME

Builds the tree the series describe: the installed vLLM package
(``importlib.util.find_spec("vllm")``) copied into a temporary directory as
``vllm/``, then every diff of ``patches/series`` applied in order with
``git apply -p1`` from that directory.  ``--skip-diff NAME`` (repeatable)
leaves out a diff (its series entry, e.g.
``kv-pressure/0001-v1-core-kv_cache_manager.patch``, or its file name) or a
whole series (``kv-pressure``): a deliberately broken series, to see its
tests fail.  Unless the series created ``tests/`` themselves,
``patches/upstream-tests/tests`` is copied in, with the empty
``__init__.py`` files vLLM's own ``tests/`` tree has (so ``tests.v1...``
imports resolve as they do in vLLM's repository).

Before pytest, a subprocess with the test environment checks that ``import
vllm`` resolves to the tree and that every module the applied diffs create
imports from it.  Then ``python -m pytest -q -p no:cacheprovider tests/v1``
(plus any other arguments given, which go to pytest) runs with the tree as
working directory, rootdir and ``PYTHONPATH``, an ini file of its own in
the tree (no ``conftest.py`` or ini of this project is seen), and
``VLLM_OVERLAY_DISABLE=1`` (the installed overlay plugin does nothing).
The exit status is pytest's.

``TESTS`` maps each series to the test files it adds (paths under
``patches/upstream-tests``, i.e. under vLLM's repository root);
``tests/unit/test_upstream_tests_layout.py`` and the mbox builder read it.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[2]
PATCHES = ROOT / "patches"
UPSTREAM_TESTS = PATCHES / "upstream-tests"

# series -> the test files it adds to vLLM's tree (relative to
# patches/upstream-tests, i.e. to vLLM's repository root)
TESTS = {
    "cross-layer": [
        "tests/v1/kv_connector/unit/tiny_llama.py",
        "tests/v1/worker/test_cross_layer_kv.py",
    ],
    "kv-pressure": ["tests/v1/core/test_kv_pressure_async_loads.py"],
    "offloading": [
        "tests/v1/kv_offload/test_block_copy.py",
        "tests/v1/kv_connector/unit/test_cross_layer_offloading_connector.py",
    ],
    "shared-pool": ["tests/v1/kv_connector/unit/test_shared_pool.py"],
    "pp-kv-budget": ["tests/v1/worker/test_pp_kv_budget.py"],
}

# packages of vLLM 0.11.2's tests/ tree that the files above live in (vLLM
# has these __init__.py files; tests/v1/kv_offload has none)
TEST_PACKAGES = [
    "tests",
    "tests/v1",
    "tests/v1/core",
    "tests/v1/worker",
    "tests/v1/kv_connector",
    "tests/v1/kv_connector/unit",
]

# what the tests need to run on this CPU harness (setdefault: a caller's
# value wins), and what is forced
ENV_DEFAULTS = {
    "HF_HUB_OFFLINE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "TOKENIZERS_PARALLELISM": "false",
    "TORCHDYNAMO_DISABLE": "1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
}

PREFLIGHT = """\
import importlib, pathlib, sys
tree = pathlib.Path(sys.argv[1]).resolve()
import vllm
where = pathlib.Path(vllm.__file__).resolve()
assert tree in where.parents, f"import vllm resolves to {where}, not the tree {tree}"
for name in sys.argv[2:]:
    module = importlib.import_module(name)
    where = pathlib.Path(module.__file__).resolve()
    assert tree in where.parents, f"{name} imports from {where}, not the tree"
print(f"preflight: vllm and {len(sys.argv) - 2} upstream modules import from {tree}")
"""


def series() -> list[str]:
    return [
        line.strip()
        for line in (PATCHES / "series").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]


def _matches(entry: str, name: str) -> bool:
    """NAME names the series entry ENTRY: the entry, its file name, or its
    series (every diff of it)."""
    path = pathlib.PurePosixPath(entry)
    return name.rstrip("/") in (entry, path.name, path.parts[0])


def created_modules(diff: pathlib.Path) -> list[str]:
    """Modules of vllm/ that DIFF adds as new files."""
    out, new = [], False
    for line in diff.read_text().splitlines():
        if line.startswith("--- "):
            new = line == "--- /dev/null"
        elif line.startswith("+++ b/") and new:
            path = line[len("+++ b/") :]
            if path.startswith("vllm/") and path.endswith(".py"):
                module = path[: -len(".py")].replace("/", ".")
                out.append(module.removesuffix(".__init__"))
    return out


def build_tree(tree: pathlib.Path, skip: list[str]) -> list[str]:
    """The patched tree in TREE; returns the modules the diffs created."""
    site = pathlib.Path(importlib.util.find_spec("vllm").origin).parent
    shutil.copytree(site, tree / "vllm", ignore=shutil.ignore_patterns("__pycache__"))
    modules = []
    for entry in series():
        if any(_matches(entry, name) for name in skip):
            print(f"skipped: {entry}")
            continue
        diff = PATCHES / entry
        done = subprocess.run(
            ["git", "apply", "-p1", str(diff)],
            cwd=tree,
            capture_output=True,
            text=True,
            check=False,
        )
        if done.returncode:
            raise SystemExit(f"{entry} does not apply:\n{done.stderr.strip()}")
        modules += created_modules(diff)
    if not (tree / "tests").exists():
        shutil.copytree(UPSTREAM_TESTS / "tests", tree / "tests")
        for package in TEST_PACKAGES:
            init = tree / package / "__init__.py"
            if init.parent.is_dir() and not init.exists():
                init.touch()
    # an ini of its own: no configuration of this project is read
    (tree / "pytest.ini").write_text("[pytest]\ntestpaths = tests/v1\n")
    return modules


def environment(tree: pathlib.Path) -> dict[str, str]:
    env = dict(os.environ)
    for name, value in ENV_DEFAULTS.items():
        env.setdefault(name, value)
    env["PYTHONPATH"] = str(tree)
    env["VLLM_OVERLAY_DISABLE"] = "1"
    env.pop("PYTHONSTARTUP", None)
    return env


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--keep", action="store_true", help="keep the tree and print its path"
    )
    parser.add_argument(
        "--skip-diff",
        action="append",
        default=[],
        metavar="NAME",
        help="do not apply this diff (series entry or file name) or series "
        "(directory name); repeatable",
    )
    args, pytest_args = parser.parse_known_args(argv)
    pytest_args = [a for a in pytest_args if a != "--"]
    entries = series()
    for name in args.skip_diff:
        if not any(_matches(entry, name) for entry in entries):
            parser.error(f"--skip-diff {name}: no such diff in patches/series")

    tree = pathlib.Path(tempfile.mkdtemp(prefix="vllm-upstream-tests-"))
    try:
        modules = build_tree(tree, args.skip_diff)
        env = environment(tree)
        subprocess.run(
            [sys.executable, "-c", PREFLIGHT, str(tree), *modules],
            cwd=tree,
            env=env,
            check=True,
        )
        command = [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-c",
            str(tree / "pytest.ini"),
            "--rootdir",
            str(tree),
            "--basetemp",  # inside the tree, removed with it
            str(tree / ".pytest-tmp"),
            *pytest_args,
        ]
        if not any(
            not a.startswith("-") and (tree / a.split("::")[0]).exists()
            for a in pytest_args
        ):
            command.append("tests/v1")
        return subprocess.run(command, cwd=tree, env=env, check=False).returncode
    except subprocess.CalledProcessError as exc:
        print(f"preflight failed (exit {exc.returncode})", file=sys.stderr)
        return 2
    finally:
        if args.keep:
            print(f"tree: {tree}")
        else:
            shutil.rmtree(tree, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
