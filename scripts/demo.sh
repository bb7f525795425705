#!/usr/bin/env bash
# Set up .venv (scripts/setup.sh) and run remat's main job on the built-in GPT example.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh >/dev/null
exec .venv/bin/python examples/train_gpt.py "$@"
