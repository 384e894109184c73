#!/usr/bin/env bash
# The demo: builds the CPU harness if needed, then runs vLLM 0.11.2 with the
# overlay on the built-in tiny model and prints the KV layout and the text.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
bash "$root/scripts/setup_env.sh"
exec "${OVERLAY_VENV:-$root/.venv}/bin/python" -m vllm_overlay demo "$@"
