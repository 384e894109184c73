"""patches/latest renders the v0_32 runtime patches faithfully: the same
series rendered against vLLM 0.32.0 (where the runtime patches run, by
``stage_latest.stage``, as for the newest release), written into a copy of
the installed vLLM 0.32 (files linked, those the series adds or edits
written) and run with the overlay disabled, gives the overlay's results
byte for byte: tokens, logprobs, prefix-cache hits, the offloading worker's
copies and blocks, with upstream's OffloadingConnector and cross-layer
blocks (BLHNC) on the CPU platform; and for the PP KV budget (the wrappers
PP32-01..04 rendered into ``EngineArgs`` and ``get_kv_cache_configs``), the
same configuration outcomes (errors, command line) and, PP=2 with the
flag, the same blocks, KV bytes, tokens and logprobs."""

from __future__ import annotations

import os
import pathlib
import shutil
import sys

import pytest
from conftest import run, shared_run
from test_pp_budget_cpu import config_checks

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "patches" / "tools"))
import check_upstream  # noqa: E402
import fetch_sdist  # noqa: E402
import latest_verify  # noqa: E402
import stage_latest  # noqa: E402

REFERENCE = "0.32.0"
MiB = 2**20
P31 = {"VLLM_PP_LAYER_PARTITION": "3,1"}


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> pathlib.Path:
    """The installed vLLM with the series rendered on 0.32.0 written in."""
    import vllm

    sdist = fetch_sdist.cached(REFERENCE)
    if sdist is None:
        try:
            sdist = fetch_sdist.fetch(REFERENCE)
        except Exception as exc:  # no network: a set-up gap, not a skip
            pytest.fail(
                f"the vLLM {REFERENCE} sdist is not at hand ({exc}); run python "
                f"patches/tools/fetch_sdist.py --version {REFERENCE}",
                pytrace=False,
            )
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
    # test_offloading_cpu's BLHNC run (made once per session; only read)
    overlay = shared_run("run_offload.py", {"connector": True}, **layout)
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


def rendered_env(tree: pathlib.Path) -> dict:
    return {
        "VLLM_OVERLAY_DISABLE": "1",
        "PYTHONPATH": os.pathsep.join([str(tree), str(ROOT)]),
    }


def test_the_rendered_pp_front_end_gives_the_overlays_outcomes(tree):
    """Bad configurations fail in create_engine_config with the same
    errors; the command line flag parses and reaches additional_config."""
    overlay = config_checks()["overlay"].result  # test_pp_budget_cpu's run
    rendered = run("run_pp.py", {"check": "config"}, **rendered_env(tree)).result
    assert rendered["outcome"].startswith("disabled")
    cases = ["no_budget", "bad_partition", "too_small", "not_bool", "good"]
    cases += ["cli_flag", "cli_no_flag", "cli_plain"]
    for case in cases:
        assert rendered[case] == overlay[case], case
    assert rendered["no_budget"]["error"] == "ValueError"
    assert rendered["cli_flag"]["value"]["in_help"]


def test_the_rendered_pp_split_runs_like_the_runtime_patches(tree):
    """PP=2, partition 3,1, the flag and 16 MiB: the rendered
    get_kv_cache_configs gives each stage its share (64 blocks each), as
    the overlay's PP32-04 does, with the same tokens and logprobs."""
    config = {"flag": True, "kv_bytes": 16 * MiB}
    overlay = shared_run("run_pp.py", config, **P31)  # test_pp_budget_cpu's
    rendered = run("run_pp.py", config, **P31, **rendered_env(tree))
    assert rendered.result["outcome"].startswith("disabled")
    assert rendered.result["workers"] == overlay.result["workers"]
    assert [w["blocks"] for w in rendered.result["workers"]] == [64, 64]
    assert rendered.result["single"] == overlay.result["single"]
    batch, ref = rendered.result["records"], overlay.result["records"]
    assert [r["tokens"] for r in batch] == [r["tokens"] for r in ref]
    assert "PP KV budget split in the engine core" in rendered.log
