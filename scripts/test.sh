#!/usr/bin/env bash
# The test command: builds the CPU harness if needed, then runs the suites.
#   bash scripts/test.sh [tox args, e.g. -e unit]
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
bash "$root/scripts/setup_env.sh"
cd "$root"
if (($#)); then
  exec "${OVERLAY_VENV:-$root/.venv}/bin/tox" "$@"
fi
exec "${OVERLAY_VENV:-$root/.venv}/bin/tox" -e lint,unit,kernels,e2e,chaos,chaos_v0_32,eval,v0_32,patches
