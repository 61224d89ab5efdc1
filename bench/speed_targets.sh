#!/usr/bin/env bash
# The speed campaign: its parts spread over the GPUs of one host, every
# benchmark measuring its baseline in the same process (docs/benchmarks.md says what each prints).
#
#   source .whl/setup_device.sh > /tmp/setup.log 2>&1 && bash bench/speed_targets.sh
#   TINY=1 bash bench/speed_targets.sh      # CPU smoke run: every part with --tiny, one after another
#
#   part          file             what
#   decode        decode.md        bench.decode: decode and prefill against dense, every prompt and batch
#   decode_rows   decode_rows.md   bench.decode at batch 64 with every row computed (no compacted rows)
#   kinds         kinds.md         bench.block_kinds: every block kind with CUDA graphs (--busy)
#   compiled      compiled.md      bench.block_kinds: every block kind compiled (--busy)
#   train_configs train_configs.md bench.train_configs: python -m mode.train on the GPU configs, per FLOP
#   step          step.md          bench.mod_step with the auto and cuDNN attention backends
#   profile       profile.md       bench.block_profile of the MoE and MoDE blocks, every null kind (where their time goes)
#   optimizer     optimizer.md     bench.optimizer: the update alone, bf16 weights' masters against fused AdamW
#   prefill       prefill.md       bench.prefill: prefill launches, syncs and GPU time against dense
#   row_ops       row_ops.md       bench.row_ops: row moves and decode attention, one op at a time
#   decode_tests  decode_tests.md  the GPU tests of the decode path (CUDA graphs, IF nodes, MoE decode)
#   train_tests   train_tests.md   the GPU tests of CUDA-graphed training (bf16 weights, the overlapped
#                                  update and its staged launch) and of the kernels
#
# PARTS (default: all, in that order) names the parts to run. They are dealt out to the GPUs in
# turn: each GPU runs its parts one after another, the GPUs at once. Before any part starts,
# the CUDA graph IF-node extension is built (once per machine).
#
# Environment: PYTHON (default python3), LOG_DIR (default $OUT/speed, else /tmp/speed),
# PART_TIMEOUT (seconds a part may run, default 540; a part cut short says so at its end),
# DEADLINE (seconds after which no part starts and a running one is cut short, default none),
# GPUS (GPU indices, default 0,1,2,3), OPTIMIZER (the kinds, compiled and step parts' --optimizer:
# train, the default, mode.train's own step (bf16 weights on a GPU); train-float32, the same with
# float32 weights; adamw, plain fused AdamW on every float32 parameter, as campaigns before it),
# KIND_ROUNDS (the kinds part's --rounds, each row interleaved with dense: default 2, 1 with TINY).
set -uo pipefail
cd "$(dirname "$0")/.."
export PY=${PYTHON:-python3} OPTIMIZER=${OPTIMIZER:-train}
LOG_DIR=${LOG_DIR:-${OUT:-/tmp}/speed}
PART_TIMEOUT=${PART_TIMEOUT:-540}
DEADLINE=${DEADLINE:-}
IFS=, read -r -a gpus <<< "${GPUS:-0,1,2,3}"
read -r -a parts <<< "${PARTS:-decode decode_rows kinds compiled train_configs step profile optimizer prefill row_ops decode_tests train_tests}"
mkdir -p "$LOG_DIR"
if [ -n "${TINY:-}" ]; then
  export TINY_ARG=--tiny GRAPH_MODES=eager BACKENDS=auto KIND_ROUNDS=${KIND_ROUNDS:-1}
else
  export TINY_ARG= GRAPH_MODES="eager + CUDA graphs" BACKENDS="auto cudnn" KIND_ROUNDS=${KIND_ROUNDS:-2}
fi

