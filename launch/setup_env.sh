#!/usr/bin/env bash
# Creates .venv (CPU PyTorch 2.13.0, pinned so no multi-GB CUDA build is downloaded) and
# installs this package with its test extras. Safe to run again: it skips what is done.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
if ! .venv/bin/python -c "import mode, torch, pytest, xdist, deepspeed, triton, ruff, transformers, safetensors, tokenizers" >/dev/null 2>&1; then
  .venv/bin/pip install -q --upgrade pip
  .venv/bin/pip install -q torch==2.13.0
  .venv/bin/pip install -q -e ".[test,cpu-dist,hf]"
fi
