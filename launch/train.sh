#!/usr/bin/env bash
# Train from any config: bash launch/train.sh configs/X.yaml [--section.field=value ...]
set -euo pipefail
cd "$(dirname "$0")/.."
config=${1:?usage: launch/train.sh CONFIG.yaml [--section.field=value ...]}
shift
exec .venv/bin/python -m mode.train --config "$config" "$@"
