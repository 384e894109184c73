"""Patch tests: each patch id's behaviour tests, and proof they need it.

A test marked ``@pytest.mark.patch_test("KV-01")`` proves what patch KV-01
does, so it must fail when the overlay leaves KV-01 unapplied
(``VLLM_OVERLAY_SKIP_PATCHES=KV-01``).  ``marked_tests`` finds the marks in
the sources (for the catalogue test); ``main`` runs them (for
tests/unit/test_patch_tests.py):

    python tests/support/patch_tests.py OUT.json ID [ID...]

One interpreter imports vLLM once with the overlay not registered, then
forks one child per id (two at a time on two cores).  The child sets
``VLLM_OVERLAY_SKIP_PATCHES=ID`` and runs pytest on that id's marked tests;
the overlay reads the variable when it registers in the child (the unit
tests' ``overlay`` fixture or vLLM's plugin loader), exactly as in a fresh
process.  A control child runs every marked test with nothing skipped.
Each child's outcome per test goes to OUT.json.
"""

from __future__ import annotations

import ast
import gc
import json
import os
import pathlib
import shutil
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]
MARK = "patch_test"
CONTROL = ""  # the child that skips nothing


def marked_tests(
    root: pathlib.Path = ROOT / "tests",
) -> dict[str, list[tuple[pathlib.Path, int]]]:
    """{patch id: [(file, line)]} of every ``pytest.mark.patch_test(ID)``
    in the test sources, decorators and ``pytest.param(marks=...)``."""
    found: dict[str, list[tuple[pathlib.Path, int]]] = {}
    for path in sorted(root.rglob("test_*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == MARK
                and isinstance(node.func.value, ast.Attribute)
                and node.func.value.attr == "mark"
            ):
                continue
            if (
                not node.args
                or node.keywords
                or not all(
                    isinstance(a, ast.Constant) and isinstance(a.value, str)
                    for a in node.args
                )
            ):
                raise ValueError(
                    f"{path}:{node.lineno}: {MARK} takes patch "
                    "ids as string literals only"
                )
            for arg in node.args:
                found.setdefault(arg.value, []).append((path, node.lineno))
    return found


def item_patch_ids(item) -> set[str]:
    return {a for m in item.iter_markers(MARK) for a in m.args}


class _Select:
    """pytest plugin: keep only the tests marked for ``patch_id`` (every
    marked test for the control) and record each one's outcome."""

    def __init__(self, patch_id: str) -> None:
        self.patch_id = patch_id
        self.selected: list[str] = []
        self.outcomes: dict[str, dict] = {}

    def pytest_collection_modifyitems(self, config, items):
        keep, drop = [], []
        for item in items:
            ids = item_patch_ids(item)
            wanted = bool(ids) if self.patch_id == CONTROL else (self.patch_id in ids)
            (keep if wanted else drop).append(item)
        items[:] = keep
        if drop:
            config.hook.pytest_deselected(items=drop)
        self.selected = [item.nodeid for item in keep]

    def pytest_runtest_logreport(self, report):
        entry = self.outcomes.setdefault(
            report.nodeid, {"outcome": "passed", "text": ""}
        )
        if report.failed:
            # A failing call is a test failure; failing setup or teardown
            # is an error (fixture, import), which proves nothing.
            entry["outcome"] = "failed" if report.when == "call" else "error"
            entry["text"] += report.longreprtext[-3000:]
        elif report.skipped and entry["outcome"] == "passed":
            entry["outcome"] = "skipped"


def _child(
    patch_id: str, files: list[str], result: pathlib.Path, log: pathlib.Path
) -> None:
    """In the forked child: run pytest, write the outcome, never return."""
    code = 70
    try:
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.environ["VLLM_OVERLAY_SKIP_PATCHES"] = patch_id
        import pytest

        select = _Select(patch_id)
        rc = pytest.main(
            ["-q", "-p", "no:cacheprovider", "--rootdir", str(ROOT), *files],
            plugins=[select],
        )
        from vllm_overlay.core.patching import REGISTRY

        states = {s.patch.id: s.status for s in REGISTRY.states()}
        result.write_text(
            json.dumps(
                {
                    "rc": int(rc),
                    "selected": select.selected,
                    "outcomes": select.outcomes,
                    "states": states,
                }
            )
        )
        code = 0
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _preimport() -> None:
    """What every child would import anyway: vLLM and the patch targets."""
    import torch  # noqa: F401
    import vllm  # noqa: F401

    from vllm_overlay.core.patching import REGISTRY, import_target
    from vllm_overlay.patches import all_patches

    for module in sorted({p.module for p in all_patches()}):
        import_target(module)  # flashinfer cannot be imported: no matter
    for module in (
        "vllm.config",
        "vllm.v1.core.sched.scheduler",
        "vllm.v1.core.kv_cache_utils",
        "vllm.v1.structured_output",
        "vllm.v1.worker.utils",
        "vllm.utils.argparse_utils",
        "vllm.distributed.kv_transfer.kv_connector.factory",
        "vllm.distributed.kv_transfer.kv_connector.v1.shared_storage_connector",
        "vllm_overlay.connectors",
        "vllm_overlay.integration.cross_layer",
        "vllm_overlay.testing",
        "_pytest.pytester",
        "pytest",
    ):
        import_target(module)
    # Nothing may be patched yet: each child registers the overlay itself.
    assert not REGISTRY.states()


def main(argv: list[str]) -> int:
    out, ids = pathlib.Path(argv[0]), argv[1:]
    marks = marked_tests()
    files = {
        patch_id: sorted({str(path.relative_to(ROOT)) for path, _ in places})
        for patch_id, places in marks.items()
    }
    files[CONTROL] = sorted({f for fs in files.values() for f in fs})
    os.chdir(ROOT)
    sys.path.insert(0, str(ROOT))
    start = time.monotonic()
    _preimport()
    preimport_seconds = time.monotonic() - start
    # Children share the parent's objects: keep their garbage collector
    # from walking (and so copying) every page of them.
    gc.freeze()
    jobs = max(1, min(len(os.sched_getaffinity(0)), 4))
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="patch-tests-"))
    todo = [CONTROL, *ids]
    running: dict[int, tuple[str, float]] = {}
    report: dict[str, dict] = {}
    while todo or running:
        while todo and len(running) < jobs:
            patch_id = todo.pop(0)
            name = patch_id or "control"
            result, log = tmp / f"{name}.json", tmp / f"{name}.log"
            if not files.get(patch_id):
                report[name] = {
                    "rc": None,
                    "selected": [],
                    "outcomes": {},
                    "states": {},
                    "log": "no test is marked",
                }
                continue
            pid = os.fork()
            if pid == 0:
                _child(patch_id, files[patch_id], result, log)
            running[pid] = patch_id, time.monotonic()
        if not running:
            continue
        pid, status = os.wait()
        patch_id, started = running.pop(pid)
        name = patch_id or "control"
        result, log = tmp / f"{name}.json", tmp / f"{name}.log"
        entry = json.loads(result.read_text()) if result.exists() else {"rc": None}
        entry["exit_status"] = status
        entry["seconds"] = round(time.monotonic() - started, 1)
        entry["log"] = log.read_text()[-6000:] if log.exists() else ""
        report[name] = entry
    shutil.rmtree(tmp, ignore_errors=True)
    out.write_text(
        json.dumps(
            {
                "files": files,
                "ids": ids,
                "seconds": time.monotonic() - start,
                "preimport_seconds": preimport_seconds,
                "children": report,
            },
            indent=1,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
