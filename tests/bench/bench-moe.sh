#!/bin/sh
# Mixture of experts against dense (issue #32): a dense GPT and the same GPT
# whose blocks' MLPs are E = 8 experts with top-1 and top-2 routing (top-1:
# the dense model's active parameters per token, one MLP a token, plus the
# router; top-2: twice its MLP's). Each trains the same steps of the same
# batches on one process; the script prints, side by side, the validation
# loss after STEPS steps (equal tokens), tokens/s and its ratio to the dense
# model's, the fraction of token-expert choices dropped for capacity and
# the expert-load histogram of the last step; then the dense model trained
# for the top-1 model's wall time (STEPS × the tokens/s ratio, rounded) and
# its validation loss (equal wall time).
# Then expert parallelism: the top-1 model for EP_STEPS steps as one
# process, as `rumor group --data-parallel 2` and as `rumor group
# --expert-parallel 2` (each process on half the threads), with tokens/s,
# the bytes each process moved per step in all (comm_bytes_per_step) and in
# the experts' all-to-alls (expert_bytes_per_step), beside the all-to-all's
# formula: per MoE block and step, four all-to-alls (the rows to their
# experts and back, forward and backward), in each of which about half of
# the batch's kept choices cross between the two processes (each sends a
# half of its own half and receives as much), C floats each: per process
# 4 x (kept / 2) x 4C bytes sent and received, 8 x L x C x kept in all.
# The expert-parallel group runs at ZeRO 0 (every process holds every
# expert), 1 and 3 (each holds whole only the experts it runs, their
# weights and gradients moving only to and from it), with each process's
# peak resident memory (the largest over the processes).
# Targets (issue #32): the top-1 model beats the dense one of equal active
# parameters at equal tokens by at least 0.03 validation loss, at no less
# than 0.7× its tokens/s.
#
#   tests/bench/bench-moe.sh [BUILD_DIR]
#
# Environment: SPEC (default gpt:L4-H4-C64-T128-V256), STEPS (default
# 2000), BATCH (default 16), LR (AdamW's, every row; default 3e-3), E
# (default 8), DATA (a text file; default the
# KJV corpus of deploy/install-deps.sh), THREADS (default all cores),
# EP_STEPS (default 200), EP_ONLY=1 (the expert-parallel rows alone).
# The rows' result lines are read back by name (eval line=\$name):
# shellcheck disable=SC2034,SC2154
set -eu
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
build=${1:-$root/build}
rumor=$build/peer/rumor
SPEC=${SPEC:-gpt:L4-H4-C64-T128-V256}
STEPS=${STEPS:-2000}
LR=${LR:-3e-3}
BATCH=${BATCH:-16}
E=${E:-8}
DATA=${DATA:-/usr/local/share/rumor/kjv.txt}
THREADS=${THREADS:-$(nproc)}
[ -x "$rumor" ] || { echo "bench-moe.sh: build rumor first (no $rumor)" >&2; exit 1; }
[ -f "$DATA" ] || { echo "bench-moe.sh: no corpus at $DATA (set DATA)" >&2; exit 1; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

field() { printf '%s\n' "$1" | sed -n "s/.*\"$2\":\([-+0-9.e]*\).*/\1/p"; }
array() { printf '%s\n' "$1" | sed -n "s/.*\"$2\":\[\([^]]*\)\].*/\1/p"; }

# run NAME SPEC: trains STEPS steps, keeps the result line and the log.
run() {
  "$rumor" train --model "$2" --data "$DATA" --batch "$BATCH" --max-steps "$STEPS" --optimizer adamw --lr "$LR" \
    --warmup 50 --threads "$THREADS" --eval-batches 20 --log-every 1 --seed 1 >"$tmp/$1.out" 2>"$tmp/$1.log" ||
    { echo "bench-moe.sh: $1 ($2) failed:" >&2; tail -5 "$tmp/$1.log" >&2; exit 1; }
  tail -n 1 "$tmp/$1.out"
}

# group_run NAME OPTIONS...: the group's result line (expert_parallel's
# $common and $half).
group_run() {
  name=$1
  shift
  # shellcheck disable=SC2086
  "$rumor" group --cluster-key "$tmp/ck" --identity "$tmp/id" "$@" --threads "$half" $common \
    >"$tmp/$name.out" 2>"$tmp/$name.log" ||
    { echo "bench-moe.sh: $name failed:" >&2; tail -5 "$tmp/$name.log" >&2; exit 1; }
  tail -n 1 "$tmp/$name.out"
}

# expert_parallel: the top-1 model on one process and on two (data- and
# expert-parallel), EP_STEPS steps each.
expert_parallel() {
  steps=${EP_STEPS:-200}
  half=$((THREADS / 2 > 0 ? THREADS / 2 : 1))
  "$rumor" keygen -o "$tmp/id" >/dev/null 2>&1
  "$rumor" keygen --cluster -o "$tmp/ck" >/dev/null 2>&1
  common="--model $SPEC-E$E-K1 --data $DATA --batch $BATCH --max-steps $steps --optimizer adamw --lr $LR --warmup 50
    --eval-batches 20 --log-every 0 --seed 1"
  one=$(STEPS=$steps run ep1 "$SPEC-E$E-K1")
  dp2=$(group_run dp2 --data-parallel 2)
  ep2=$(group_run ep2 --expert-parallel 2 --zero 0)
  ep2z1=$(group_run ep2z1 --expert-parallel 2 --zero 1)
  ep2z3=$(group_run ep2z3 --expert-parallel 2 --zero 3)
  ctx=$(printf '%s' "$SPEC" | sed -n 's/.*-T\([0-9]*\).*/\1/p')
  width=$(printf '%s' "$SPEC" | sed -n 's/.*-C\([0-9]*\).*/\1/p')
  layers=$(printf '%s' "$SPEC" | sed -n 's/.*L\([0-9]*\).*/\1/p')
  r1=$(field "$one" samples_per_s)
  echo "expert parallelism: $SPEC-E$E-K1, $steps steps of $BATCH windows, $THREADS threads in all"
  printf '%-34s %10s %10s %8s %16s %16s %16s %10s\n' layout val_loss tokens/s ratio bytes/step a2a_bytes/step \
    a2a_formula peak_MB
  for name in one dp2 ep2 ep2z1 ep2z3; do
    eval line=\$$name
    r=$(field "$line" samples_per_s)
    cb=$(field "$line" comm_bytes_per_step)
    eb=$(field "$line" expert_bytes_per_step)
    formula=-
    if [ "$name" != one ] && [ "$name" != dp2 ]; then
      kept=$(echo "$BATCH * $ctx * (1 - $(field "$line" moe_dropped_fraction))" | bc -l)
      formula=$(printf '%.0f' "$(echo "8 * $layers * $width * $kept" | bc -l)")
    fi
    case $name in
      one) label="P=1 (one process)" ;;
      dp2) label="D=2 (data-parallel)" ;;
      ep2) label="P=2 --zero 0" ;;
      ep2z1) label="P=2 --zero 1" ;;
      *) label="P=2 --zero 3" ;;
    esac
    printf '%-34s %10.4f %10.0f %8.2f %16s %16s %16s %10.1f\n' "$label" "$(field "$line" val_loss)" \
      "$(echo "$r * $ctx" | bc -l)" "$(echo "$r / $r1" | bc -l)" "${cb:-0}" "${eb:-0}" "$formula" \
      "$(echo "$(field "$line" peak_rss_bytes) / 1000000" | bc -l)"
  done
}

