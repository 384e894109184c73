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


@pytest.mark.parametrize("patch_set", ["v0_32", "v0_33"])
def test_record_is_current(patch_set):
    record = _record(patch_set)
    _cached_or_fail(release_compat.SETS[patch_set], *record["releases"])
    script = str(TOOLS / "release_compat.py")
    done = subprocess.run(
        [sys.executable, script, "--set", patch_set, "--check", "--offline"],
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


# -- issue 39, item 4: every file that decides the bytes or their identity ----------
# The files the review found missing, per record and feature: the host
# chunk layout, the region and the spec that build it, the compute_hash
# files PT32-01 reads (the pool's namespace), the aggregate OF32-06 relies
# on, the connector base and utils, the tier factory, the block hashes, and
# CPU_ATTN's ISA choice (the pool's identity reads it).
IDENTITY = {
    "vllm/config/model.py",
    "vllm/config/cache.py",
    "vllm/config/lora.py",
    "vllm/config/utils.py",
}
LAYOUT = {
    "vllm/v1/kv_offload/cpu/gpu_worker.py",
    "vllm/v1/kv_offload/cpu/shared_offload_region.py",
    "vllm/v1/kv_offload/cpu/spec.py",
    "vllm/v1/attention/backends/cpu_attn.py",
    "vllm/v1/core/kv_cache_utils.py",
}
CALLERS = {
    "vllm/distributed/kv_transfer/kv_connector/v1/offloading/common.py",
    "vllm/distributed/kv_transfer/kv_connector/v1/base.py",
    "vllm/distributed/kv_transfer/kv_connector/utils.py",
    "vllm/v1/kv_offload/tiering/factory.py",
}
REQUIRED = {
    ("v0_32", None): IDENTITY | LAYOUT | CALLERS,
    ("v0_33", "pool_tier"): IDENTITY | LAYOUT | CALLERS,
}


def _record(patch_set: str) -> dict:
    return json.loads(
        (ROOT / "vllm_overlay" / "patches" / patch_set / "releases.json").read_text()
    )


@pytest.mark.parametrize(("patch_set", "feature"), sorted(REQUIRED, key=str))
def test_each_record_lists_every_file_that_decides_the_bytes(patch_set, feature):
    record = _record(patch_set)
    listed = record["features"][feature] if feature else record["touched"]
    assert sorted(REQUIRED[patch_set, feature] - set(listed)) == []
    # every listed file says why it is there
    assert set(record["why"]) == set(record["touched"])
    assert all(record["why"][rel].strip() for rel in record["touched"])


@pytest.mark.parametrize("patch_set", ["v0_32", "v0_33"])
def test_callers_of_callers_are_derived_not_only_listed(patch_set):
    """Files no hand list names are found from the reference sdist: the
    offloading modules the touched ones import, and what compute_hash
    calls; each with the file that leads to it."""
    version = release_compat.SETS[patch_set]
    _cached_or_fail(version)
    reference = release_compat._sdist(version, offline=True)
    release_compat.select(patch_set)
    try:
        if patch_set == "v0_33":
            why = release_compat.feature_files(reference, patch_set, "pool_tier")
        else:
            why = release_compat.touched_files(reference)
    finally:
        release_compat.select("v0_32")
    hand = set(release_compat.RELIED_ON)
    for spec in release_compat.FEATURE_SOURCES.values():
        hand |= set(spec["relied_on"])
    derived = {
        "vllm/distributed/kv_transfer/kv_connector/utils.py": "imported by vllm/"
        "distributed/kv_transfer/kv_connector/v1/offloading/scheduler.py",
        "vllm/config/utils.py": "defines get_hash_factors, called by vllm/config/",
        "vllm/utils/hashing.py": "defines safe_hash, called by vllm/config/lora.py",
        "vllm/v1/kv_offload/cpu/host_register.py": "imported by vllm/v1/kv_offload/",
    }
    for rel, reason in derived.items():
        assert rel not in hand
        assert why[rel].startswith(reason), (rel, why[rel])
    # not "all of vllm": nothing outside the followed packages comes from
    # the import walk, and the list stays small
    walked = [rel for rel, reason in why.items() if "(runs with it)" in reason]
    assert all(
        rel.startswith(("vllm/v1/kv_offload/", "vllm/distributed/kv_transfer/"))
        or rel == "vllm/v1/core/kv_cache_utils.py"
        for rel in walked
    )
    assert len(why) < 60


def test_check_names_what_differs():
    """``--check`` of a stale record says what moved, per feature."""
    committed = _record("v0_33")
    stale = json.loads(json.dumps(committed))
    gpu_worker = "vllm/v1/kv_offload/cpu/gpu_worker.py"
    stale["features"]["pool_tier"].remove(gpu_worker)
    del stale["touched"][gpu_worker]
    manager = "vllm/v1/kv_offload/tiering/manager.py"
    stale["touched"][manager] = "0" * 64
    lines = release_compat.record_diff.differences(stale, committed)
    old, new = "0" * 12, committed["touched"][manager][:12]
    assert lines == [
        f"feature pool_tier: + {gpu_worker} ({committed['why'][gpu_worker]})",
        f"touched: {manager}: sha256 {old} -> {new}",
    ]
    assert release_compat.record_diff.differences(committed, committed) == []


# -- the gate on a copy with one listed file changed --------------------------------
ENTRY = {"v0_32": ("0.32.x", "0.32.0"), "v0_33": ("0.33.x", "0.33.0")}
LISTED = [(s, rel) for s in ENTRY for rel in _record(s)["touched"]]


@pytest.fixture(scope="module")
def sdist_copies(tmp_path_factory) -> dict[str, pathlib.Path]:
    """Each set's listed files from its reference sdist, byte for byte,
    under a ``vllm`` folder (what the gate reads of an installed vLLM)."""
    copies = {}
    for patch_set in ENTRY:
        record = _record(patch_set)
        _cached_or_fail(record["reference"])
        reference = release_compat._sdist(record["reference"], offline=True)
        root = tmp_path_factory.mktemp(patch_set)
        for rel in record["touched"]:
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            (root / rel).write_bytes(reference.read(rel))
        copies[patch_set] = root / "vllm"
    return copies


@pytest.fixture
def gate(monkeypatch):
    from vllm_overlay import version_gate

    before = dict(version_gate.REFUSED_HERE)
    yield version_gate
    version_gate.REFUSED_HERE.clear()
    version_gate.REFUSED_HERE.update(before)


@pytest.mark.parametrize(
    ("patch_set", "rel"), LISTED, ids=[f"{s}:{r}" for s, r in LISTED]
)
def test_a_changed_listed_file_refuses_its_feature_alone(
    sdist_copies, gate, monkeypatch, patch_set, rel
):
    """The reference sdist's files pass the gate; with REL changed, the
    gate refuses the features whose files list it (the whole set where the
    record does not group them), naming REL, and runs the others."""
    folder = sdist_copies[patch_set]
    monkeypatch.setattr(gate, "installed_vllm_dir", lambda: folder)
    entry, version = ENTRY[patch_set]
    record = _record(patch_set)
    path = folder.parent / rel
    original = path.read_bytes()
    path.write_bytes(original + b"\n# changed by a patch release\n")
    try:
        if "features" not in record:
            with pytest.raises(gate.UnsupportedVLLMVersion) as refused:
                gate.check_installed_release(entry, version)
            assert f"these installed files differ: {rel} (in {folder})" in str(
                refused.value
            )
            return
        found = gate.check_installed_release(entry, version)
    finally:
        path.write_bytes(original)
    features = record["features"]
    expected = sorted(f for f, files in features.items() if rel in files)
    assert sorted(gate.REFUSED_HERE) == expected
    for feature in features:
        if feature in expected:
            assert f"{feature}: refused ({rel} differ)" in found
            assert f"differ: {rel} (in {folder})" in gate.REFUSED_HERE[feature][1]
        else:
            assert f"{feature}: vLLM {version} (sdist)" in found
    gate.REFUSED_HERE.clear()
    assert "refused" not in gate.check_installed_release(entry, version)


class _Tree:
    """A reader over a few files (what upstream_follow reads of an sdist)."""

    def __init__(self, files: dict[str, str]) -> None:
        self.files = {rel: text.encode() for rel, text in files.items()}

    def read(self, rel):
        return self.files.get(rel)

    def module_file(self, module):
        base = module.replace(".", "/")
        return next(
            (r for r in (f"{base}.py", f"{base}/__init__.py") if r in self.files), None
        )


def test_the_walks_leave_out_type_only_imports_and_follow_re_exports():
    follow = release_compat.upstream_follow
    tree = _Tree(
        {
            "vllm/kv/__init__.py": "from vllm.kv.real import Spec\n",
            "vllm/kv/real.py": "from vllm.kv import helper\n",
            "vllm/kv/helper.py": "",
            "vllm/kv/sibling.py": "",
            "vllm/kv/typed.py": "",
            "vllm/kv/user.py": "from typing import TYPE_CHECKING\n"
            "from vllm.kv import Spec\n"
            "if TYPE_CHECKING:\n    from vllm.kv.typed import T\n"
            "def f():\n    from vllm.other import x\n",
            "vllm/other.py": "",
            "vllm/cfg.py": "from vllm.hashing import digest\n"
            "class C:\n    def compute_hash(self):\n        return digest(self._f())\n"
            "    def _f(self):\n        from vllm.util import factors\n"
            "        return factors(self)\n",
            "vllm/hashing.py": "def digest(x):\n    return x\n",
            "vllm/util.py": "def factors(c):\n    return 1\n",
        }
    )
    found = follow.follow_modules(tree, ["vllm/kv/user.py"], ("vllm.kv",))
    assert found == {
        "vllm/kv/real.py": "imported by vllm/kv/user.py (runs with it)",
        "vllm/kv/helper.py": "imported by vllm/kv/real.py (runs with it)",
    }
    found = follow.follow_functions(tree, {"vllm/cfg.py:C.compute_hash": "id"})
    assert found == {
        "vllm/hashing.py": "defines digest, called by vllm/cfg.py:C.compute_hash",
        "vllm/util.py": "defines factors, called by vllm/cfg.py:C._f",
    }
