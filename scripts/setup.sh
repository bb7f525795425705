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
# the torchtitan extra (torchtitan 0.3 and triton, for remat.integrations.torchtitan's tests), after .[dev]: its
# datasets<4.8 pins huggingface-hub<2 and transformers 5 needs >=2.4, so resolved together pip would go back to
# transformers 4; the hub transformers installed is put back after (datasets imports with it, and remat uses none of
# torchtitan's data loading)
if ! "$VPY" -c "import torchtitan, triton" >/dev/null 2>&1; then
  HUB=$("$VPY" -c "import huggingface_hub; print(huggingface_hub.__version__)")
  "$VPY" -m pip install -q -c .venv/torch-constraint.txt "torchtitan==0.3.0" triton
  "$VPY" -m pip install -q -c .venv/torch-constraint.txt "huggingface-hub==$HUB"  # (pip names the conflict: expected)
fi
"$VPY" -c "import torch, remat; print(f'remat {remat.__version__} with torch {torch.__version__} in .venv')"