echo "bench-moe.sh: $SPEC, $STEPS steps of $BATCH windows, AdamW $LR, $THREADS threads, $(date -u +%Y-%m-%d)"
if [ "${EP_ONLY:-0}" = 1 ]; then
  expert_parallel
  exit 0
fi
dense=$(run dense "$SPEC")
top1=$(run top1 "$SPEC-E$E-K1")
top2=$(run top2 "$SPEC-E$E-K2")
dl=$(field "$dense" val_loss)
dr=$(field "$dense" samples_per_s)
printf '%-28s %10s %10s %8s %9s  %s\n' model val_loss tokens/s ratio dropped "expert load (last step)"
for name in dense top1 top2; do
  eval line=\$$name
  vl=$(field "$line" val_loss)
  r=$(field "$line" samples_per_s)
  ctx=$(printf '%s' "$SPEC" | sed -n 's/.*-T\([0-9]*\).*/\1/p')
  dropped=$(field "$line" moe_dropped_fraction)
  printf '%-28s %10.4f %10.0f %8.2f %9s  %s\n' "$name" "$vl" "$(echo "$r * $ctx" | bc -l)" \
    "$(echo "$r / $dr" | bc -l)" "${dropped:--}" "$(array "$line" expert_load)"
done
t1=$(field "$top1" val_loss)
r1=$(field "$top1" samples_per_s)
gain=$(echo "$dl - $t1" | bc -l)
ratio=$(echo "$r1 / $dr" | bc -l)
wall=$(printf '%.0f' "$(echo "$STEPS * $(field "$top1" samples_per_s) / $dr" | bc -l)")
STEPS=$wall
dwall=$(run dense-wall "$SPEC")
echo "dense for top-1's wall time ($wall steps): val_loss $(field "$dwall" val_loss) (top-1: $(field "$top1" val_loss))"
echo "top-1 against dense at equal tokens: $(printf '%.4f' "$gain") lower validation loss (target >= 0.03)," \
  "$(printf '%.2f' "$ratio")x its tokens/s (target >= 0.7)"
expert_parallel
ok=$(echo "$gain >= 0.03 && $ratio >= 0.7" | bc -l)
[ "$ok" = 1 ] && echo "targets: met" || echo "targets: MISSED"
