#!/bin/sh
# Benchmark of model-parallel mode (issue #7): one `rumor group` of S CPU
# stage processes on this host, for several micro-batch counts M and both
# schedules, reporting
#   (a) the measured pipeline bubble: each stage's idle fraction of a step
#       (time blocked waiting for a neighbour's activations or gradients,
#       over the step's wall time, first step excluded), next to the
#       theoretical (S-1)/(M+S-1) of equal stages with free communication;
#   (b) the activation memory each stage held at its peak (micro-batch
#       slots allocated x bytes per slot) under 1F1B and GPipe, and the ratio.
#
# usage: tests/bench/bench-pipeline.sh [BUILD_DIR]
#   env: STAGES (default "2 4"), MICRO (default "1 2 4 8 16"), STEPS (default 12),
#        REPS (runs per configuration, default 3: the table shows the run with
#        the median mean idle fraction, the figures of one run together),
#        MODEL (default mlp:784-512-512-512-512-10: the first layer's training
#        work, 2 x 784 x 512 multiply-adds a sample (no input gradient), is
#        within 2 % of each hidden layer's 3 x 512 x 512, and the last is tiny,
#        so 2 and 4 stages take equal time), BATCH (default 1024: micro-batches
#        large enough that compute, not message latency, dominates),
#        THREADS (CPU threads per stage, default 1).
# Needs Fashion-MNIST (Debian's dataset-fashion-mnist). Builds `rumor` in
# BUILD_DIR (default build-bench/, Release, CPU only).
#
# This runs on CPU processes only: no GPU was available to this work, so
# the figures say nothing about stages on separate GPUs. On a machine with
# fewer cores than S x THREADS the stages share cores, which inflates both
# compute and idle times; the script prints the core count it ran on.
set -eu

src=$(cd "$(dirname "$0")/../.." && pwd)
build=${1:-$src/build-bench}
STAGES=${STAGES:-"2 4"}
MICRO=${MICRO:-"1 2 4 8 16"}
STEPS=${STEPS:-12}
MODEL=${MODEL:-mlp:784-512-512-512-512-10}
BATCH=${BATCH:-1024}
REPS=${REPS:-3}
THREADS=${THREADS:-1}

if [ ! -f "$build/CMakeCache.txt" ]; then
  cmake -S "$src" -B "$build" -DCMAKE_BUILD_TYPE=Release -DRUMOR_CUDA=OFF >/dev/null
fi
cmake --build "$build" --target rumor -j "$(nproc)" >/dev/null
rumor=$build/peer/rumor
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$rumor" keygen --cluster -o "$tmp/cluster.key" >/dev/null 2>&1
"$rumor" keygen -o "$tmp/id.key" >/dev/null 2>&1

# field LINE KEY: a number from one JSON line.
field() { printf '%s\n' "$1" | sed -n "s/.*\"$2\":\([-0-9.e]*\).*/\1/p"; }

# run_once S M SCHEDULE OUT: one group; its stage result lines go to OUT.
run_once() {
  "$rumor" group --stages "$1" --micro-batches "$2" --pipeline "$3" --model "$MODEL" --batch "$BATCH" \
    --max-steps "$STEPS" --no-eval --threads "$THREADS" --gossip-every 0 --log-every 0 --linger-ms 0 \
    --cluster-key "$tmp/cluster.key" --identity "$tmp/id.key" >"$4" 2>"$tmp/err" || {
    echo "bench-pipeline.sh: the group failed:" >&2
    cat "$tmp/err" >&2
    exit 1
  }
}

# mean_idle FILE: the mean idle fraction over the stages of one run.
mean_idle() { sed -n 's/.*"idle_fraction":\([-0-9.e]*\).*/\1/p' "$1" | awk '{ s += $1; n++ } END { printf "%.6f", s / n }'; }

