#!/usr/bin/env bash
# The test suite, on CPU: set up the environment, then run every test.
set -euo pipefail
cd "$(dirname "$0")/.."
bash launch/setup_env.sh
# One pytest worker per core, at most 4 (pytest-xdist; `-n 0` after the command runs them in one process).
exec .venv/bin/python -m pytest -q -n auto --maxprocesses 4 tests "$@"
