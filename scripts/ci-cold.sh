#!/usr/bin/env bash
# CI as a new machine runs it (issue #46): .ci/run in a fresh clone of this repository's HEAD, with every cache it
# could find empty: a HOME of its own (pip's cache, ~/.cache/remat: remat's timing cache and the torch-leg
# environments), XDG_CACHE_HOME, inductor's and Triton's caches, and no pip cache at all. Run it before submitting
# a change to compiled or distributed code.
#   usage: bash scripts/ci-cold.sh [FOLDER]   (default: a new folder under /tmp, removed after a passing run)
# Downloads everything again (two torch releases of about 5 GB each for the legs): 33 min on this 2-core machine
# with the downloads (2026-12-03); CI's limit is 90 min.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
root=${1:-$(mktemp -d /tmp/remat-ci-cold.XXXXXX)}
mkdir -p "$root/home" "$root/xdg" "$root/inductor" "$root/triton"
git clone -q "$repo" "$root/clone"
echo "ci-cold: $(git -C "$root/clone" log --oneline -1) in $root/clone, caches under $root"
started=$SECONDS
set +e
(
  cd "$root/clone"
  env HOME="$root/home" XDG_CACHE_HOME="$root/xdg" TORCHINDUCTOR_CACHE_DIR="$root/inductor" \
      TRITON_CACHE_DIR="$root/triton" PIP_NO_CACHE_DIR=1 REMAT_TORCH_CACHE="$root/home/.cache/remat/torch" \
      CI=true bash .ci/run
)
rc=$?
set -e
echo "ci-cold: .ci/run exit $rc after $(( (SECONDS - started) / 60 )) min $(( (SECONDS - started) % 60 )) s"
if [ "$rc" -eq 0 ] && [ $# -eq 0 ]; then
  rm -rf "$root"
fi
exit $rc
