#!/usr/bin/env bash
# The vLLM sdists the tests compare against, in patches/tools/fetch_sdist.py's
# cache ($VLLM_OVERLAY_SDIST_CACHE, default ~/.cache/vllm-overlay/sdists; tox
# passes VLLM_* on, so the suites read this same cache):
#   0.11.2  the patch series' base (patches env, check_upstream.py)
#   0.32.0  the v0_32 set's reference (release_compat.py, its unit tests)
#   0.33.0  the newest release (stage_latest.py, release_compat.py's record)
# Called by scripts/setup_env.sh on every run: a version whose sdist and
# digest record are there is not looked at again (the tests check the digest).
# Without the network, a missing sdist is named with the command that fetches
# it, and the tests that need it fail with that command; the rest still run.
#
#   bash scripts/harness/fetch_sdists.sh PYTHON
set -uo pipefail
python=$1
root=$(cd "$(dirname "$0")/../.." && pwd)
cache=${VLLM_OVERLAY_SDIST_CACHE:-$HOME/.cache/vllm-overlay/sdists}
for v in 0.11.2 0.32.0 0.33.0; do
  if [[ -f $cache/vllm-$v.tar.gz && -f $cache/vllm-$v.tar.gz.sha256 ]]; then
    continue
  fi
  printf '\n== setup_env: vLLM %s sdist into %s\n' "$v" "$cache"
  if ! "$python" "$root/patches/tools/fetch_sdist.py" --version "$v" >/dev/null; then
    printf 'setup_env: WARNING: vLLM %s sdist not fetched; tests that compare with it will fail; run: %s patches/tools/fetch_sdist.py --version %s\n' \
      "$v" "$python" "$v" >&2
  fi
done
exit 0
