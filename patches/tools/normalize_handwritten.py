"""Bring the hand-written series (cross-layer, kv-pressure, pp-kv-budget) to
vLLM's ruff style: apply ``patches/series`` in order to the cached vLLM
sdist; after each hand-written diff, run ruff (safe fixes, then the
formatter, vLLM's settings from ``generate.VLLM_RUFF``) on the files it
touched, and, where that changed them, write the diff again from the file
before it to the fixed file.  Generated series are left alone (they are
written by ``patches/generate.py``, already in style).

    python patches/tools/normalize_handwritten.py [--check]

``--check``: change nothing, exit 1 if a diff would change.
"""

from __future__ import annotations

import argparse
import difflib
import pathlib
import re
import sys
import tempfile

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import check_upstream  # noqa: E402
import fetch_sdist  # noqa: E402
import generate  # noqa: E402

GENERATED = set(generate.SERIES)
_FILE = re.compile(r"^\+\+\+ b/(\S+)", re.M)
_OLD = re.compile(r"^--- (\S+)", re.M)


def _diff(before: str | None, after: str, path: str) -> str:
    lines = difflib.unified_diff(
        (before or "").splitlines(keepends=True),
        after.splitlines(keepends=True),
        "/dev/null" if before is None else f"a/{path}",
        f"b/{path}",
    )
    return "".join(lines)


def normalize(tree: pathlib.Path, check: bool) -> list[str]:
    """Returns the names of the diffs that changed (or would)."""
    changed = []
    for name in check_upstream.series_names():
        diff_path = check_upstream.PATCHES / name
        text = diff_path.read_text()
        files = _FILE.findall(text)
        before = {}
        for path in files:
            file = tree / path
            before[path] = file.read_text() if file.exists() else None
        done = check_upstream._run(["git", "apply", str(diff_path)], tree)
        if done.returncode:
            raise SystemExit(f"{name} does not apply: {done.stderr.strip()}")
        if name.split("/")[0] in GENERATED or generate.TEST_DIFF in name:
            continue  # written by generate.py (tests: as vLLM's ruff has them)
        pieces, differs = [], False
        for path in files:
            file = tree / path
            after = file.read_text()
            fixed = generate.ruff(after, path) if path.endswith(".py") else after
            if fixed != after:
                differs = True
                file.write_text(fixed)
            pieces.append(_diff(before[path], fixed, path))
        if differs:
            changed.append(name)
            if not check:
                diff_path.write_text("".join(pieces))
    return changed


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args(argv)
    sdist = fetch_sdist.fetch("0.11.2")
    with tempfile.TemporaryDirectory() as tmp:
        tree = check_upstream.prepare_tree(sdist, pathlib.Path(tmp))
        changed = normalize(tree, args.check)
    for name in changed:
        print(f"{'would rewrite' if args.check else 'rewrote'} patches/{name}")
    return 1 if changed and args.check else 0


if __name__ == "__main__":
    sys.exit(main())