# run S M SCHEDULE: REPS runs; the one with the median mean idle fraction
# is left in $tmp/out.
run() {
  r=0
  : >"$tmp/runs"
  while [ $r -lt "$REPS" ]; do
    run_once "$1" "$2" "$3" "$tmp/out$r"
    echo "$(mean_idle "$tmp/out$r") $r" >>"$tmp/runs"
    r=$((r + 1))
  done
  pick=$(sort -n "$tmp/runs" | sed -n "$(((REPS + 1) / 2))p" | cut -d' ' -f2)
  cp "$tmp/out$pick" "$tmp/out"
}

# stage S LINE-KEY: the value of KEY on stage S's result line.
stage_field() { field "$(grep "\"stage\":$1,\"stages\"" "$tmp/out" | grep '"idle_fraction"')" "$2"; }

echo "rumor model-parallel benchmark: $MODEL, batch $BATCH, $STEPS steps (first not timed), $THREADS thread(s) per stage"
echo "machine: $(nproc) cores ($(sed -n 's/^model name[[:space:]]*: //p' /proc/cpuinfo | head -n 1)), load average $(cut -d' ' -f1-3 /proc/loadavg) at the start; no GPU (CPU stage processes only); median of $REPS runs"
for S in $STAGES; do
  echo
  echo "== S = $S stages: bubble (idle fraction of a step), measured per stage vs theory (S-1)/(M+S-1)"
  printf '%-4s %-6s %-8s' "M" "sched" "theory"
  s=0
  while [ $s -lt "$S" ]; do printf ' %-8s' "stage$s"; s=$((s + 1)); done
  printf ' %-8s %s\n' "mean" "step ms"
  for M in $MICRO; do
    for sched in gpipe 1f1b; do
      run "$S" "$M" "$sched"
      theory=$(awk -v s="$S" -v m="$M" 'BEGIN { printf "%.3f", (s - 1) / (m + s - 1) }')
      printf '%-4s %-6s %-8s' "$M" "$sched" "$theory"
      sum=0
      s=0
      while [ $s -lt "$S" ]; do
        v=$(stage_field $s idle_fraction)
        printf ' %-8.3f' "$v"
        sum=$(awk -v a="$sum" -v b="$v" 'BEGIN { print a + b }')
        eval "mem_${sched}_${M}_$s=$(stage_field $s act_peak_bytes)"
        eval "slots_${sched}_${M}_$s=$(stage_field $s act_slots)"
        s=$((s + 1))
      done
      awk -v a="$sum" -v s="$S" -v ms="$(stage_field 0 step_ms)" 'BEGIN { printf " %-8.3f %.1f\n", a / s, ms }'
    done
  done
  echo
  echo "== S = $S stages: peak activation memory per stage, 1F1B vs GPipe (KiB; micro-batch slots in brackets)"
  printf '%-4s %-6s %-18s %-18s %-8s %-8s\n' "M" "stage" "gpipe" "1f1b" "ratio" "bound"
  for M in $MICRO; do
    s=0
    while [ $s -lt "$S" ]; do
      eval "g=\$mem_gpipe_${M}_$s; o=\$mem_1f1b_${M}_$s; gs=\$slots_gpipe_${M}_$s; os=\$slots_1f1b_${M}_$s"
      bound=$(awk -v s="$S" -v i="$s" -v m="$M" 'BEGIN { k = s - i; if (k > m) k = m; printf "%.3f", k / m }')
      awk -v m="$M" -v st="$s" -v g="$g" -v o="$o" -v gs="$gs" -v os="$os" -v b="$bound" \
        'BEGIN { printf "%-4s %-6s %-18s %-18s %-8.3f %-8s\n", m, st, sprintf("%.0f [%d]", g / 1024, gs),
                 sprintf("%.0f [%d]", o / 1024, os), o / g, b }'
      s=$((s + 1))
    done
  done
done
echo
echo "bound: min(S-s, M)/M, the 1F1B/GPipe ratio of micro-batches held at once by stage s"
