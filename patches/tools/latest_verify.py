"""The newest release's side of patches/latest (``stage_latest.py``): its
pinned ruff, writing and comparing the staged files, and ``--verify``: the
staged series applied in order to a clean tree of the sdist (committed to a
scratch git repository first), each diff with ``git apply --check`` and
``patch --dry-run -p1 -F0`` (no fuzz; an offset is a failure too), then that
release's offline pre-commit hooks exactly as ``check_upstream.py --series
patches/latest/series`` runs them (one extraction instead of two) and
``python -m py_compile`` of every file the series touch.
"""

from __future__ import annotations

import filecmp
import os
import pathlib
import re
import shutil
import subprocess
import sys

import yaml

TOOLS = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(TOOLS))
import check_upstream  # noqa: E402
import fetch_sdist  # noqa: E402

ROOT = TOOLS.parents[1]


class Ruff:
    """The pinned ruff of the newest release, with its pyproject.toml."""

    def __init__(self, root: pathlib.Path, install: bool) -> None:
        config = yaml.safe_load((root / ".pre-commit-config.yaml").read_text())
        version = check_upstream._pinned(config, "ruff-pre-commit")
        if version is None:
            raise SystemExit("the newest pre-commit config pins no ruff")
        self.exe, where = check_upstream.tool("ruff", version, install)
        if self.exe is None:
            raise SystemExit(where)
        self.version = version
        self.root = root

    def __call__(self, text: str, path: str) -> str:
        """TEXT (a new file) fixed and formatted."""
        return self._run(text, path, (["check", "--fix-only", "--quiet"], ["format"]))

    def format(self, text: str, path: str) -> str:
        """TEXT (an edited upstream file) formatted only."""
        return self._run(text, path, (["format"],))

    def _run(self, text: str, path: str, steps) -> str:
        config = str(self.root / "pyproject.toml")
        for args in steps:
            done = subprocess.run(
                [self.exe, *args, "--no-cache", "--config", config]
                # The staged modules are not in the clean tree, and ruff's
                # isort would class what it cannot find as third-party.
                + ["--config", "lint.isort.known-first-party = ['vllm']"]
                + ["--stdin-filename", path, "-"],
                input=text,
                capture_output=True,
                text=True,
                cwd=self.root,
                check=False,
            )
            if done.returncode:
                raise SystemExit(f"ruff {args[0]} {path}: {done.stderr.strip()}")
            text = done.stdout
        return text


def added_lines(diff: str) -> set[int]:
    lines, number = set(), 0
    for line in diff.splitlines():
        hunk = re.match(r"@@ -\d+(?:,\d+)? \+(\d+)", line)
        if hunk:
            number = int(hunk.group(1))
        elif line.startswith("+") and not line.startswith("+++"):
            lines.add(number)
            number += 1
        elif not line.startswith("-"):
            number += 1
    return lines


def write(files: dict[str, str], folder: pathlib.Path) -> None:
    for name, text in files.items():
        target = folder / name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)


def compare(
    folder: pathlib.Path, out: pathlib.Path, hand_written: set[str]
) -> list[str]:
    """Paths of OUT (patches/latest) that differ from FOLDER's (missing,
    extra; HAND_WRITTEN files and mbox/ aside)."""
    stale = []
    made = {p.relative_to(folder) for p in folder.rglob("*") if p.is_file()}
    have = {
        p.relative_to(out)
        for p in out.rglob("*")
        if p.is_file()
        and p.name not in hand_written
        and p.relative_to(out).parts[0] != "mbox"  # build_mbox.py's
    }
    for rel in sorted(made | have):
        if rel not in made:
            stale.append(f"{rel} (not generated)")
        elif rel not in have or not filecmp.cmp(folder / rel, out / rel, shallow=False):
            stale.append(str(rel))
    return stale


def verify(
    root: pathlib.Path, series: pathlib.Path, version: str, install: bool
) -> list[str]:
    """Apply SERIES to ROOT, a clean tree of the sdist (committed to a
    scratch git repository first): each diff ``git apply --check``, ``patch
    --dry-run -p1 -F0``, then ``git apply --index``.  Then vLLM's offline
    pre-commit hooks of that release (``check_upstream.run_hooks``, the
    table printed) and ``python -m py_compile`` of every file the series
    touch.  Returns the problems."""
    for args in (
        ["init", "-q"],
        ["add", "-A"],
        ["-c", "user.name=stage_latest", "-c", "user.email=stage@localhost"]
        + ["commit", "-qm", f"vllm {version}", "--no-verify"],
    ):
        check_upstream._git(root, *args)
    names = check_upstream.series_names(series)
    for name in names:
        diff = series.parent.resolve() / name
        done = _run(["git", "apply", "--check", str(diff)], root)
        if done.returncode:
            return [f"{name}: git apply --check: {done.stderr.strip()}"]
        done = _run(["patch", "--dry-run", "-p1", "-F0", "-i", str(diff)], root)
        said = done.stdout + done.stderr
        if done.returncode or re.search(r"offset|fuzz|FAILED", said):
            return [f"{name}: patch --dry-run -p1 -F0: {said.strip()}"]
        done = _run(["git", "apply", "--index", str(diff)], root)
        if done.returncode:
            return [f"{name}: git apply --index: {done.stderr.strip()}"]
    print(f"{len(names)} diffs apply (git apply --check; patch -F0: no fuzz/offset)")
    changed = check_upstream._git(
        root, "diff", "--cached", "--name-only", "--diff-filter=AM"
    ).split()
    results = check_upstream.run_hooks(root, install=install)
    label = str(series.resolve().relative_to(ROOT))
    print(check_upstream.render(results, len(changed), len(names), version, label))
    problems = [
        f"{r.hook}: {finding}"
        for r in results
        if r.status == "FAIL"
        for finding in (r.findings or ["failed"])
    ]
    py = [f for f in changed if f.endswith(".py")]
    done = _run([sys.executable, "-m", "py_compile", *py], root)
    if done.returncode:
        problems.append(f"py_compile: {(done.stdout + done.stderr).strip()}")
    else:
        print(f"python -m py_compile: {len(py)} files compile")
    return problems


def _run(cmd: list[str], cwd: pathlib.Path) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, check=False)


def scratch() -> str | None:
    """Where to extract the sdist: memory (``/dev/shm``, with 2 GiB free)
    unless ``$TMPDIR`` says otherwise; the 8,500 files of the sdist and their
    git objects are written three to four times faster there."""
    shm = pathlib.Path("/dev/shm")
    if os.environ.get("TMPDIR") or not shm.is_dir() or not os.access(shm, os.W_OK):
        return None
    return str(shm) if shutil.disk_usage(shm).free >= 2 << 30 else None


def sdist_path(version: str, fetch: bool) -> pathlib.Path | None:
    hit = fetch_sdist.cached(version)
    if hit is None and fetch:
        hit = fetch_sdist.fetch(version)
    if hit is None:
        print(fetch_sdist.missing(version), file=sys.stderr)
    return hit
