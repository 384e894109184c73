"""The README's environment-variable table is rendered from envs.ALL."""

from __future__ import annotations

import pathlib

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
