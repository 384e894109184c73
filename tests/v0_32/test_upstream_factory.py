"""vLLM 0.32's offloading-spec factory and ``TieringOffloadingSpec.create_worker``
with the overlay, as upstream's own tests use them (issue 27, point 10).

* Every spec registered with upstream's ``OffloadingSpecFactory`` loads as
  an ``OffloadingSpec`` (upstream's ``test_pre_registered_specs_can_be_imported``
  assumes it), the overlay's refusal stub for ``OverlayCPUOffloadingSpec``
  (0.11.2's spec) included; the stub refuses when it is built or asked for
  its metrics, naming the spec and the release it runs on.
* OF32-02 replaces only the worker ``create_worker`` builds (the name
  ``CPUOffloadingWorker`` of upstream's module): substituting upstream's
  module names, as upstream's tests do, reaches upstream's method.
* vLLM 0.32.0's own ``tests/v1/kv_offload/test_factory.py`` (from the cached
  sdist, ``patches/tools/fetch_sdist.py``) gives the same results with the
  overlay as without it.
"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys
import tarfile
from unittest.mock import MagicMock

import pytest

import vllm_overlay

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "patches" / "tools"))
import fetch_sdist  # noqa: E402

UPSTREAM_TEST = "tests/v1/kv_offload/test_factory.py"
LOAD_PLUGINS = '''\
"""pytest plugin: load vLLM's general plugins first, as an engine does."""
from vllm.plugins import load_general_plugins

load_general_plugins()
'''


@pytest.fixture(scope="module", autouse=True)
def overlay():
    assert vllm_overlay.register() == "applied"


def test_every_registered_spec_loads_and_the_stub_refuses_when_used():
    from vllm.v1.kv_offload.base import OffloadingSpec
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory

    from vllm_overlay.version_gate import UnsupportedVLLMVersion

    assert "OverlayCPUOffloadingSpec" in OffloadingSpecFactory._registry
    for name, load in OffloadingSpecFactory._registry.items():
        assert issubclass(load(), OffloadingSpec), name
    stub = OffloadingSpecFactory.get_spec_cls({"spec_name": "OverlayCPUOffloadingSpec"})
    assert stub.__name__ == "OverlayCPUOffloadingSpec"
    named = "spec_name 'OverlayCPUOffloadingSpec'.*on vLLM 0.11.2 only"
    with pytest.raises(UnsupportedVLLMVersion, match=named):
        stub(MagicMock())
    with pytest.raises(UnsupportedVLLMVersion, match=named):
        stub.build_metric_definitions({})


def _tiering_spec(rank: int, world: int):
    from vllm.v1.kv_offload.config import (
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingGroupConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )
    from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

    config = OffloadingConfig(
        groups=(OffloadingGroupConfig(16, ("l0",), 0),),
        worker_kv_bytes_per_block=4096,
        enable_kv_cache_events=False,
        extra_config={"cpu_bytes_to_use": 8 * 4096 * world},
        engine_id="overlay-test-names",
        model=OffloadingModelConfig("tiny", "float32"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(
            rank, world, world, 1, 1, 1, 0, 1, None, True
        ),
    )
    return TieringOffloadingSpec(config)


def test_create_worker_is_upstreams_and_builds_through_its_module(monkeypatch):
    import vllm.v1.kv_offload.tiering.spec as tiering

    from vllm_overlay.patches.v0_32.patch_tiering_spec import cpu_platform_worker

    # Only the worker is the overlay's; create_worker is upstream's method.
    assert tiering.CPUOffloadingWorker is cpu_platform_worker
    assert "vllm_overlay" not in tiering.TieringOffloadingSpec.create_worker.__module__
    regions, workers = [], []
    monkeypatch.setattr(
        tiering, "SharedOffloadRegion", lambda **kw: regions.append(kw) or "region"
    )
    monkeypatch.setattr(
        tiering, "CPUOffloadingWorker", lambda **kw: workers.append(kw) or "worker"
    )
    kv = MagicMock()
    assert _tiering_spec(rank=1, world=4).create_worker(kv) == "worker"
    assert regions[0]["rank"] == 1
    assert workers == [
        {
            "kv_caches": kv,
            "blocks_per_chunk": 1,
            "num_cpu_chunks": regions[0]["num_chunks"],
            "mmap_region": "region",
            "canonical_layout": False,
        }
    ]


def _outcomes(report: str) -> dict[str, str]:
    return dict(
        (m.group(2), m.group(1))
        for m in re.finditer(r"^(PASSED|FAILED|ERROR|SKIPPED)\S* (\S+)", report, re.M)
    )


def test_upstream_test_factory_gives_the_same_results_with_the_overlay(tmp_path):
    sdist = fetch_sdist.cache_dir() / "vllm-0.32.0.tar.gz"
    if not sdist.is_file():
        pytest.fail(
            f"no cached vLLM 0.32.0 sdist ({sdist}); run python "
            "patches/tools/fetch_sdist.py --version 0.32.0",
            pytrace=False,
        )
    with tarfile.open(sdist) as tar:
        member = tar.getmember(f"vllm-0.32.0/{UPSTREAM_TEST}")
        text = tar.extractfile(member).read()
    test = tmp_path / UPSTREAM_TEST
    test.parent.mkdir(parents=True)
    test.write_bytes(text)
    for folder in (test.parent, test.parents[1], test.parents[2]):
        (folder / "__init__.py").touch()
    (tmp_path / "load_plugins.py").write_text(LOAD_PLUGINS)
    (tmp_path / "pytest.ini").write_text("[pytest]\n")

    def run(**env: str) -> dict[str, str]:
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "pytest",
                "-rA",
                "-q",
                "-p",
                "no:cacheprovider",
                "--noconftest",
                "-p",
                "load_plugins",
                UPSTREAM_TEST,
            ],
            cwd=tmp_path,
            env={**os.environ, "PYTHONPATH": str(tmp_path), **env},
            capture_output=True,
            text=True,
            timeout=600,
        )
        outcomes = _outcomes(proc.stdout)
        assert outcomes, proc.stdout + proc.stderr
        return outcomes

    with_overlay = run()
    without = run(VLLM_PLUGINS="")  # no plugin loads: stock vLLM 0.32
    assert with_overlay == without
    assert set(without.values()) == {"PASSED"}, without
    assert len(without) >= 40
