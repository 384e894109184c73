"""The patch catalogue is complete, in sync, and every patch is tested."""

from __future__ import annotations

import pathlib
import re

from vllm_overlay.catalogue import render_markdown
from vllm_overlay.patches import MODULES, all_patches

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_patches_md_is_generated_from_the_code():
    assert (ROOT / "PATCHES.md").read_text() == render_markdown(), (
        "regenerate: python -m vllm_overlay catalogue > PATCHES.md")


def test_ids_unique_and_one_file_per_upstream_module():
    ids = [p.id for p in all_patches()]
    assert len(ids) == len(set(ids))
    upstream = [m.MODULE for m in MODULES]
    assert len(upstream) == len(set(upstream))
    for module in MODULES:
        assert module.__name__.rsplit(".", 1)[1].startswith("patch_")
        assert all(p.module == module.MODULE for p in module.PATCHES)


def test_every_patch_is_named_by_a_test():
    """Each patch id appears in a test that exercises its behaviour.

    (CL-09/CL-10 are proven end to end; CL-06 is also switched off there.)
    """
    text = "\n".join(p.read_text() for p in (ROOT / "tests").rglob("test_*.py")
                     if p.name != "test_catalogue.py")
    behaviour = {
        "CL-01": "test_unsupported_backend_says_so",
        "CL-02": "FlashAttentionBackend",
        "CL-03": "test_flashinfer_order",
        "CL-04": "TritonMLABackend",
        "CL-05": "DeepseekV32IndexerBackend",
        "CL-06": "CPUAttentionBackend",
        "CL-07": "does not prefer cross-layer blocks",
        "CL-08": "connector_registered\"] == \"cross-layer\"",
        "CL-09": "assert_cross_layer_active",
        "CL-10": "connector_registered",
        "PP-01": "--enable-pp-prop-kv-cache\" in parser.format_help()",
        "PP-02": "AsyncEngineArgs.from_cli_args(args)",
        "PP-03": "needs --kv-cache-memory-bytes",
        "PP-04": "Worker.determine_available_memory(worker)",
        "PP-05": "test_cpu_worker_respects_kv_cache_memory_bytes",
        "KV-01": "test_kv01_stock_admits_loads_that_cannot_finish",
        "KV-02": "test_kv02_aborted_parked_request_releases_its_promise",
        "KV-03": "test_kv03_stock_scheduler_strands_it",
        "KV-04": "test_kv04_stock_schedules_it_as_new",
    }
    assert set(behaviour) == {p.id for p in all_patches()}
    for patch_id, needle in behaviour.items():
        assert needle in text, f"{patch_id}: no test mentions {needle!r}"


def test_catalogue_lists_every_patch_with_all_fields():
    md = render_markdown()
    for patch in all_patches():
        section = re.search(rf"### {patch.id}: `{re.escape(patch.target)}`"
                            r"(.*?)(?=\n### |\n## |\Z)", md, re.S)
        assert section, patch.id
        for field in ("Why:", "Upstream:", "Removal:"):
            assert field in section.group(1)