part_decode() { "$PY" -m bench.decode $TINY_ARG; }
# batch 64 is bound by its launches: the compacted rows' extra kernels against every row computed
part_decode_rows() {
  local batch=64
  [ -z "$TINY_ARG" ] || batch=4
  "$PY" -m bench.decode $TINY_ARG --batches $batch --models MoD "Staged MoDE" --decoder-arg compact_rows=False
}
part_kinds() {
  "$PY" -m bench.block_kinds $TINY_ARG --modes "$GRAPH_MODES" --optimizer "$OPTIMIZER" --rounds "$KIND_ROUNDS" --busy
}
part_compiled() {
  [ -z "$TINY_ARG" ] || { gpu_only "compiled block kinds"; return; }
  "$PY" -m bench.block_kinds --modes compiled --optimizer "$OPTIMIZER" --busy
}
part_train_configs() { "$PY" -m bench.train_configs $TINY_ARG; }
part_step() {
  [ -n "$TINY_ARG" ] || modes=compiled
  "$PY" -m bench.mod_step $TINY_ARG --modes "$GRAPH_MODES" ${modes:-} --attention-backend $BACKENDS \
    --optimizer "$OPTIMIZER"
}
part_profile() { "$PY" -m bench.block_profile $TINY_ARG --kinds moe mode_staged mode_integrated --noop-kinds zero copy constant --top 8; }
part_optimizer() {
  [ -z "$TINY_ARG" ] || { gpu_only "the update alone"; return; }
  "$PY" -m bench.optimizer
}
part_prefill() { "$PY" -m bench.prefill $TINY_ARG; }
part_row_ops() {
  [ -z "$TINY_ARG" ] || { gpu_only "row moves and decode attention"; return; }
  "$PY" -m bench.row_ops
}
gpu_only() { echo "$1: on a GPU only"; }
part_decode_tests() {
  [ -z "$TINY_ARG" ] || { gpu_only "decode tests"; return; }
  "$PY" -m pytest -q -rfEs -p no:cacheprovider tests/test_graph_if.py tests/test_moe_decode.py \
    tests/test_decode_rows.py tests/test_generate.py
}
part_train_tests() {
  [ -z "$TINY_ARG" ] || { gpu_only "CUDA-graphed training tests"; return; }
  "$PY" -m pytest -q -rfEs -p no:cacheprovider tests/test_train.py \
    -k "cuda_graph or bf16 or overlapped or capture_mid_run or resume_continues"
  "$PY" -m pytest -q -rfEs -p no:cacheprovider tests/test_kernels.py tests/test_bf16_weights.py tests/test_deferred_update.py
}
export -f gpu_only part_decode part_decode_rows part_kinds part_compiled part_train_configs part_step part_profile part_optimizer part_prefill \
  part_row_ops part_decode_tests part_train_tests

run_part() {  # run_part GPU NAME: the part's output into LOG_DIR/NAME.md, its time and exit status last
  local out="$LOG_DIR/$2.md" start=$SECONDS limit=$PART_TIMEOUT
  if [ -n "$DEADLINE" ]; then
    limit=$(( DEADLINE - SECONDS < limit ? DEADLINE - SECONDS : limit ))
    [ "$limit" -gt 0 ] || { echo "part $2: not started (past DEADLINE)" > "$out"; return; }
  fi
  CUDA_VISIBLE_DEVICES=$1 timeout -k 15 "$limit" bash -c "part_$2" > "$out" 2>&1
  local rc=$?
  [ "$rc" -eq 124 ] && echo "part $2: cut short after $limit s" >> "$out"
  echo "part $2: ran $((SECONDS - start)) s" >> "$out"
  echo "part $2: exit $rc" >> "$out"
}

run_gpu() {  # run_gpu SLOT: the parts dealt to GPU slot SLOT, one after another
  local i
  for ((i = $1; i < ${#parts[@]}; i += ${#gpus[@]})); do run_part "${gpus[$1]}" "${parts[i]}"; done
}

for name in "${parts[@]}"; do
  declare -F "part_$name" > /dev/null || { echo "bench/speed_targets.sh: unknown part $name" >&2; exit 2; }
done
"$PY" -c "from mode.kernels import graph_if; print('CUDA graph IF nodes available:', graph_if.available())" \
  > "$LOG_DIR/if_nodes.md" 2>&1
if [ -n "${TINY:-}" ]; then
  gpus=("")
  run_gpu 0
else
  for ((slot = 0; slot < ${#gpus[@]} && slot < ${#parts[@]}; slot++)); do run_gpu "$slot" & done
  wait
fi
for name in "${parts[@]}"; do tail -1 "$LOG_DIR/$name.md"; done
