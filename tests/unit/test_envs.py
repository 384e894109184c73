"""The README's environment-variable table is rendered from envs.ALL."""

from __future__ import annotations

import pathlib

import pytest

from vllm_overlay import envs

README = pathlib.Path(__file__).resolve().parents[2] / "README.md"


def test_readme_env_table_is_rendered_from_envs():
    lines = README.read_text().splitlines(keepends=True)
    start = lines.index("| variable | effect |\n")
    end = start
    while end < len(lines) and lines[end].startswith("|"):
        end += 1
    assert "".join(lines[start:end]) == envs.markdown_table(), (
        "README.md's environment-variable table is stale: replace it with "
        "the output of python -c 'from vllm_overlay import envs; "
        'print(envs.markdown_table(), end="")\''
    )


def test_a_patch_id_of_another_release_names_that_release(monkeypatch):
    """VLLM_OVERLAY_SKIP_PATCHES=CL-06 on 0.32 says CL-06 is 0.11.2's and
    lists 0.32's ids (and the other way round); an id of no release is
    unknown."""
    from vllm_overlay.patches import all_patches

    ids = {entry: [p.id for p in all_patches(entry)] for entry in ("0.11.2", "0.32.x")}
    monkeypatch.setenv(envs.SKIP_PATCHES.name, "CL-06,XX-99")
    message = envs.skip_patches_error("0.32.x", ids["0.32.x"])
    assert message == (
        "VLLM_OVERLAY_SKIP_PATCHES=CL-06,XX-99: unknown patch ids ['XX-99']; "
        "CL-06 is a patch of vLLM 0.11.2. This vLLM's patch set (v0_32, "
        f"vLLM 0.32.x) has: {', '.join(ids['0.32.x'])}"
    )
    monkeypatch.setenv(envs.SKIP_PATCHES.name, "CL32-01,CL-06")
    message = envs.skip_patches_error("0.11.2", ids["0.11.2"])
    assert message.startswith(
        "VLLM_OVERLAY_SKIP_PATCHES=CL32-01,CL-06: CL32-01 is a patch of vLLM "
        "0.32.x. This vLLM's patch set (v0_11_2, vLLM 0.11.2) has: CL-01, "
    )
    monkeypatch.setenv(envs.SKIP_PATCHES.name, "CL-06")
    assert envs.skip_patches_error("0.11.2", ids["0.11.2"]) is None


def test_apply_all_refuses_with_that_line(monkeypatch):
    from vllm_overlay.patches import apply_all

    monkeypatch.setenv(envs.SKIP_PATCHES.name, "MLA32-01")
    with pytest.raises(envs.BadSetting, match="MLA32-01 is a patch of vLLM 0.32.x"):
        apply_all("0.11.2")
