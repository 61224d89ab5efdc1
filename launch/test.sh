#!/usr/bin/env bash
# The test suite, on CPU: set up the environment, then run every test.
set -euo pipefail
cd "$(dirname "$0")/.."
bash launch/setup_env.sh
exec .venv/bin/python -m pytest -q tests "$@"
