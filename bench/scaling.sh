#!/usr/bin/env bash
# Multi-GPU scaling table: python -m bench.scaling for N = 1, 2, 4, 8 processes (those <= the GPUs
# `nvidia-smi -L` lists), --impl mode and --impl deepspeed, one table with speedups vs 1 GPU.
#
#   source .whl/setup_device.sh > /tmp/setup.log 2>&1 && bash bench/scaling.sh [bench.scaling args ...]
#
# Sources nothing itself: python3 must already import torch and deepspeed (setup_device.sh).
# Environment (all optional):
#   PYTHON=python3            the interpreter
#   IMPLS="mode deepspeed"    impls to run, in this order at each N; "mode-moe" is --impl mode on
#                             configs/moe_gpu.yaml (expert FLOPs equal to DeepSpeed's top-1 at capacity 1);
#                             "mode-compiled" / "deepspeed-compiled": the same with --train.compile=true
#   COUNTS="1 2 4"            process counts (default: 1 2 4 8, those <= the GPUs)
#   GPUS=N                    the GPU count, instead of nvidia-smi -L (e.g. for a CPU smoke run with --tiny)
#   RUN_TIMEOUT=120           seconds per launch (killed after, its row marked as such)
#   BUDGET_S=400              no new launch starts after this many seconds
#   LOG_DIR=$OUT/scaling      per-run logs and table.md ($OUT, else /tmp)
# Extra arguments go to every bench.scaling run (e.g. --steps 10, --zero-stage 1, --config ...;
# the mode-moe rows keep their own --config).
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
IMPLS=${IMPLS:-mode deepspeed}
RUN_TIMEOUT=${RUN_TIMEOUT:-120}
BUDGET_S=${BUDGET_S:-400}
LOG_DIR=${LOG_DIR:-${OUT:-/tmp}/scaling}
mkdir -p "$LOG_DIR"
rm -f "$LOG_DIR"/run_*.log "$LOG_DIR"/table.md

if [ -z "${GPUS:-}" ]; then
  GPUS=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)
fi
GPUS=${GPUS:-0}
if command -v nvidia-smi >/dev/null 2>&1; then
  CARD=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
else
  CARD=CPU
fi
if [ -z "${COUNTS:-}" ]; then
  COUNTS=""
  for n in 1 2 4 8; do [ "$n" -le "$GPUS" ] && COUNTS="$COUNTS $n"; done
fi
if [ -z "${COUNTS// /}" ]; then
  echo "bench/scaling.sh: no GPU found (nvidia-smi -L); set GPUS=N (and pass --tiny for a CPU run)" >&2
  exit 2
fi
echo "card: $CARD; GPUs: $GPUS; process counts:$COUNTS; impls: $IMPLS; per-run timeout ${RUN_TIMEOUT} s; logs in $LOG_DIR"

start=$SECONDS
for n in $COUNTS; do
  for impl in $IMPLS; do
    log="$LOG_DIR/run_${impl}_${n}.log"
    if [ $((SECONDS - start)) -ge "$BUDGET_S" ]; then
      echo "| $impl | $n | skipped: time budget (${BUDGET_S} s) spent | | |" | tee "$log"
      continue
    fi
    t0=$SECONDS
    case "$impl" in
      mode-moe) impl_args=(--impl mode --config configs/moe_gpu.yaml --label mode-moe) ;;
      *-compiled) impl_args=(--impl "${impl%-compiled}" --label "$impl" --train.compile=true) ;;
      *) impl_args=(--impl "$impl") ;;
    esac
    timeout -k 15 "$RUN_TIMEOUT" "$PYTHON" -m torch.distributed.run --standalone --nproc_per_node "$n" \
      -m bench.scaling "$@" "${impl_args[@]}" >"$log" 2>&1
    rc=$?
    if grep -q "^| $impl | $n |" "$log" && [ "$rc" -eq 0 ]; then
      grep "^| $impl | $n |" "$log"
    else
      why="exit $rc"; [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ] && why="timed out after ${RUN_TIMEOUT} s"
      echo "| $impl | $n | failed: $why (see $log) | | |" | tee -a "$log"
      { grep -E -m6 -A4 '^error:|bench/scaling.py failed|[A-Za-z]+Error: |CUDA out of memory' "$log"; echo ...; tail -4 "$log"; } | sed 's/^/    /'
    fi
    echo "    ($impl, $n processes: $((SECONDS - t0)) s wall including start-up)"
  done
