"""The version gate on vLLM 0.33 (``.venv-0.33``): the v0_33 set runs
where each feature's upstream files are the tested ones, feature by
feature; the CPU-platform features are refused (no CPU build of 0.33);
the pool tier and the PP budget are accepted."""

from __future__ import annotations

import json
import shutil

import pytest

from vllm_overlay import configured, features, version_gate
from vllm_overlay.testing import tiny_model_path

POOL_LINE = features.POOL_TIER_032
PP_ARGS = {
    "pipeline_parallel_size": 2,
    "additional_config": {"enable_pp_prop_kv_cache": True},
}


def _kv(line: str) -> dict:
    return json.loads(line.split("--kv-transfer-config '", 1)[1].rsplit("'", 1)[0])


@pytest.fixture(autouse=True)
def overlay():
    import vllm_overlay

    assert vllm_overlay.register() == "applied"


@pytest.fixture
def refused_here():
    """The per-feature gate's answers, restored after the test."""
    before = dict(version_gate.REFUSED_HERE)
    yield version_gate.REFUSED_HERE
    version_gate.REFUSED_HERE.clear()
    version_gate.REFUSED_HERE.update(before)


def test_the_installed_0_33_runs_both_features_as_tested():
    version = version_gate.installed_vllm_version()
    assert version_gate.release_entry(version) == "0.33.x"
    assert version_gate.RELEASES["0.33.x"] == "v0_33"
    found = version_gate.check_installed_release("0.33.x", version)
    assert found == (
        "pool_tier: vLLM 0.33.0 (sdist); pp_prop_kv_cache: vLLM 0.33.0 (sdist)"
    )
    assert not version_gate.REFUSED_HERE
    from vllm_overlay.core.patching import REGISTRY

    states = {s.patch.id: s.status for s in REGISTRY.states()}
    assert set(states) == {
        *("PT32-01", "KI32-01", "KI32-02", "KI32-03"),  # pool tier
        *("PP32-01", "PP32-02", "PP32-03", "PP33-04"),  # PP budget
    }


def test_the_record_groups_the_files_by_feature_callers_included():
    record = version_gate.release_record("v0_33")
    assert record["reference"] == "0.33.0"
    pool, pp = record["features"]["pool_tier"], record["features"]["pp_prop_kv_cache"]
    for caller in (
        "vllm/v1/kv_offload/tiering/manager.py",
        "vllm/v1/kv_offload/tiering/factory.py",
        "vllm/v1/kv_offload/tiering/backpressure.py",
        "vllm/v1/kv_offload/tiering/metrics.py",
        "vllm/v1/kv_offload/config.py",
        "vllm/distributed/kv_transfer/kv_connector/v1/offloading_connector.py",
        # issue 39: the chunk layout, the namespace's hashes, callers of callers
        "vllm/v1/kv_offload/cpu/gpu_worker.py",
        "vllm/v1/kv_offload/cpu/shared_offload_region.py",
        "vllm/v1/kv_offload/cpu/spec.py",
        "vllm/config/model.py",
        "vllm/config/cache.py",
        "vllm/config/lora.py",
        "vllm/config/utils.py",
        "vllm/v1/attention/backends/cpu_attn.py",
        "vllm/v1/core/kv_cache_utils.py",
        "vllm/distributed/kv_transfer/kv_connector/v1/offloading/common.py",
        "vllm/distributed/kv_transfer/kv_connector/v1/base.py",
    ):
        assert caller in pool
    for caller in (
        "vllm/v1/core/kv_cache_planning.py",
        "vllm/v1/core/kv_cache_config_builder.py",
        "vllm/v1/engine/core.py",
        "vllm/engine/arg_utils.py",
        "vllm/v1/worker/gpu_worker.py",
    ):
        assert caller in pp
    assert set(pool) | set(pp) == set(record["touched"])


def _copy_touched(tmp_path, record) -> tuple:
    """The installed vLLM's touched files, copied under tmp_path/vllm."""
    installed = version_gate.installed_vllm_dir()
    for rel in record["touched"]:
        target = tmp_path / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(installed.parent / rel, target)
    return tmp_path / "vllm"


