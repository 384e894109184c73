#!/usr/bin/env bash
# The test command: builds the CPU harnesses if needed, runs the suites, then
# prints a table (each suite's wall time and passed/failed/errors/skipped, the
# total with the harness build) and every skip's reason.  The exit status is
# the suites' (the table prints when a suite fails too).
#
#   bash scripts/test.sh             # everything: what CI runs (two lanes
#                                    # side by side)
#   bash scripts/test.sh --quick     # inner loop (about 5 min): lint, unit (its
#                                    # slowest tests left out), kernels, one
#                                    # engine test per vLLM release
#   bash scripts/test.sh -e unit     # any tox arguments
#
# Per-test durations (pytest --durations) and junit files come from tox.ini's
# [testenv] setenv; the junit files and tox's result json land in .tox/reports.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
started=$SECONDS
bash "$root/scripts/setup_env.sh"
setup_seconds=$((SECONDS - started))
cd "$root"
tox="${OVERLAY_VENV:-$root/.venv}/bin/tox"
python="${OVERLAY_VENV:-$root/.venv}/bin/python"
reports="$root/.tox/reports" # tox.ini's --junitxml folder
rm -rf "$reports"
mkdir -p "$reports"

# Unit tests --quick leaves out (the full run and CI keep them): the slowest,
# measured with --durations on this 2-core machine (most run benchmarks,
# vLLM, pytest or pre-commit hooks in subprocesses; the pool's liveness
# tests wait on hung and slow servers).
quick_unit_skip=(
  --ignore=tests/unit/test_bench_prefix_reuse_smoke.py
  --ignore=tests/unit/test_latest_staging.py
  --ignore=tests/unit/test_doctor.py
  --ignore=tests/unit/test_patch_tests.py
  --ignore=tests/unit/test_bench_attn_stride_smoke.py
  --ignore=tests/unit/test_core_boundary.py
  --ignore=tests/unit/test_bench_decode_smoke.py
  --ignore=tests/unit/test_register.py
  --ignore=tests/unit/test_pool_liveness.py
  --deselect=tests/unit/test_pool_namespace.py::test_namespace_is_stable_across_processes
  --deselect=tests/unit/test_pool_faults.py::test_the_connector_refuses_to_start_without_redis_py
  --deselect=tests/unit/test_offloading.py::test_host_size_in_bytes
  --deselect=tests/unit/test_version_gate.py::test_no_overlay_feature_runs_stock_vllm
)
# One engine test per release: 0.11.2's cross-layer tokens vs stock; 0.32's
# cross-layer buffer (BLHNC) vs stock 0.32's tokens and logprobs.  The other
# files of the suite are not even collected (collecting imports vLLM).
# (tox pastes its arguments into a bash -c line: keywords without spaces.)
quick_e2e=(tests/e2e/test_cross_layer_e2e.py float32) # tokens_equal_stock[float32]
quick_v0_32=(tests/v0_32/test_cross_layer_cpu.py
  test_blhnc_is_one_buffer_with_blocks_outermost)
only() { # only FILE KEYWORDS: pytest arguments that run FILE's tests KEYWORDS
  local f
  for f in "$(dirname "$1")"/test_*.py; do
    [[ $f == "$1" ]] || printf '%s\n' "--ignore=$f"
  done
  printf '%s\n' -k "$2"
}

calls=0
status=0
run_tox() { # run_tox TOX_ARGS...: one tox call, its result json numbered
  calls=$((calls + 1))
  local json
  json=$(printf '%s/%02d.tox.json' "$reports" "$calls")
  "$tox" --result-json "$json" "$@" || { rc=$?; ((status)) || status=$rc; }
}

lane_pids=() lane_names=()
lane() { # lane NAME TOX_ARGS...: one tox call in the background, its output to a log
  local name=$1 log
  shift
  calls=$((calls + 1))
  log="$reports/lane-$name.log"
  printf '== lane %s: tox %s (log: %s, printed when it ends)\n' "$name" "$*" "$log"
  "$tox" --result-json "$(printf '%s/%02d.tox.json' "$reports" "$calls")" "$@" \
    >"$log" 2>&1 &
  lane_pids+=($!)
  lane_names[$!]=$name
}
end_lanes() { # waits for every lane, printing each one's log as it ends
  local pid rc
  while ((${#lane_pids[@]})); do
    rc=0
    wait -n -p pid "${lane_pids[@]}" || rc=$?
    printf '\n== lane %s ended (exit %s, %d:%02d after the start)\n' \
      "${lane_names[$pid]}" "$rc" $(((SECONDS - started) / 60)) $(((SECONDS - started) % 60))
    cat "$reports/lane-${lane_names[$pid]}.log"
    ((rc == 0 || status)) || status=$rc
    local left=() p
    for p in "${lane_pids[@]}"; do ((p == pid)) || left+=("$p"); done
    lane_pids=("${left[@]}")
  done
}

if [[ ${1:-} == --quick ]]; then
  (($# == 1)) || { echo "test.sh: --quick takes no other arguments" >&2; exit 2; }
  run_tox -e lint,kernels
  run_tox -e unit -- "${quick_unit_skip[@]}"
  mapfile -t e2e_args < <(only "${quick_e2e[@]}")
  mapfile -t v0_32_args < <(only "${quick_v0_32[@]}")
  run_tox -e e2e -- "${e2e_args[@]}"
  run_tox -e v0_32 -- "${v0_32_args[@]}"
elif (($#)); then
  run_tox "$@"
else
  # Two lanes side by side, of about equal length (minutes in a clean-clone
  # run on this 2-core machine, a30e126's parent: v0_32 32, chaos_v0_32 3,
  # chaos 2 | lint, unit 12, kernels, e2e 15, eval 6, patches 3).  Each
  # process runs one OpenMP thread (tox.ini), so two lanes use both cores
  # without spinning against each other; the suites share nothing but the
  # harnesses (each test starts its own servers on free ports, in its own
  # temp folders).
  lane A -e v0_32,v0_33,chaos_v0_32,chaos,v0_32_b
  lane B -e lint,unit,kernels,e2e,eval,patches
  end_lanes
fi

printf '\n== test summary\n'
"$python" "$root/scripts/test_report.py" --reports "$reports" \
  --setup-seconds "$setup_seconds" --total-seconds $((SECONDS - started)) || true
exit "$status"
