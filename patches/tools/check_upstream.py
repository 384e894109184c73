"""Apply patches/series to a vLLM sdist and run vLLM's offline pre-commit hooks.

    python patches/tools/fetch_sdist.py       # once (network)
    python patches/tools/check_upstream.py    # offline afterwards

The cached sdist (``fetch_sdist.py``) is extracted into a temporary
directory, committed to a fresh git repository, and every diff of
``patches/series`` is applied in order with ``git apply --index`` (the first
one that does not apply stops the run, named).  The hooks of the sdist's
``.pre-commit-config.yaml`` that need no network and no GPU then run on the
files the series add or modify, as pre-commit would run them on a commit of
the series:

* ruff-check and ruff-format: the ruff version the config pins (from
  ``$PATH``'s or this interpreter's venv when it is that version, otherwise
  installed once into a venv in the cache) with the sdist's ``pyproject.toml``;
* typos: likewise, when a ``typos`` of the pinned version is available or
  installable (``--no-install`` skips installing);
* the sdist's own ``tools/pre_commit`` scripts: SPDX headers, root lazy
  imports, ``import regex as re``, no direct ``import triton``, no pickle,
  config dataclass validation;
* check-filenames (no spaces).

A project check, ``overlay-identity``, also fails on added lines that still
name the overlay (``vllm_overlay``, ``vllm.overlay``, ``vllm-overlay``).

Another series list (``--series``, its diffs named relative to its folder or
to ``--patches-dir``) checks another staging against another sdist, e.g. the
series staged for the newest release::

    python patches/tools/check_upstream.py --version 0.33.0 \
        --series patches/latest/series

The scripts above run only where the sdist's config has their hook.  Other
``repo: local`` hooks of the config (a newer vLLM has more) are selected as
pre-commit selects them (``files``, ``exclude``, ``types``/``types_or``,
``always_run``) and a ``python tools/...`` entry runs on the selected files;
a hook that selects none of the series' files is ``n/a``.

Hooks for file types the series do not touch (C++, shell, PNG, markdown,
workflows, requirements) are listed as ``n/a``; mypy (it needs vLLM's whole
dependency set) is listed as ``skipped``.  The output is one table: hook,
result, number of findings, first findings.  The exit status is 1 when any
hook fails.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile

import yaml

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import fetch_sdist  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[2]
PATCHES = ROOT / "patches"
SHOWN = 3  # findings shown per hook

# hooks of vLLM's config that never see the series' files (they are all .py)
NOT_APPLICABLE = {
    "clang-format": "C++/CUDA only",
    "markdownlint": "markdown only",
    "actionlint": "GitHub workflows only",
    "pip-compile": "requirements/test.* only",
    "format-torch-nightly-test": "requirements/test.* only",
    "shellcheck": "shell scripts only",
    "png-lint": "PNG only",
    "update-dockerfile-graph": "Dockerfile graph",
    "signoff-commit": "commit message",
    "suggestion": "message only",
    "markdownlint-cli2": "markdown only",
}
SKIPPED = {"mypy": "needs vLLM's full dependency set (not offline)"}
IDENTITY = re.compile(
    r"vllm_overlay|vllm\.overlay|vllm-overlay|(?-i:\bOverlay[A-Z]\w*)"
    r"|knows nothing of vllm",
    re.IGNORECASE,
)


@dataclasses.dataclass
class Result:
    hook: str
    status: str  # pass, FAIL, n/a, skipped
    findings: list[str] = dataclasses.field(default_factory=list)
    note: str = ""


def _run(cmd, cwd, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(
        cmd, cwd=cwd, capture_output=True, text=True, check=False, **kwargs
    )


def _git(tree: pathlib.Path, *args: str) -> str:
    done = _run(["git", *args], tree)
    if done.returncode:
        raise SystemExit(f"git {' '.join(args)}: {done.stderr.strip()}")
    return done.stdout


def extract(sdist: pathlib.Path, workdir: pathlib.Path) -> pathlib.Path:
    """The sdist's top folder, extracted into WORKDIR."""
    with tarfile.open(sdist) as archive:
        kwargs = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
        archive.extractall(workdir, **kwargs)
    (tree,) = [p for p in workdir.iterdir() if p.is_dir()]
    return tree