def test_a_changed_pool_tier_file_refuses_the_pool_tier_alone(
    tmp_path, monkeypatch, refused_here
):
    """A 0.33 whose tiering manager differs (a patch release, a local
    change): the pool tier is refused, naming the file; the PP budget
    runs; only the pool tier's patch is left out."""
    record = version_gate.release_record("v0_33")
    folder = _copy_touched(tmp_path, record)
    manager = folder.parent / "vllm/v1/kv_offload/tiering/manager.py"
    manager.write_text(manager.read_text() + "\n# changed\n")
    monkeypatch.setattr(version_gate, "installed_vllm_dir", lambda: folder)
    version = version_gate.installed_vllm_version()
    found = version_gate.check_installed_release("0.33.x", version)
    assert found == (
        "pool_tier: refused (vllm/v1/kv_offload/tiering/manager.py differ); "
        "pp_prop_kv_cache: vLLM 0.33.0 (sdist)"
    )
    assert not version_gate.feature_runs_on("pool_tier", version)
    assert version_gate.feature_runs_on("pp_prop_kv_cache", version)
    error = configured.engine_refusal(
        {"kv_transfer_config": _kv(POOL_LINE)}, version, on_cpu=False
    )
    assert error is not None
    message = str(error)
    assert (
        "secondary_tiers module_path 'vllm_overlay.integration.v0_32.pool_tier'"
        in message
    )
    assert "byte-identical to the tested vLLM 0.33.0's" in message
    assert "differ: vllm/v1/kv_offload/tiering/manager.py" in message
    assert configured.engine_refusal(PP_ARGS, version, on_cpu=False) is None
    from vllm_overlay.patches import refused_patches

    # the pool tier's patches only (patch_engine_core's PP33-04 still runs)
    assert set(refused_patches("0.33.x")) == {
        "PT32-01",
        "KI32-01",
        "KI32-02",
        "KI32-03",
    }
    # Unchanged files again: both run.
    manager.write_text(manager.read_text().removesuffix("\n# changed\n"))
    refused_here.clear()
    assert "refused" not in version_gate.check_installed_release("0.33.x", version)


RECORD = version_gate.release_record("v0_33")


@pytest.fixture(scope="module")
def installed_copy(tmp_path_factory):
    """The installed 0.33's listed files, once for the tests below."""
    return _copy_touched(tmp_path_factory.mktemp("vllm033"), RECORD)


@pytest.mark.parametrize("rel", list(RECORD["touched"]))
def test_each_listed_file_changed_refuses_the_features_listing_it(
    installed_copy, monkeypatch, refused_here, rel
):
    """Every file of the record, changed in a copy of the installed 0.33:
    the features whose files list it are refused, naming it (their patches
    left out), the others run; unchanged again, all run."""
    monkeypatch.setattr(version_gate, "installed_vllm_dir", lambda: installed_copy)
    version = version_gate.installed_vllm_version()
    path = installed_copy.parent / rel
    original = path.read_bytes()
    path.write_bytes(original + b"\n# changed\n")
    try:
        found = version_gate.check_installed_release("0.33.x", version)
    finally:
        path.write_bytes(original)
    features = RECORD["features"]
    expected = sorted(f for f, files in features.items() if rel in files)
    assert expected
    assert sorted(refused_here) == expected
    for feature in features:
        if feature in expected:
            assert f"{feature}: refused ({rel} differ)" in found
            assert not version_gate.feature_runs_on(feature, version)
        else:
            assert f"{feature}: vLLM 0.33.0 (sdist)" in found
            assert version_gate.feature_runs_on(feature, version)
    from vllm_overlay.patches import refused_patches, v0_33

    refused_ids = {
        p.id
        for f in expected
        for m in v0_33.FEATURES[f]
        for p in m.PATCHES
        if p.id in getattr(m, "FEATURE_PATCHES", {}).get(f, (p.id,))
    }
    assert set(refused_patches("0.33.x")) == refused_ids
    refused_here.clear()
    assert "refused" not in version_gate.check_installed_release("0.33.x", version)


