#!/usr/bin/env bash
# Create .venv with remat and its test dependencies. Keeps a torch that is already installed
# (in .venv or the system Python); otherwise installs the CPU build on a machine without an
# NVIDIA GPU (never the multi-GB CUDA build) and the default build where nvidia-smi works.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv --system-site-packages .venv
fi
VPY=.venv/bin/python
if ! "$VPY" -c "import torch" >/dev/null 2>&1; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then
    "$VPY" -m pip install -q torch
  else
    # the CPU wheel: from a local wheel/index if pip is configured with one, else PyTorch's CPU index
    "$VPY" -m pip install -q "torch==2.13.0+cpu" 2>/dev/null \
      || "$VPY" -m pip install -q torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu \
      || "$VPY" -m pip install -q torch --index-url https://download.pytorch.org/whl/cpu
  fi
fi
# everything else with the torch installed pinned (a loose torch requirement could pull another build)
"$VPY" -c "import torch; print('torch==' + torch.__version__)" > .venv/torch-constraint.txt
"$VPY" -m pip install -q -c .venv/torch-constraint.txt -e ".[dev]"
"$VPY" -c "import torch, remat; print(f'remat {remat.__version__} with torch {torch.__version__} in .venv')"
