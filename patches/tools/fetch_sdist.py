"""Download a vLLM source distribution from PyPI into a local cache.

    python patches/tools/fetch_sdist.py                 # vLLM 0.11.2
    python patches/tools/fetch_sdist.py --version 0.12.0
    python patches/tools/fetch_sdist.py --latest

The sdist comes from PyPI's JSON API (``/pypi/vllm/<version>/json``), its
sha256 is checked against the digest the API lists, and it is kept in
``$VLLM_OVERLAY_SDIST_CACHE`` (default ``~/.cache/vllm-overlay/sdists``).
A cached file whose digest matches is not downloaded again.  ``pip download``
is not used: for an sdist it would build vLLM to read its metadata.

Prints the path of the cached sdist on stdout.  ``--version`` with a cached
sdist needs no network (``--latest`` always asks PyPI for the version).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import pathlib
import sys
import tempfile
import urllib.error
import urllib.parse
import urllib.request

DEFAULT_VERSION = "0.11.2"
INDEX = "https://pypi.org/pypi/vllm"


def cache_dir() -> pathlib.Path:
    env = os.environ.get("VLLM_OVERLAY_SDIST_CACHE")
    if env:
        return pathlib.Path(env).expanduser()
    return pathlib.Path.home() / ".cache" / "vllm-overlay" / "sdists"


def _get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=60) as response:
        return json.load(response)


def latest_version() -> str:
    return _get_json(f"{INDEX}/json")["info"]["version"]


def sdist_entry(version: str) -> dict:
    """The PyPI file record (url, filename, digests) of VERSION's sdist.

    Asks ``/pypi/vllm/<version>/json``; where that answers 404 (some PyPI
    mirrors serve only the project document), the release's files are read
    from ``/pypi/vllm/json``'s ``releases``.  Relative file URLs (mirrors
    again) are resolved against the document's URL.
    """
    url = f"{INDEX}/{version}/json"
    try:
        files = _get_json(url)["urls"]
    except urllib.error.HTTPError as error:
        if error.code != 404:
            raise
        url = f"{INDEX}/json"
        releases = _get_json(url)["releases"]
        if version not in releases:
            raise SystemExit(f"vllm {version}: no such release on PyPI") from None
        files = releases[version]
    sdists = [f for f in files if f.get("packagetype") == "sdist"]
    if not sdists:
        raise SystemExit(f"vllm {version}: PyPI lists no sdist")
    entry = dict(sdists[0])
    entry["url"] = urllib.parse.urljoin(url, entry["url"])
    return entry


def _sha256(path: pathlib.Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as stream:
        for chunk in iter(lambda: stream.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def missing(version: str) -> str:
    """What to say when VERSION's sdist is not in the cache."""
    return (
        f"vllm {version}: no cached sdist in {cache_dir()}; "
        f"run python patches/tools/fetch_sdist.py --version {version}"
    )


def cached(version: str, directory: pathlib.Path | None = None) -> pathlib.Path | None:
    """VERSION's sdist if the cache holds it with the digest recorded at download."""
    directory = directory or cache_dir()
    for record in directory.glob(f"vllm-{version}.*.sha256"):
        sdist = record.with_suffix("")
        if sdist.exists() and _sha256(sdist) == record.read_text().split()[0]:
            return sdist
    return None


def fetch(version: str, directory: pathlib.Path | None = None) -> pathlib.Path:
    """Path of VERSION's sdist in the cache, downloaded and verified if needed.

    A cached sdist is returned without asking PyPI (its sha256, checked
    against PyPI's when it was downloaded, is kept next to it).
    """
    directory = directory or cache_dir()
    hit = cached(version, directory)
    if hit is not None:
        return hit
    entry = sdist_entry(version)
    expected = entry["digests"]["sha256"]
    target = directory / entry["filename"]
    record = target.with_name(target.name + ".sha256")
    if target.exists() and _sha256(target) == expected:
        record.write_text(f"{expected}  {target.name}\n")
        return target
    directory.mkdir(parents=True, exist_ok=True)
    fd, partial = tempfile.mkstemp(dir=directory, suffix=".part")
    partial_path = pathlib.Path(partial)
    try:
        with (
            os.fdopen(fd, "wb") as out,
            urllib.request.urlopen(entry["url"], timeout=300) as response,
        ):
            while chunk := response.read(1 << 20):
                out.write(chunk)
        actual = _sha256(partial_path)
        if actual != expected:
            raise SystemExit(f"{entry['url']}: sha256 {actual}, PyPI lists {expected}")
        partial_path.chmod(0o644)
        partial_path.replace(target)
    finally:
        partial_path.unlink(missing_ok=True)
    record.write_text(f"{expected}  {target.name}\n")
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--version", default=DEFAULT_VERSION)
    group.add_argument(
        "--latest", action="store_true", help="the newest vLLM release on PyPI"
    )
    parser.add_argument(
        "--cache-dir", type=pathlib.Path, help="default: $VLLM_OVERLAY_SDIST_CACHE"
    )
    args = parser.parse_args(argv)
    version = latest_version() if args.latest else args.version
    print(fetch(version, args.cache_dir))
    return 0


if __name__ == "__main__":
    sys.exit(main())
