#!/usr/bin/env bash
# The speed campaign on a 4-GPU host: four lanes at once, each on a GPU of its own, every
# benchmark measuring its baseline in the same process (docs/benchmarks.md says what each prints).
#
#   source .whl/setup_device.sh > /tmp/setup.log 2>&1 && bash bench/speed_targets.sh
#   TINY=1 bash bench/speed_targets.sh      # CPU smoke run: every lane with --tiny, one after another
#
#   lane 0  decode.md   bench.decode: decode and prefill against dense, every prompt and batch
#   lane 1  kinds.md    bench.block_kinds: every block kind with CUDA graphs, then compiled
#   lane 2  step.md     bench.mod_step with the auto and cuDNN attention backends, then
#                       bench.block_profile of the MoE and MoDE blocks (where their time goes)
#   lane 3  tests.md    the GPU tests of the decode path, then bench.prefill
#
# Environment: PYTHON (default python3), LOG_DIR (default $OUT/speed, else /tmp/speed),
# LANE_TIMEOUT (seconds a lane may run, default 540; a lane cut short says so at its end),
# GPUS (four GPU indices, default 0,1,2,3).
set -uo pipefail
cd "$(dirname "$0")/.."
export PY=${PYTHON:-python3}
LOG_DIR=${LOG_DIR:-${OUT:-/tmp}/speed}
LANE_TIMEOUT=${LANE_TIMEOUT:-540}
IFS=, read -r -a gpus <<< "${GPUS:-0,1,2,3}"
mkdir -p "$LOG_DIR"
if [ -n "${TINY:-}" ]; then
  export TINY_ARG=--tiny GRAPH_MODES=eager BACKENDS=auto
else
  export TINY_ARG= GRAPH_MODES="eager + CUDA graphs" BACKENDS="auto cudnn"
fi

lane_decode() { "$PY" -m bench.decode $TINY_ARG; }
lane_kinds() {
  "$PY" -m bench.block_kinds $TINY_ARG --modes "$GRAPH_MODES"
  [ -n "$TINY_ARG" ] || "$PY" -m bench.block_kinds --modes compiled
}
lane_step() {
  [ -n "$TINY_ARG" ] || modes=compiled
  "$PY" -m bench.mod_step $TINY_ARG --modes "$GRAPH_MODES" ${modes:-} --attention-backend $BACKENDS
  "$PY" -m bench.block_profile $TINY_ARG --kinds moe mode_staged mode_integrated --top 8
}
lane_tests() {
  "$PY" -c "from mode.kernels import graph_if; print('IF nodes available:', graph_if.available())"
  "$PY" -m pytest -q -rfEs -p no:cacheprovider tests/test_graph_if.py tests/test_moe_decode.py \
    tests/test_decode_rows.py tests/test_attention_backend.py tests/test_generate.py
  "$PY" -m bench.prefill $TINY_ARG
}
export -f lane_decode lane_kinds lane_step lane_tests

run_lane() {  # run_lane GPU NAME: the lane's output into LOG_DIR/NAME.md, its exit status last
  local out="$LOG_DIR/$2.md"
  CUDA_VISIBLE_DEVICES=$1 timeout -k 15 "$LANE_TIMEOUT" bash -c "lane_$2" > "$out" 2>&1
  local rc=$?
  [ "$rc" -eq 124 ] && echo "lane $2: cut short after $LANE_TIMEOUT s" >> "$out"
  echo "lane $2: exit $rc" >> "$out"
}

names=(decode kinds step tests)
if [ -n "${TINY:-}" ]; then
  for name in "${names[@]}"; do run_lane "" "$name"; done
else
  [ "${#gpus[@]}" -ge 4 ] || { echo "bench/speed_targets.sh: needs four GPUs (GPUS=$GPUS)" >&2; exit 2; }
  for i in 0 1 2 3; do run_lane "${gpus[i]}" "${names[i]}" & done
  wait
fi
for name in "${names[@]}"; do tail -1 "$LOG_DIR/$name.md"; done