def prepare_tree(sdist: pathlib.Path, workdir: pathlib.Path) -> pathlib.Path:
    """The sdist extracted and committed as a git repository."""
    tree = extract(sdist, workdir)
    _git(tree, "init", "-q")
    _git(tree, "add", "-A")
    _git(
        tree,
        "-c",
        "user.name=check_upstream",
        "-c",
        "user.email=check_upstream@localhost",
        "commit",
        "-qm",
        f"{sdist.name}",
        "--no-verify",
    )
    return tree


def series_names(series: pathlib.Path | None = None) -> list[str]:
    """The diffs of SERIES (default patches/series), in order."""
    return [
        line.strip()
        for line in (series or PATCHES / "series").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]


def apply_series(
    tree: pathlib.Path,
    series: pathlib.Path | None = None,
    patches_dir: pathlib.Path | None = None,
) -> list[str]:
    """Apply SERIES (default patches/series; diffs relative to PATCHES_DIR,
    default the series' folder) in order (staged); the diffs' names."""
    names = series_names(series)
    folder = (patches_dir or (series.parent if series else PATCHES)).resolve()
    for name in names:
        done = _run(["git", "apply", "--index", str(folder / name)], tree)
        if done.returncode:
            raise SystemExit(
                f"{_shown(folder / name)} does not apply after the diffs "
                f"before it:\n{done.stderr.strip()}"
            )
    return names


