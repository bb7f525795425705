#!/usr/bin/env bash
# Run the suite (tests/unit + tests/integration, as scripts/test.sh) on another torch release, from PyPI.
#   usage: bash scripts/torch-leg.sh VERSION [pytest arguments]
# PyPI's wheels are CUDA builds (about 5 GB with their NVIDIA libraries); on a machine without a GPU they run
# on the CPU, as the suite does. The virtual environment is kept in ${REMAT_TORCH_CACHE:-~/.cache/remat/torch}
# so that later CI runs on the same machine reuse it (the first install of a release takes 2-4 minutes).
# A machine-wide pip constraint (this workplace caps torch at 2.14.1) is replaced, for these installs only,
# by one that pins the release asked for.
set -euo pipefail
cd "$(dirname "$0")/.."
quiet() {  # pip, without the warning it prints per package for this machine's local indexes that lack it
  "$@" 2> >(grep -v "^WARNING: Location 'file:" >&2)
}
V=${1:?usage: scripts/torch-leg.sh VERSION [pytest arguments]}
shift
CACHE=${REMAT_TORCH_CACHE:-$HOME/.cache/remat/torch}
VENV=$CACHE/venv-$V
mkdir -p "$CACHE"
PIN=$CACHE/constraint-$V.txt
echo "torch==$V" > "$PIN"
if [ ! -f "$VENV/.torch-ready" ]; then
  rm -rf "$VENV"
  python3 -m venv "$VENV"
  PIP_CONSTRAINT=$PIN quiet "$VENV/bin/python" -m pip install -q "torch==$V"
  touch "$VENV/.torch-ready"
fi
# remat (editable, from this checkout) and the test dependencies, resolved against the pinned torch
PIP_CONSTRAINT=$PIN quiet "$VENV/bin/python" -m pip install -q -e ".[dev]"
"$VENV/bin/python" -c "import torch, remat, sys; assert remat.__file__.startswith(sys.argv[1]), remat.__file__; \
print(f'remat from {sys.argv[1]} with torch {torch.__version__} in $VENV')" "$PWD/src"
set +e
"$VENV/bin/python" -m pytest -q -n 2 --dist loadfile -p no:cacheprovider "$@"
rc=$?
echo "torch $V leg: ${SECONDS} s in all (install and suite), pytest exit $rc"
exit $rc
