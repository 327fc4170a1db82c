#!/bin/sh
# Accuracy of gossip training by wire encoding (issue #15): N peers (default
# 4) on Fashion-MNIST, each training EPOCHS (default 10) epochs of its 1/N
# shard with deploy/local-cluster.sh's defaults (batch 128/N, an exchange
# every step, at most MAX_LOCAL_STEPS (4) steps without one), once per
# encoding in WIRES (default "f32 i8"), ROUNDS times (default 1) alternating. Prints every run's mean, lowest and highest peer
# test accuracy, then each encoding's mean over the rounds and its gap to
# the first encoding in points. Target for i8: within 0.5 point of f32.
#
#   tests/bench/bench-wire.sh [BUILD_DIR] [-- extra rumor peer options]
#
#   env: N (4), EPOCHS (10), ROUNDS (1), WIRES ("f32 i8")
set -eu
src=$(cd "$(dirname "$0")/../.." && pwd)
build=$src/build
if [ $# -gt 0 ] && [ "$1" != "--" ]; then build=$1; shift; fi
[ "${1:-}" = "--" ] && shift
n=${N:-4}
rounds=${ROUNDS:-1}
wires=${WIRES:-f32 i8}
rumor=$build/peer/rumor
[ -x "$rumor" ] || { echo "build first: $rumor is missing" >&2; exit 1; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
num() { sed -n "s/.*\"$1\":\([0-9.e+-]*\).*/\1/p"; }

: > "$work/summary"
r=0
while [ "$r" -lt "$rounds" ]; do
  r=$((r + 1))
  for w in $wires; do
    t0=$(date +%s)
    status=0
    RUMOR=$rumor WORKDIR=$work/run EPOCHS=${EPOCHS:-10} "$src/deploy/local-cluster.sh" "$n" -- --log-every 0 \
      --wire "$w" "$@" > "$work/table" 2>&1 || status=$?
    [ "$status" -eq 0 ] || { cat "$work/table" >&2; echo "the $w cluster failed (round $r)" >&2; exit 1; }
    cat "$work"/run/peer-*.out | num test_accuracy |
      awk -v w="$w" -v r="$r" -v t="$(($(date +%s) - t0))" \
        'NR == 1 {lo = $1; hi = $1} {s += $1; if ($1 < lo) lo = $1; if ($1 > hi) hi = $1}
         END {printf "round %d, --wire %-4s: mean test accuracy %.4f (peers %.4f .. %.4f), %d s\n", r, w, s / NR, lo, hi, t}' |
      tee -a "$work/summary"
  done
done
echo "== over $rounds round(s), $n peers, ${EPOCHS:-10} epochs of 1/$n each"
awk -v wires="$wires" '{for (i = 1; i <= NF; i++) if ($i == "accuracy") {m[$4] += $(i + 1); c[$4]++}}
  END {k = split(wires, ws, " ");
       for (j = 1; j <= k; j++) {w = ws[j]; mean = m[w] / c[w]; if (j == 1) base = mean;
         if (j == 1) printf "--wire %-4s: mean test accuracy %.4f\n", w, mean;
         else printf "--wire %-4s: mean test accuracy %.4f, %+.2f points against %s (target >= -0.50)\n", w, mean,
                     100 * (mean - base), ws[1]}}' "$work/summary"