def _shown(path: pathlib.Path) -> str:
    """PATH relative to the project when it is inside it."""
    try:
        return str(path.resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


def _pinned(config: dict, repo_suffix: str) -> str | None:
    for repo in config.get("repos", []):
        if str(repo.get("repo", "")).endswith(repo_suffix):
            return str(repo["rev"]).removeprefix("v")
    return None


def _version_of(executable: str) -> str | None:
    try:
        out = _run([executable, "--version"], None).stdout
    except OSError:
        return None
    match = re.search(r"(\d+\.\d+\.\d+)", out)
    return match.group(1) if match else None


def tool(name: str, version: str, install: bool) -> tuple[str | None, str]:
    """An executable NAME of VERSION and where it came from (or None, why)."""
    candidates = [
        shutil.which(name),
        str(pathlib.Path(sys.executable).parent / name),
    ]
    for candidate in candidates:
        exists = candidate and os.path.exists(candidate)
        if exists and _version_of(candidate) == version:
            return candidate, candidate
    venv = fetch_sdist.cache_dir() / "tools" / f"{name}-{version}"
    executable = venv / "bin" / name
    if executable.exists() and _version_of(str(executable)) == version:
        return str(executable), str(executable)
    if not install:
        return None, f"{name} {version} not found (--no-install)"
    print(f"installing {name}=={version} into {venv}", file=sys.stderr)
    steps = [
        [sys.executable, "-m", "venv", str(venv)],
        [str(venv / "bin" / "python"), "-m", "pip", "install", "-q",
         f"{name}=={version}"],
    ]  # fmt: skip
    for step in steps:
        done = _run(step, None)
        if done.returncode:
            return None, f"installing {name}=={version} failed: " + (
                done.stderr.strip().splitlines() or ["?"]
            )[-1]
    return str(executable), str(executable)


def _restore(tree: pathlib.Path) -> None:
    """Undo what a hook wrote (the patched state is in the index)."""
    _git(tree, "checkout", "--", ".")


def run_hooks(tree: pathlib.Path, install: bool) -> list[Result]:
    config = yaml.safe_load((tree / ".pre-commit-config.yaml").read_text())
    hook_ids = [h["id"] for repo in config["repos"] for h in repo["hooks"]]
    changed = _git(tree, "diff", "--cached", "--name-only", "--diff-filter=AM")
    files = [f for f in changed.split() if not f.startswith("vllm/third_party/")]
    py = [f for f in files if f.endswith((".py", ".pyi"))]
    python = sys.executable
    scripts = tree / "tools" / "pre_commit"
    results: list[Result] = []
    done_ids: set[str] = set()

    def script(hook_id: str, name: str, args: list[str], parse) -> None:
        if hook_id not in hook_ids:  # not a hook of this vLLM's config
            return
        done_ids.add(hook_id)
        if not (scripts / name).exists():
            results.append(Result(hook_id, "skipped", note=f"no tools/{name}"))
            return
        out = _run([python, str(scripts / name), *args], tree)
        _restore(tree)
        text = (out.stdout + out.stderr).strip()
        findings = parse(text) if out.returncode else []
        if out.returncode and not findings:
            findings = text.splitlines()[-1:] or [f"exit {out.returncode}"]
        results.append(Result(hook_id, "FAIL" if out.returncode else "pass", findings))

    # ruff-check / ruff-format
    ruff_version = _pinned(config, "ruff-pre-commit")
    ruff, where = tool("ruff", ruff_version, install) if ruff_version else (None, "")
    if ruff is None:
        for hook_id in ("ruff-check", "ruff-format"):
            results.append(Result(hook_id, "skipped", note=where or "not pinned"))
    else:
        note = f"ruff {ruff_version}"
        out = _run([ruff, "check", "--output-format", "concise", "--quiet", *py], tree)
        findings = [line for line in out.stdout.splitlines() if line.strip()]
        status = "FAIL" if out.returncode else "pass"
        results.append(Result("ruff-check", status, findings, note))
        out = _run([ruff, "format", "--check", *py], tree)
        findings = [
            line.removeprefix("Would reformat: ")
            for line in out.stdout.splitlines()
            if line.startswith("Would reformat")
        ]
        status = "FAIL" if out.returncode else "pass"
        results.append(Result("ruff-format", status, findings, note))
    done_ids |= {"ruff-check", "ruff-format"}

    # typos
    typos_version = _pinned(config, "crate-ci/typos")
    if typos_version:
        typos, where = tool("typos", typos_version, install)
        if typos is None:
            results.append(Result("typos", "skipped", note=where))
        else:
            out = _run([typos, "--force-exclude", "--format", "brief", *files], tree)
            findings = [line for line in out.stdout.splitlines() if line.strip()]
            status = "FAIL" if out.returncode else "pass"
            results.append(Result("typos", status, findings, f"typos {typos_version}"))
        done_ids.add("typos")

    def lines(text: str) -> list[str]:
        return [line.strip() for line in text.splitlines() if line.strip()]

    script(
        "check-spdx-header",
        "check_spdx_header.py",
        py,
        lambda t: [line for line in lines(t) if not line.startswith("The following")],
    )
    script("check-root-lazy-imports", "check_init_lazy_imports.py", [], lines)

    def regex_findings(text: str) -> list[str]:
        found, current = [], ""
        for line in lines(text):
            if line.startswith("❌ ") and line.endswith(":"):
                current = line[2:-1].strip()
            elif line.startswith("Line "):
                number, _, code = line[5:].partition(": ")
                found.append(f"{current}:{number}: {code}")
        return found

    script(
        "enforce-import-regex-instead-of-re",
        "enforce_regex_import.py",
        [],
        regex_findings,
    )
    script(
        "forbid-direct-triton-import",
        "check_triton_import.py",
        [],
        lambda t: [line.removeprefix("❌ ") for line in lines(t)[1:]],
    )
    script(
        "check-pickle-imports",
        "check_pickle_imports.py",
        py,
        lambda t: [re.sub(r"\x1b\[\d+m", "", line) for line in lines(t)],
    )
    script(
        "validate-config",
        "validate_config.py",
        files,
        lambda t: [line for line in lines(t) if "❌" in line],
    )

    done_ids.add("check-filenames")
    spaced = [f for f in _git(tree, "ls-files").splitlines() if " " in f]
    results.append(Result("check-filenames", "FAIL" if spaced else "pass", spaced))

    local = {
        h["id"]: h
        for repo in config["repos"]
        if repo.get("repo") == "local"
        for h in repo["hooks"]
    }
    configured = {h["id"]: h for repo in config["repos"] for h in repo["hooks"]}
    for hook_id in hook_ids:
        if hook_id in done_ids:
            continue
        done_ids.add(hook_id)  # once for hooks listed twice (aliases)
        base = re.sub(r"-(local|3\.\d+)$", "", hook_id)
        if base in SKIPPED:
            results.append(Result(hook_id, "skipped", note=SKIPPED[base]))
        elif hook_id in NOT_APPLICABLE:
            results.append(Result(hook_id, "n/a", note=NOT_APPLICABLE[hook_id]))
        elif hook_id in local:
            results.append(_local_hook(tree, config, local[hook_id], files))
        elif configured[hook_id].get("files") and not _selected(
            config, {"files": configured[hook_id]["files"]}, files
        ):  # a remote hook whose files (in the config) exclude the series'
            note = f"selects none of the series' files ({configured[hook_id]['files']})"
            results.append(Result(hook_id, "n/a", note=note))
        else:
            results.append(Result(hook_id, "skipped", note="not reproduced here"))

    # project check: the overlay's name in added lines
    diff = _git(tree, "diff", "--cached", "--unified=0")
    leaks, current = [], ""
    for line in diff.splitlines():
        if line.startswith("+++ b/"):
            current = line[6:]
        elif line.startswith("+") and IDENTITY.search(line):
            leaks.append(f"{current}: {line[1:].strip()}")
    results.append(
        Result(
            "overlay-identity (project)",
            "FAIL" if leaks else "pass",
            leaks,
            "added lines naming the overlay",
        )
    )
    return results


# pre-commit file types (identify's tags) by file name ending, for the
# ``types``/``types_or`` of local hooks; a type not here is not reproduced.
TYPE_SUFFIXES = {
    "file": ("",),
    "text": ("",),
    "python": (".py", ".pyi"),
    "pyi": (".pyi",),
    "rust": (".rs",),
    "proto": (".proto",),
    "png": (".png",),
    "c++": (".cc", ".cpp", ".cxx", ".h", ".hpp", ".cuh"),
    "cuda": (".cu", ".cuh"),
    "markdown": (".md",),
    "yaml": (".yaml", ".yml"),
    "json": (".json",),
    "shell": (".sh",),
    "toml": (".toml",),
}
# additional_dependencies -> the module this interpreter must have
DEPENDENCY_MODULES = {"pyyaml": "yaml", "dockerfile-parse": "dockerfile_parse"}


def _selected(config: dict, hook: dict, files: list[str]) -> list[str] | None:
    """FILES as pre-commit passes them to HOOK (None: a type not known)."""
    types = hook.get("types", [])
    types_or = hook.get("types_or", [])
    exclude_types = hook.get("exclude_types", [])
    if any(t not in TYPE_SUFFIXES for t in (*types, *types_or, *exclude_types)):
        return None

    def typed(name: str, tag: str) -> bool:
        return name.endswith(TYPE_SUFFIXES[tag])

    include = re.compile(hook.get("files", ""))
    excludes = [
        re.compile(pattern)
        for pattern in (config.get("exclude", "^$"), hook.get("exclude", "^$"))
    ]
    return [
        name
        for name in files
        if include.search(name)
        and not any(pattern.search(name) for pattern in excludes)
        and all(typed(name, t) for t in types)
        and (not types_or or any(typed(name, t) for t in types_or))
        and not any(typed(name, t) for t in exclude_types)
    ]


def _local_hook(
    tree: pathlib.Path, config: dict, hook: dict, files: list[str]
) -> Result:
    """A ``repo: local`` hook of the config: n/a when it selects none of the
    series' files (and is not ``always_run``), run when its entry is a Python
    script of the sdist, else skipped."""
    hook_id = hook["id"]
    selected = _selected(config, hook, files)
    if selected is None:
        return Result(hook_id, "skipped", note="file types not reproduced here")
    if not selected and not hook.get("always_run"):
        what = hook.get("files") or "/".join(
            hook.get("types", []) + hook.get("types_or", [])
        )
        note = f"selects none of the series' files ({what})"
        return Result(hook_id, "n/a", note=note)
    if "commit-msg" in hook.get("stages", []):
        return Result(hook_id, "n/a", note="commit message")
    entry = hook.get("entry", "").split() + list(hook.get("args", []))
    if hook.get("language") != "python" or entry[:1] != ["python"]:
        return Result(hook_id, "skipped", note="not reproduced here")
    for dep in hook.get("additional_dependencies", []):
        name = re.split(r"[<>=\[ ]", dep)[0].lower()
        module = DEPENDENCY_MODULES.get(name, name.replace("-", "_"))
        if importlib.util.find_spec(module) is None:
            return Result(hook_id, "skipped", note=f"needs {dep}")
    args = selected if hook.get("pass_filenames", True) else []
    out = _run([sys.executable, *entry[1:], *args], tree)
    _restore(tree)
    text = re.sub(r"\x1b\[\d+m", "", out.stdout + out.stderr).strip()
    findings = [line.strip() for line in text.splitlines() if line.strip()]
    if out.returncode and not findings:
        findings = [f"exit {out.returncode}"]
    return Result(
        hook_id,
        "FAIL" if out.returncode else "pass",
        findings if out.returncode else [],
        f"{len(args)} files" if hook.get("pass_filenames", True) else "whole tree",
    )


def _cell(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


def render(
    results: list[Result],
    files: int,
    diffs: int,
    version: str,
    series: str = "patches/series",
) -> str:
    out = [
        f"vLLM {version} + {diffs} diffs of {series} ({files} files added or modified)",
        "",
        "| hook | result | findings | first findings |",
        "|---|---|---|---|",
    ]
    for r in results:
        shown = "<br>".join(_cell(f, 110) for f in r.findings[:SHOWN])
        if r.note and not r.findings:
            shown = r.note
        count = str(len(r.findings)) if r.status in ("pass", "FAIL") else "-"
        out.append(f"| {r.hook} | {r.status} | {count} | {shown} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--version", default=fetch_sdist.DEFAULT_VERSION)
    parser.add_argument(
        "--no-install",
        action="store_true",
        help="never pip-install a pinned tool; hooks without one are skipped",
    )
    parser.add_argument(
        "--keep", action="store_true", help="keep the patched tree (path printed)"
    )
    parser.add_argument(
        "--all", action="store_true", help="print every finding after the table"
    )
    parser.add_argument(
        "--series",
        type=pathlib.Path,
        help="series list to apply (default: patches/series)",
    )
    parser.add_argument(
        "--patches-dir",
        type=pathlib.Path,
        help="folder the series' diffs are named in (default: the series' folder)",
    )
    args = parser.parse_args(argv)

    sdist = fetch_sdist.cached(args.version)
    if sdist is None:
        print(fetch_sdist.missing(args.version), file=sys.stderr)
        return 2
    workdir = pathlib.Path(tempfile.mkdtemp(prefix="vllm-patches-"))
    try:
        tree = prepare_tree(sdist, workdir)
        diffs = apply_series(tree, args.series, args.patches_dir)
        changed = _git(tree, "diff", "--cached", "--name-only", "--diff-filter=AM")
        results = run_hooks(tree, install=not args.no_install)
        label = _shown(args.series) if args.series else "patches/series"
        print(render(results, len(changed.split()), len(diffs), args.version, label))
        if args.all:
            for r in results:
                for finding in r.findings:
                    print(f"{r.hook}: {finding}")
        if args.keep:
            print(f"\npatched tree: {tree}")
    finally:
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    return 1 if any(r.status == "FAIL" for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
