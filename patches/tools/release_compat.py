"""Which later vLLM releases a patch set runs on unchanged: the record.

    python patches/tools/release_compat.py            # write the record
    python patches/tools/release_compat.py --check    # exit 1 if it is stale
    python patches/tools/release_compat.py --release 0.34.0   # add a release
    python patches/tools/release_compat.py --installed DIR   # an installed vllm
                                                      # package folder vs the record

The touched upstream code of the v0_32 set (``PATCH_SET``) is every module a
patch of it targets (``Patch.module``, from the set's ``MODULES``) and every
``vllm`` module its code imports (``vllm_overlay/patches/v0_32`` and
``vllm_overlay/integration/v0_32``, imports inside functions included, and
the ``vllm_overlay.core`` modules they import, transitively), and the
upstream files whose behaviour the overlay relies on without importing them
(``RELIED_ON``, each with why: a caller's contract, a layout to match, a
queue read).  Those files
of the reference release's sdist (``REFERENCE``, vLLM 0.32.0) are hashed
(sha256) and compared byte for byte with each later release's sdist (cached
by ``fetch_sdist.py``).  The record, ``vllm_overlay/patches/v0_32/
releases.json``, lists the touched files with their sha256 and each later
release checked: identical, or the files that differ.  ``version_gate``
supports a release recorded as identical with the v0_32 set, and at startup
checks the installed touched files against these digests.

Releases checked: those already in the record, every cached sdist newer than
the reference, and ``--release``.  ``--check`` rebuilds the record from the
sdists of the releases it lists (downloaded where not cached, unless
``--offline``) and compares it with the committed one.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import json
import pathlib
import re
import sys
import tarfile

TOOLS = pathlib.Path(__file__).resolve().parent
ROOT = TOOLS.parents[1]
sys.path.insert(0, str(TOOLS))
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
import fetch_sdist  # noqa: E402
import static_imports  # noqa: E402

from vllm_overlay import version_gate  # noqa: E402

PATCH_SET = "v0_32"
REFERENCE = "0.32.0"
RECORD = ROOT / "vllm_overlay" / "patches" / PATCH_SET / "releases.json"
SOURCES = [f"vllm_overlay/patches/{PATCH_SET}", f"vllm_overlay/integration/{PATCH_SET}"]
FOLLOWED = "vllm_overlay.core"  # overlay modules followed from SOURCES

# Upstream files the set's code never imports but whose behaviour it relies
# on (paths in the vLLM tree) -> why.  A change there can break the overlay
# with every patch still applying, so they are touched files too.
RELIED_ON = {
    "vllm/v1/kv_offload/tiering/manager.py": "TieringOffloadingManager calls "
    "the pool tier's drain_jobs() in reset_cache and then asserts every job "
    "finished (the drain contract SharedPoolTier keeps)",
    "vllm/distributed/kv_transfer/kv_connector/v1/offloading/worker.py": "the "
    "only consumer of the CPU worker's TransferResults (what it does with "
    "success=False)",
    "vllm/distributed/kv_transfer/kv_connector/v1/offloading/config.py": "the "
    "OffloadingConfig the spec, the tiers and PT32-01 read",
    "vllm/v1/kv_offload/cpu/gpu_worker.py": "upstream's host chunk layout, "
    "which the CPU worker and a pool shared with GPU nodes must match",
    "vllm/v1/core/sched/scheduler.py": "the request queues the idle wait "
    "(integration/v0_32/idle_wait.py) reads",
}


def patch_targets(patch_set: str = PATCH_SET) -> list[str]:
    """The upstream modules the set's patches target (``Patch.module``)."""
    package = importlib.import_module(f"vllm_overlay.patches.{patch_set}")
    return sorted({p.module for m in package.MODULES for p in m.PATCHES})


def _overlay_file(module: str) -> pathlib.Path | None:
    base = ROOT / module.replace(".", "/")
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def overlay_files(sources: list[str] = SOURCES) -> list[pathlib.Path]:
    """The .py files of SOURCES and the FOLLOWED modules they import."""
    todo = [p for folder in sources for p in sorted((ROOT / folder).rglob("*.py"))]
    seen: list[pathlib.Path] = []
    while todo:
        path = todo.pop(0)
        if path in seen:
            continue
        seen.append(path)
        rel = str(path.relative_to(ROOT))
        for _, module, name in static_imports.imports(path.read_text(), rel, FOLLOWED):
            for candidate in (module, f"{module}.{name}" if name else None):
                found = _overlay_file(candidate) if candidate else None
                if found is not None and found not in seen:
                    todo.append(found)
    return seen