done

"$PYTHON" - "$LOG_DIR" "$CARD" "$GPUS" "$IMPLS" <<'EOF'
import re
import sys
from pathlib import Path

log_dir, card, gpus, impls = Path(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4].split()
rows, contexts = {}, {}  # contexts: label -> {process count: that run's description line}
for log in sorted(log_dir.glob("run_*.log")):
    for line in log.read_text(errors="replace").splitlines():
        m = re.match(r"^\| (\S+) \| (\d+) \| ([\d,]+) \| ([\d.]+) \| ([^|]*) \|$", line)
        if m:
            rows[(m[1], int(m[2]))] = (float(m[3].replace(",", "")), float(m[4]), m[5].strip())
        elif line.startswith("| "):
            parts = [p.strip() for p in line.strip("|").split("|")]
            rows.setdefault((parts[0], int(parts[1])), parts[2])  # a failed or skipped run
        elif line.startswith("# ") and not line.startswith("# step ms"):
            n = int(log.stem.rsplit("_", 1)[1])  # run_<impl>_<n>.log
            contexts.setdefault(line.split(":", 1)[0][2:], {})[n] = line[2:]


def described(label: str) -> list[str]:
    """The runs of one impl: one line where they differ only in the process count (written N),
    else one line per count; every count's run is described, not only the first's."""
    by_count = contexts[label]
    general = {re.sub(rf"\bep {n}\b", "ep N", line.replace(f" x {n} (", " x N (")) for n, line in by_count.items()}
    if len(by_count) == 1:
        return [f"- {line}" for line in by_count.values()]
    if len(general) == 1:
        return [f"- {general.pop()}; N: the row's process count ({', '.join(map(str, sorted(by_count)))})"]
    return [f"- {n} process{'es' if n > 1 else ''}, {line}" for n, line in sorted(by_count.items())]


counts = sorted({n for _, n in rows})
out = [f"## Training throughput, expert parallelism = GPUs, fixed tokens per GPU: {card} ({gpus} visible)", ""]
out += [line for i in impls if i in contexts for line in described(i)]
out += ["", "| impl | GPUs | tokens/s | ms/step | peak GiB | speedup vs 1 GPU | efficiency |",
        "| --- | --- | --- | --- | --- | --- | --- |"]
for impl in impls:
    base = rows.get((impl, 1))
    for n in counts:
        r = rows.get((impl, n))
        if r is None:
            continue
        if isinstance(r, str):
            out.append(f"| {impl} | {n} | {r} | | | | |")
            continue
        tok, ms, peak = r
        speed = f"{tok / base[0]:.2f} x" if isinstance(base, tuple) else "-"
        eff = f"{tok / base[0] / n:.0%}" if isinstance(base, tuple) else "-"
        out.append(f"| {impl} | {n} | {tok:,.0f} | {ms:.1f} | {peak} | {speed} | {eff} |")
# every project row against every DeepSpeed row of the same GPU count
pairs = [(a, b) for a in impls if not a.startswith("deepspeed") for b in impls if b.startswith("deepspeed")]
if pairs:
    out += ["", "| GPUs | mode impl | M tokens/s | DeepSpeed impl | M tokens/s | ratio |", "| --- | --- | --- | --- | --- | --- |"]
    for n in counts:
        for a, b in pairs:
            ra, rb = rows.get((a, n)), rows.get((b, n))
            fa = f"{ra[0] / 1e6:.3f}" if isinstance(ra, tuple) else "-"
            fb = f"{rb[0] / 1e6:.3f}" if isinstance(rb, tuple) else "-"
            ratio = f"{ra[0] / rb[0]:.2f} x" if isinstance(ra, tuple) and isinstance(rb, tuple) else "-"
            out.append(f"| {n} | {a} | {fa} | {b} | {fb} | {ratio} |")
out += ["", "Targets: speedup >= 1.8 x at 2 GPUs and >= 3.4 x at 4 GPUs; mode / deepspeed >= 1.5 x.",
        "Integrated MoDE rows do half DeepSpeed's expert FLOPs (no-op experts): mode-moe is the equal-FLOP row."]
text = "\n".join(out) + "\n"
(log_dir / "table.md").write_text(text)
print("\n" + text)
EOF
echo "total: $((SECONDS - start)) s; table in $LOG_DIR/table.md"
