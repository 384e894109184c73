"""The patch catalogue is complete, in sync, and every patch is tested."""

from __future__ import annotations

import pathlib
import re
import sys

from vllm_overlay.catalogue import render_markdown
from vllm_overlay.patches import all_patches, modules
from vllm_overlay.version_gate import RELEASES

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
from support import patch_tests  # noqa: E402


def test_patches_md_is_generated_from_the_code():
    assert (ROOT / "PATCHES.md").read_text() == render_markdown(), (
        "regenerate: python -m vllm_overlay catalogue > PATCHES.md"
    )


def test_ids_unique_and_one_file_per_upstream_module():
    """An id names one patch: unique in its set, and where two sets have
    it, the same Patch (a set shares an earlier set's unchanged patch)."""
    by_id = {}
    for entry in RELEASES:
        ids = [p.id for p in all_patches(entry)]
        assert len(ids) == len(set(ids))
        for patch in all_patches(entry):
            assert by_id.setdefault(patch.id, patch) is patch, patch.id
    for entry in RELEASES:
        upstream = [m.MODULE for m in modules(entry)]
        assert len(upstream) == len(set(upstream))
        for module in modules(entry):
            assert module.__name__.rsplit(".", 1)[1].startswith("patch_")
            assert all(p.module == module.MODULE for p in module.PATCHES)


def test_every_patch_has_a_test_that_fails_without_it():
    """Each patch id has tests marked ``@pytest.mark.patch_test(ID)`` that
    prove its behaviour, and test_patch_tests.py runs every id's marked
    tests with the patch skipped (they must fail) and with it (they pass).
    """
    marks = patch_tests.marked_tests()
    ids = {p.id for p in all_patches()}
    assert not set(marks) - ids, f"unknown ids: {sorted(set(marks) - ids)}"
    assert not ids - set(marks), (
        f"no test marked patch_test(ID) for {sorted(ids - set(marks))}"
    )
    # The meta-test runs unit tests only: a mark elsewhere goes unchecked.
    outside = [
        f"{path.relative_to(ROOT)}:{line}"
        for places in marks.values()
        for path, line in places
        if path.parent != ROOT / "tests" / "unit"
    ]
    assert not outside, f"marked tests outside tests/unit: {outside}"
    import test_patch_tests

    assert set(test_patch_tests.PATCH_IDS) == ids
    assert pathlib.Path(patch_tests.__file__) == test_patch_tests.DRIVER


def test_catalogue_lists_every_patch_with_all_fields():
    md = render_markdown()
    for patch in (p for entry in RELEASES for p in all_patches(entry)):
        section = re.search(
            rf"### {patch.id}: `{re.escape(patch.target)}`"
            r"(.*?)(?=\n### |\n## |\Z)",
            md,
            re.S,
        )
        assert section, patch.id
        for field in ("Why:", "Upstream:", "Removal:"):
            assert field in section.group(1)
