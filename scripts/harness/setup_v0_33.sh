#!/usr/bin/env bash
# The third harness: vLLM 0.33.0's Python code (no GPU release has a CPU
# build: VLLM_TARGET_DEVICE=empty, no compiled extensions) for the tests of
# the overlay's scheduler-side features against 0.33's own classes (the
# pool tier in TieringOffloadingManager, the PP budget in
# get_kv_cache_configs / EngineArgs).  No 0.33 engine runs here.
#
# A layer over the 0.32 harness, not a copy of it: .venv-0.33 is a virtualenv
# whose site-packages comes first and then reads .venv-0.32's (a .pth:
# site.addsitedir), so it runs 0.32's torch 2.13.0+cpu (0.33 pins 2.14.0,
# which has no CPU build here), the test tools and the overlay (editable)
# from there, and holds only vLLM 0.33.0 and what 0.33 asks for beyond
# 0.32's packages (pip installs into the layer; it never touches
# .venv-0.32).  Built after .venv-0.32 by scripts/setup_env.sh; idempotent
# (a stamp of this script, the base's stamp and the sdist's digest).
#
#   bash scripts/harness/setup_v0_33.sh   # at .venv-0.33 (or $OVERLAY_VENV_0_33)
set -euo pipefail

root=$(cd "$(dirname "$0")/../.." && pwd)
venv=${OVERLAY_VENV_0_33:-$root/.venv-0.33}
base=${OVERLAY_VENV_0_32:-$root/.venv-0.32}
python=${PYTHON:-python3.11}
command -v "$python" >/dev/null || python=python3
cache=${VLLM_OVERLAY_SDIST_CACHE:-$HOME/.cache/vllm-overlay/sdists}
sdist=$cache/vllm-0.33.0.tar.gz
log() { printf '\n== setup_v0_33: %s\n' "$*"; }

[[ -f $base/.harness-stamp ]] || {
  echo "setup_v0_33: the 0.32 harness ($base) is not built: bash scripts/setup_env.sh" >&2
  exit 1
}
if [[ ! -f $sdist.sha256 ]]; then
  log "vLLM 0.33.0 sdist into $cache"
  "$base/bin/python" "$root/patches/tools/fetch_sdist.py" --version 0.33.0 >/dev/null
fi
stamp=$(cat "$0" "$base/.harness-stamp" "$sdist.sha256" | sha256sum | cut -c1-16)
if [[ -f "$venv/.harness-stamp" && "$(cat "$venv/.harness-stamp")" == "$stamp" ]]; then
  exit 0
fi

log "creating $venv over $base"
rm -rf "$venv"
"$python" -m venv "$venv"
own=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
under=$("$base/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
# After this layer's own packages: the base's, with its .pth files (the
# overlay's editable finder, the tests' spawn shim).
printf 'import site; site.addsitedir(%s)\n' "'$under'" >"$own/_harness_base_0_32.pth"

log "vLLM 0.33.0 (VLLM_TARGET_DEVICE=empty: Python only) on the base's torch"
pip=("$venv/bin/python" -m pip install --disable-pip-version-check -q --no-compile)
# The venv's own setuptools (65.5, Python 3.11's) would hide the base's
# 78.1.1, which the sdist's build needs; setuptools-scm, setuptools-rust
# (imported by its setup.py; the Rust part itself is optional and skipped)
# and wheel are not in the base.
"$venv/bin/python" -m pip uninstall --disable-pip-version-check -q -y setuptools
"${pip[@]}" setuptools-scm setuptools-rust wheel
VLLM_TARGET_DEVICE=empty "${pip[@]}" --no-build-isolation \
  -c "$root/requirements/cpu-harness-0.32-constraints.txt" "$sdist"

log "self-check"
VLLM_TARGET_DEVICE=cpu VLLM_OVERLAY_DISABLE=1 "$venv/bin/python" - <<'PY'
from importlib.metadata import version

import torch
import vllm
from vllm.platforms import current_platform

assert vllm.__version__.startswith("0.33."), vllm.__version__
assert version("vllm").startswith("0.33."), version("vllm")
assert torch.__version__.startswith("2.13."), torch.__version__
assert current_platform.is_cpu(), f"platform is {current_platform!r}, expected CPU"
# The scheduler side the overlay's 0.33 features meet.
import vllm.engine.arg_utils  # noqa: F401
import vllm.v1.core.kv_cache_planning  # noqa: F401
import vllm.v1.kv_offload.tiering.manager  # noqa: F401
import vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector  # noqa: F401
import vllm_overlay  # noqa: F401  (the base's editable install)
print(f"vLLM {vllm.__version__} (Python only) on {type(current_platform).__name__}, "
      f"torch {torch.__version__}: OK")
PY
echo "$stamp" >"$venv/.harness-stamp"
