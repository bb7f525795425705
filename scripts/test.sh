#!/usr/bin/env bash
# Set up .venv (scripts/setup.sh) and run the test suite. Extra arguments go to pytest.
# Two pytest-xdist workers, one test file each at a time (--dist loadfile: a module's fixtures, such as the
# distributed one, are made once), one torch thread each (tests/conftest.py): the suite's tiny models keep one
# core busy, so one process left the second idle (274.9 s in a fresh clone; 200.5 s with two workers).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest -q -n 2 --dist loadfile "$@"
