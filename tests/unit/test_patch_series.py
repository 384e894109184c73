"""patches/: the upstream-style series applies to vLLM 0.11.2 and is in step
with the runtime patches it mirrors."""

from __future__ import annotations

import importlib.util
import pathlib
import py_compile
import shutil
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
PATCHES = ROOT / "patches"


def series() -> list[pathlib.Path]:
    return [
        PATCHES / line.strip()
        for line in (PATCHES / "series").read_text().splitlines()
        if line.strip()
    ]


def test_every_diff_is_in_the_series_and_mapped_in_the_readme():
    listed = {p.name for p in series()}
    on_disk = {p.name for p in PATCHES.glob("*/*.patch")}
    assert listed == on_disk
    readme = (PATCHES / "README.md").read_text()
    for name in listed:
        assert name in readme, f"{name} is not mapped in patches/README.md"


def test_series_applies_to_the_installed_vllm_sources(tmp_path):
    site = pathlib.Path(importlib.util.find_spec("vllm").origin).parents[1]
    targets = []
    for diff in series():
        for line in diff.read_text().splitlines():
            if line.startswith("+++ b/"):
                targets.append(line[len("+++ b/") :])
    for target in targets:
        if (site / target).exists():
            (tmp_path / target).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(site / target, tmp_path / target)
    for diff in series():
        subprocess.run(
            ["git", "apply", "-p1", str(diff)],
            cwd=tmp_path,
            check=True,
            capture_output=True,
        )
    for target in targets:
        py_compile.compile(str(tmp_path / target), doraise=True)


# hand-written series -> the e2e test that runs its scenario in the overlay
# and on the patched tree (overlay disabled) and compares the outcomes
BOTH_WAYS = {
    "cross-layer": "test_patched_vllm_equals_the_overlay",
    "kv-pressure": "test_kv_pressure_scenarios_schedule_the_same_both_ways",
    "pp-kv-budget": "test_patched_vllm_splits_the_pp_budget_like_the_overlay",
}


def test_every_hand_written_series_has_a_both_ways_test():
    """The series not generated from the runtime are held to it by
    behaviour: tests/e2e/test_patch_series_e2e.py runs each one's scenario
    both ways."""
    generated = set(_generator().SERIES)
    hand_written = {p.parent.name for p in series()} - generated
    assert hand_written == set(BOTH_WAYS)
    e2e = (ROOT / "tests/e2e/test_patch_series_e2e.py").read_text()
    for name in BOTH_WAYS.values():
        assert f"def {name}(" in e2e


def _generator():
    spec = importlib.util.spec_from_file_location(
        "patches_generate", PATCHES / "generate.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_generated_series_are_current():
    """offloading/ and shared-pool/ are written by patches/generate.py from
    the runtime modules: a module changed without its diff fails here."""
    generator = _generator()
    rendered = generator.render()
    code = {p for p in rendered if generator.TEST_DIFF not in p.name}
    assert {p.parent.name for p in code} == set(generator.SERIES)
    for path, text in rendered.items():
        assert path.read_text() == text, (
            f"{path.relative_to(ROOT)} is stale: python patches/generate.py"
        )


def test_readme_lists_every_pull_request():
    """patches/README.md's PR section is build_mbox.py --markdown."""
    done = subprocess.run(
        [sys.executable, str(PATCHES / "tools" / "build_mbox.py"), "--markdown"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert done.stdout in (PATCHES / "README.md").read_text(), (
        "patches/README.md is stale: paste python patches/tools/build_mbox.py "
        "--markdown between its markers"
    )
