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
# Targets (issue #32): the top-1 model beats the dense one of equal active
# parameters at equal tokens by at least 0.03 validation loss, at no less
# than 0.7× its tokens/s.
#
#   tests/bench/bench-moe.sh [BUILD_DIR]
#
# Environment: SPEC (default gpt:L4-H4-C128-T128-V256), STEPS (default
# 600), BATCH (default 16), E (default 8), DATA (a text file; default the
# KJV corpus of deploy/install-deps.sh), THREADS (default all cores).
set -eu
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
build=${1:-$root/build}
rumor=$build/peer/rumor
SPEC=${SPEC:-gpt:L4-H4-C128-T128-V256}
STEPS=${STEPS:-600}
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
  "$rumor" train --model "$2" --data "$DATA" --batch "$BATCH" --max-steps "$STEPS" --optimizer adamw --lr 1e-3 \
    --warmup 50 --threads "$THREADS" --eval-batches 20 --log-every 1 --seed 1 >"$tmp/$1.out" 2>"$tmp/$1.log" ||
    { echo "bench-moe.sh: $1 ($2) failed:" >&2; tail -5 "$tmp/$1.log" >&2; exit 1; }
  tail -n 1 "$tmp/$1.out"
}

echo "bench-moe.sh: $SPEC, $STEPS steps of $BATCH windows, AdamW 1e-3, $THREADS threads, $(date -u +%Y-%m-%d)"
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
ok=$(echo "$gain >= 0.03 && $ratio >= 0.7" | bc -l)
[ "$ok" = 1 ] && echo "targets: met" || echo "targets: MISSED"
