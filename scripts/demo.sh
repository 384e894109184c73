#!/usr/bin/env bash
# The demo: builds the CPU harness if needed, then runs vLLM 0.11.2 with the
# overlay on the trained copy model (eval/model/copy_llama): recompute, device
# prefix hit, reload from host memory (OverlayOffloadingConnector, cross-layer
# and stock layouts) and from a Redis pool in another process
# (SharedKVPoolConnector; needs redis-server), as one table.  About a minute
# on 2 idle cores once the harness exists.  Options: --no-pool,
# --no-stock-layout, --prompts N, --max-tokens N, --json PATH, --verbose.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
bash "$root/scripts/setup_env.sh"
# vLLM 0.11.2's torch.compiled CPU sampler corrupts the heap on some AVX-512
# machines; eager sampling does not (see tox.ini).
export TORCHDYNAMO_DISABLE=${TORCHDYNAMO_DISABLE:-1}
exec "${OVERLAY_VENV:-$root/.venv}/bin/python" -m vllm_overlay demo "$@"