def test_the_pool_tier_and_the_pp_flag_are_accepted_on_a_0_33_gpu():
    """The README's lines, on 0.33 off the CPU platform (a GPU)."""
    version = version_gate.installed_vllm_version()
    pool = {"kv_transfer_config": _kv(POOL_LINE)}
    assert configured.engine_refusal(pool, version, on_cpu=False) is None
    assert configured.engine_refusal(PP_ARGS, version, on_cpu=False) is None
    # the pool tier module loads (it refuses to on a release it does not run on)
    from vllm_overlay.integration.v0_32.pool_tier import SharedPoolTier

    assert SharedPoolTier.__name__ == "SharedPoolTier"


def _front_end(monkeypatch, **kwargs):
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(
        model=tiny_model_path(), dtype="float32", max_model_len=512, **kwargs
    ).create_engine_config()


def test_host_offloading_on_0_33s_cpu_platform_is_refused_with_its_reason(monkeypatch):
    """In 0.33's own front end (create_engine_config, the plugin loaded) on
    its CPU platform: upstream's OffloadingConnector would need the
    overlay's CPU worker, which never ran on 0.33."""
    from vllm.config import KVTransferConfig

    config = KVTransferConfig(**_kv(features.HOST_OFFLOAD_032))
    with pytest.raises(version_gate.UnsupportedVLLMVersion) as refused:
        _front_end(monkeypatch, kv_transfer_config=config)
    message = str(refused.value)
    assert message.startswith(
        "kv_connector 'OffloadingConnector' on the CPU platform: this overlay "
        "feature runs on vLLM 0.32.x only; found vLLM 0.33.0"
    )
    assert "no CPU build of vLLM 0.33.x exists" in message
    monkeypatch.setenv("VLLM_KV_CACHE_LAYOUT", "BLHNC")
    with pytest.raises(version_gate.UnsupportedVLLMVersion, match="no CPU build"):
        _front_end(monkeypatch)


def test_0_11_2s_connectors_on_0_33_name_upstreams_way():
    error = configured.engine_refusal(
        {"kv_transfer_config": {"kv_connector": "SharedKVPoolConnector"}},
        version_gate.installed_vllm_version(),
        on_cpu=False,
    )
    message = str(error)
    assert "runs on vLLM 0.11.2 only; found vLLM 0.33.0" in message
    assert "the pool tier: upstream's OffloadingConnector" in message


def test_doctor_says_what_runs_on_0_33_and_how_far_it_was_checked():
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-m", "vllm_overlay", "doctor"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    report = done.stdout
    assert "register()   will be: applied" in report, report + done.stderr
    features_at = report.index("features on vLLM 0.33.0")
    listed = report[features_at:].split("\n\n", 1)[0].splitlines()[1:]
    names = [line.split("  ")[1] for line in listed if not line.startswith("  (")]
    assert names == ["shared KV pool", "PP KV budget"]
    notes = [line.strip() for line in listed if line.startswith("  (")]
    assert notes == [f"({note})" for note in features.NOTES["v0_33"]]
    assert "never run in a 0.33 GPU engine" in notes[0]
    assert "refused, no CPU build of vLLM 0.33 exists" in notes[1]
    for patch_id in ("PT32-01", "PP32-01", "PP32-02", "PP32-03", "PP33-04"):
        assert f"  {patch_id}  " in report


def test_0_33s_front_end_takes_the_pool_tier_as_on_a_gpu(monkeypatch):
    """0.33's create_engine_config with the plugin loaded, the platform
    question answered as on a GPU: the README's pool line is accepted
    (the tier's options checked in the front end, as on 0.32), and a bad
    option is refused there by name."""
    from vllm.config import KVTransferConfig

    monkeypatch.setattr(configured, "on_cpu_platform", lambda: False)
    pool = _kv(POOL_LINE)
    config = _front_end(monkeypatch, kv_transfer_config=KVTransferConfig(**pool))
    (tier,) = config.kv_transfer_config.kv_connector_extra_config["secondary_tiers"]
    assert tier["module_path"] == "vllm_overlay.integration.v0_32.pool_tier"
    bad = _kv(POOL_LINE)
    bad["kv_connector_extra_config"]["secondary_tiers"][0]["no_such_option"] = 1
    with pytest.raises(ValueError, match="no_such_option"):
        _front_end(monkeypatch, kv_transfer_config=KVTransferConfig(**bad))
