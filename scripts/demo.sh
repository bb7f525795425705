#!/usr/bin/env bash
# Set up .venv (scripts/setup.sh) and run remat's main job, the measured memory/step-time tradeoff
# table, on the built-in GPT example. Extra arguments go to `remat tradeoff`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh >/dev/null
# the target defaults to the built-in GPT; options alone (e.g. --layers 2) apply to it
if [ $# -eq 0 ] || [[ "$1" == -* ]]; then set -- gpt "$@"; fi
exec .venv/bin/remat tradeoff "$@"