def imported_modules(files: list[pathlib.Path]) -> dict[str, set[str]]:
    """vllm module -> the names imported from it (None for ``import``)."""
    out: dict[str, set[str]] = {}
    for path in files:
        rel = str(path.relative_to(ROOT))
        for _, module, name in static_imports.vllm_imports(path.read_text(), rel):
            out.setdefault(module, set()).add(name or "")
    return out


class Sdist:
    """The files of a release's sdist, read from the tarball (no extraction)."""

    def __init__(self, path: pathlib.Path) -> None:
        self.tar = tarfile.open(path)  # noqa: SIM115 - read while the tool runs
        names = self.tar.getnames()
        self.prefix = names[0].split("/", 1)[0] + "/"
        self.names = set(names)

    def read(self, rel: str) -> bytes | None:
        name = self.prefix + rel
        if name not in self.names:
            return None
        return self.tar.extractfile(name).read()

    def module_file(self, module: str) -> str | None:
        base = module.replace(".", "/")
        for rel in (f"{base}.py", f"{base}/__init__.py"):
            if self.prefix + rel in self.names:
                return rel
        return None


def touched_files(reference: Sdist) -> list[str]:
    """The touched upstream files (paths in the vLLM tree), sorted."""
    files = set()
    modules = dict.fromkeys(patch_targets(), {""})
    for module, names in imported_modules(overlay_files()).items():
        modules.setdefault(module, set()).update(names)
    for rel in RELIED_ON:
        if reference.read(rel) is None:
            raise SystemExit(f"vLLM {REFERENCE} has no file {rel} (RELIED_ON)")
        files.add(rel)
    for module, names in modules.items():
        path = reference.module_file(module)
        if path is None:
            raise SystemExit(f"vLLM {REFERENCE} has no module {module}")
        files.add(path)
        for name in names - {"", "*"}:  # `from package import submodule`
            sub = reference.module_file(f"{module}.{name}")
            if sub is not None:
                files.add(sub)
    return sorted(files)


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


def build(releases: list[str], offline: bool) -> dict:
    reference = _sdist(REFERENCE, offline)
    touched = {rel: sha256(reference.read(rel)) for rel in touched_files(reference)}
    checked = {}
    for version in sorted(set(releases), key=_version_key):
        later = _sdist(version, offline)
        differs = [
            rel for rel, digest in touched.items() if _digest(later, rel) != digest
        ]
        checked[version] = {"identical": not differs, "differs": differs}
    return {
        "generated_by": "patches/tools/release_compat.py (do not edit)",
        "patch_set": PATCH_SET,
        "reference": REFERENCE,
        "touched": touched,
        "releases": checked,
    }


def _digest(sdist: Sdist, rel: str) -> str | None:
    data = sdist.read(rel)
    return None if data is None else sha256(data)


def render(record: dict) -> str:
    return json.dumps(record, indent=2, sort_keys=False) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if stale")
    parser.add_argument("--release", action="append", default=[])
    parser.add_argument("--offline", action="store_true", help="never download")
    parser.add_argument(
        "--installed", type=pathlib.Path, help="a vllm package folder to compare"
    )
    args = parser.parse_args(argv)
    committed = json.loads(RECORD.read_text()) if RECORD.exists() else {}
    if args.installed is not None:
        differ = version_gate.touched_file_changes(PATCH_SET, args.installed)
        print(
            f"{args.installed}: {len(committed['touched']) - len(differ)} of "
            f"{len(committed['touched'])} touched files equal vLLM {REFERENCE}'s"
            + "".join(f"\n  differs: {rel}" for rel in differ)
        )
        return 1 if differ else 0
    listed = list(committed.get("releases", {}))
    releases = listed if args.check else listed + cached_releases() + args.release
    text = render(build(releases, args.offline))
    rel = RECORD.relative_to(ROOT)
    if args.check:
        if not RECORD.exists() or RECORD.read_text() != text:
            print(f"{rel} is stale (run python patches/tools/release_compat.py)")
            return 1
    else:
        RECORD.write_text(text)
    record = json.loads(text)
    print(f"{rel}: {len(record['touched'])} touched files of vLLM {REFERENCE}")
    for version, result in record["releases"].items():
        if result["identical"]:
            print(f"  vLLM {version}: identical (supported by the {PATCH_SET} set)")
        else:
            print(f"  vLLM {version}: differs in {', '.join(result['differs'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
