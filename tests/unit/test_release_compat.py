"""patches/tools/release_compat.py: the upstream files the v0_32 set
touches, compared byte for byte between vLLM 0.32.0 and later releases
(the record version_gate reads)."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
TOOLS = ROOT / "patches" / "tools"
sys.path.insert(0, str(TOOLS))
import fetch_sdist  # noqa: E402
import release_compat  # noqa: E402


def _cached_or_fail(*versions: str) -> None:
    """The harness set-up (scripts/harness/fetch_sdists.sh) fetches these
    sdists: one missing here is a broken set-up, not a reason to skip."""
    missing = [v for v in versions if fetch_sdist.cached(v) is None]
    if missing:
        fixes = "; ".join(
            f"{sys.executable} patches/tools/fetch_sdist.py --version {v}"
            for v in missing
        )
        pytest.fail(
            f"vLLM sdists {missing} not cached in {fetch_sdist.cache_dir()} "
            f"(bash scripts/setup_env.sh fetches them); run: {fixes}",
            pytrace=False,
        )


def test_record_is_current():
    record = json.loads(release_compat.RECORD.read_text())
    _cached_or_fail(release_compat.REFERENCE, *record["releases"])
    done = subprocess.run(
        [sys.executable, str(TOOLS / "release_compat.py"), "--check", "--offline"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_touched_files_are_the_targets_and_every_vllm_import():
    """Every Patch.module of the set's MODULES, and the vllm modules the
    set's code imports, those inside functions included."""
    _cached_or_fail(release_compat.REFERENCE)
    reference = release_compat._sdist(release_compat.REFERENCE, offline=True)
    touched = release_compat.touched_files(reference)
    for module in release_compat.patch_targets():
        assert reference.module_file(module) in touched
    # imported inside the patched function, not at module level
    assert "vllm/v1/kv_offload/tiering/spec.py" in touched
    # imported by the integration code
    assert "vllm/v1/kv_offload/base.py" in touched
    assert set(touched) == set(json.loads(release_compat.RECORD.read_text())["touched"])


def test_overlay_files_follow_core_imports():
    files = {str(p.relative_to(ROOT)) for p in release_compat.overlay_files()}
    assert "vllm_overlay/integration/v0_32/offload_worker.py" in files
    assert "vllm_overlay/core/ops/block_copy.py" in files  # followed
    assert "vllm_overlay/core/ops/triton_kernels.py" in files  # lazily, inside


def test_files_the_overlay_relies_on_without_importing_them_are_touched():
    """Upstream code the overlay never imports but depends on (a caller's
    contract, a layout, a queue) is in the record: a release that changes
    it is not admitted as identical, and an installed copy that differs is
    refused at startup."""
    relied = {
        "vllm/v1/kv_offload/tiering/manager.py",  # drain contract
        "vllm/distributed/kv_transfer/kv_connector/v1/offloading/worker.py",
        "vllm/distributed/kv_transfer/kv_connector/v1/offloading/config.py",
        "vllm/v1/kv_offload/cpu/gpu_worker.py",  # host chunk layout
        "vllm/v1/core/sched/scheduler.py",  # the queues idle_wait reads
    }
    assert relied <= set(release_compat.RELIED_ON)
    assert all(release_compat.RELIED_ON[rel] for rel in relied)  # each says why
    record = json.loads(release_compat.RECORD.read_text())
    assert relied <= set(record["touched"])
    _cached_or_fail(release_compat.REFERENCE)
    reference = release_compat._sdist(release_compat.REFERENCE, offline=True)
    assert relied <= set(release_compat.touched_files(reference))


def test_a_missing_sdist_fails_with_the_command_that_fetches_it(tmp_path, monkeypatch):
    """No silent skip on a machine whose set-up did not fetch the sdists."""
    monkeypatch.setenv("VLLM_OVERLAY_SDIST_CACHE", str(tmp_path))
    with pytest.raises(pytest.fail.Exception) as failed:
        _cached_or_fail(release_compat.REFERENCE)
    message = str(failed.value)
    assert f"fetch_sdist.py --version {release_compat.REFERENCE}" in message
    assert str(tmp_path) in message
