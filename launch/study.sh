#!/usr/bin/env bash
# The evidence study on a 4-GPU machine, one part at a time (each part is a resumable sweep of
# single-GPU runs, four at once): bash launch/study.sh PART [--dry-run]
#   data       tokenize the first 300 MB of the Python sources installed (standard library and
#              packages) with a byte-level BPE of 8192 tokens
#   isoflop    dense vs MoD (12.5%, every other block) x 3 sizes x 3 FLOP budgets x 2 seeds
#   routing    learned vs random routing; capacity 12.5 / 25 / 50%; every block vs every other
#   experts    MoE vs Staged MoDE vs Integrated MoDE vs MoE at lowered capacity
#   causal     causal method (a) auxiliary loss vs (b) predictor
#   controls   more dense points on the isoflop curves (not in all): a size below the grid (256 / 6
#              layers), and the 512-wide MoD's five dense layers alone, at each budget x 2 seeds
#   evaluate   mode.evaluate every finished run on 64 validation batches (eval.json beside it),
#              one a GPU at once
#   report     mode.report of every part into reports/study/PART, and the routing map of a held-out
#              file (secrets.py) by the middle-size MoD model of the largest budget
#   all        every part: isoflop (a run a GPU), then routing beside experts and causal (two
#              runs a GPU), then evaluate and report
# Every run is a point of configs/study_gpu.yaml; docs/reports.md walks the results. Extra
# arguments go to the part's command (e.g. overrides for every run). Environment: PYTHON, GPUS
# (default 0,1,2,3; empty: one run at a time on the config's device), STUDY_DATA, STUDY_RUNS and
# STUDY_REPORTS (default data/study_bpe8k, runs/study, reports/study).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
GPUS=${GPUS-0,1,2,3}
DATA=${STUDY_DATA:-data/study_bpe8k}
RUNS=${STUDY_RUNS:-runs/study}
REPORTS=${STUDY_REPORTS:-reports/study}
part=${1:?usage: bash launch/study.sh data|isoflop|routing|experts|causal|controls|evaluate|report|all [--dry-run]}
shift
sweep() {
  "$PY" -m mode.sweep --config configs/study_gpu.yaml ${GPUS:+--gpus "$GPUS"} --data.path="$DATA" "$@"
}
seeds=(--vary train.seed=0,1)
case "$part" in
  data)
    [ -f "$DATA/meta.json" ] || "$PY" -m mode.data prepare --out "$DATA" --source python --max-bytes 300000000 \
      --train-bpe --vocab-size 8192 "$@" ;;
  isoflop)
    sweep --out "$RUNS"/isoflop "${seeds[@]}" \
      --vary "model.block_pattern=[dense],[dense,mod]" --vary train.flops_budget=5e14,1.5e15,5e15 \
      --zip model.d_model=384,512,768 --zip model.n_heads=6,8,12 --zip model.n_layers=8,10,12 \
      --zip model.d_ff=1024,1408,2048 "$@" ;;
  routing)
    sweep --out "$RUNS"/random "${seeds[@]}" --vary routing.random=false,true --routing.causal=none "$@"
    sweep --out "$RUNS"/capacity "${seeds[@]}" --vary routing.capacity=0.125,0.25,0.5 \
      --vary "model.block_pattern=[dense,mod],[mod]" "$@" ;;
  experts)
    sweep --out "$RUNS"/experts "${seeds[@]}" --routing.causal=none --moe.n_experts=8 \
      --zip "model.block_pattern=[dense,moe],[dense,mode_staged],[dense,mode_integrated],[dense,moe]" \
      --zip moe.n_noop=0,0,8,0 --zip moe.capacity_factor=1.0,1.0,1.0,0.5 "$@" ;;
  causal)
    sweep --out "$RUNS"/causal "${seeds[@]}" --vary routing.causal=aux_loss,predictor "$@" ;;
  controls)  # into the isoflop folder: its report and isoflop.png show them on the dense curves
    sweep --out "$RUNS"/isoflop "${seeds[@]}" \
      --vary "model.block_pattern=[dense]" --vary train.flops_budget=5e14,1.5e15,5e15 \
      --zip model.d_model=256,512 --zip model.n_heads=4,8 --zip model.n_layers=6,5 --zip model.d_ff=704,1408 "$@" ;;
  evaluate)
    gpus=(${GPUS//,/ })
    pending=()
    for run in "$RUNS"/*/*/; do
      [ -f "$run/checkpoint.pt" ] && [ ! -f "$run/eval.json" ] && pending+=("$run")
    done
    evaluate_every() {  # evaluate_every FIRST STEP: pending runs FIRST, FIRST + STEP, ... in one process
      local mine=()
      for ((j = $1; j < ${#pending[@]}; j += $2)); do mine+=("${pending[j]}"); done
      [ ${#mine[@]} -eq 0 ] || "$PY" -m mode.evaluate "${mine[@]}" --batches 64 --save eval.json "${extra[@]}" > /dev/null
    }
    extra=("$@")
    if [ ${#gpus[@]} -eq 0 ]; then
      evaluate_every 0 1
    else  # one worker a GPU, each taking every n-th run
      workers=()
      for i in "${!gpus[@]}"; do
        (export CUDA_VISIBLE_DEVICES=${gpus[i]}; evaluate_every "$i" ${#gpus[@]}) &
        workers+=($!)
      done
      for pid in "${workers[@]}"; do wait "$pid"; done
    fi ;;
  report)
    shopt -s nullglob
    for sweep_dir in "$RUNS"/*/; do
      name=$(basename "$sweep_dir")
      "$PY" -m mode.report "$sweep_dir"*/ --out "$REPORTS/$name"
    done
    for run in "$RUNS"/isoflop/*n_layers=10*seed=0*block_pattern=dense-mod+flops_budget=5e15/; do
      [ -f "$run/checkpoint.pt" ] || continue
      "$PY" -m mode.report routing-map "$run" --causal --max-tokens 96 --out "$REPORTS/routing_map.png" \
        --text-file "$("$PY" -c 'import secrets; print(secrets.__file__)')"
    done ;;
  all)
    bash "$0" isoflop "$@"  # alone: its wall-clock times compare dense and MoD on a GPU each
    bash "$0" routing "$@" &
    routing=$!
    for other in experts causal; do bash "$0" "$other" "$@"; done
    wait "$routing"
    [[ " $* " == *" --dry-run "* ]] || { bash "$0" evaluate; bash "$0" report; } ;;
  *) echo "unknown part: $part" >&2; exit 2 ;;
esac
