"""patches/latest renders the v0_32 runtime patches faithfully: the same
series rendered against vLLM 0.32.0 (where the runtime patches run, by
``stage_latest.stage``, as for the newest release), written into a copy of
the installed vLLM 0.32 (files linked, those the series adds or edits
written) and run with the overlay disabled, gives the overlay's results
byte for byte: tokens, logprobs, prefix-cache hits, the offloading worker's
copies and blocks, with upstream's OffloadingConnector and cross-layer
blocks (BLHNC) on the CPU platform."""

from __future__ import annotations

import os
import pathlib
import shutil
import sys

import pytest
from conftest import run

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "patches" / "tools"))
import check_upstream  # noqa: E402
import fetch_sdist  # noqa: E402
import latest_verify  # noqa: E402
import stage_latest  # noqa: E402

REFERENCE = "0.32.0"


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> pathlib.Path:
    """The installed vLLM with the series rendered on 0.32.0 written in."""
    import vllm

    sdist = fetch_sdist.cached(REFERENCE)
    if sdist is None:
        try:
            sdist = fetch_sdist.fetch(REFERENCE)
        except Exception as exc:  # no network: nothing to render against
            pytest.skip(f"the vLLM {REFERENCE} sdist is not at hand ({exc})")
    tmp = tmp_path_factory.mktemp("rendered")
    root = check_upstream.extract(sdist, tmp / "sdist")
    staged = stage_latest.stage(root, latest_verify.Ruff(root, install=False))
    installed = pathlib.Path(vllm.__file__).parent
    out = tmp / "tree"
    shutil.copytree(installed, out / "vllm", copy_function=os.symlink)
    for s in staged:
        target = out / s.path
        if not s.new:  # the installed file is the one the series edits
            assert (installed.parent / s.path).read_text() == (
                root / s.path
            ).read_text(), s.path
            target.unlink()
        target.write_text(s.text)
    return out


def test_the_rendered_series_runs_like_the_runtime_patches(tree):
    layout = {"VLLM_KV_CACHE_LAYOUT": "BLHNC"}
    overlay = run("run_offload.py", {"connector": True}, **layout)
    rendered = run(
        "run_offload.py",
        {"connector": True},
        **layout,
        VLLM_OVERLAY_DISABLE="1",
        PYTHONPATH=os.pathsep.join([str(tree), str(ROOT)]),
    )
    assert rendered.result["after"]["worker"] == "CPUPlatformOffloadingWorker"
    assert rendered.result["after"]["layout"] == "BLHNC"
    assert rendered.result["after"]["runs_per_block"] == 1  # cross-layer blocks
    assert rendered.result == overlay.result
