#!/usr/bin/env bash
# The main job: set up the environment, then train the small MoD model of
# configs/mod_tiny.yaml on the standard library's source code, on CPU (about two minutes).
# Extra arguments are config overrides, e.g. --train.max_steps=100 --train.out_dir=runs/try
set -euo pipefail
cd "$(dirname "$0")/.."
bash launch/setup_env.sh
out="runs/mod_tiny-$(date +%Y%m%d-%H%M%S)"
exec .venv/bin/python -m mode.train --config configs/mod_tiny.yaml --train.out_dir="$out" "$@"
