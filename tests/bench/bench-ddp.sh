#!/bin/sh
# The README's main job against PyTorch DDP (issue #15, item 4): rumor's 4
# gossiping peers (deploy/local-cluster.sh 4: 10 epochs each on 1/4 of
# Fashion-MNIST, batch 32, --max-local-steps MAX_LOCAL_STEPS, default 4)
# and DDP on the same job (tests/bench/ddp_fmnist.py: 4 processes, gloo
# all-reduce of the gradients every step, the same model, initialisation,
# SGD, schedule, batch and shards' size), alternating, ROUNDS times.
# Prints each run's test accuracies and wall time (start to finish, process
# start-up included), then rumor's mean accuracy against DDP's and DDP's
# time over rumor's. Targets: rumor's mean within 0.3 point of DDP's,
# while finishing at least 3 times sooner.
#
#   tests/bench/bench-ddp.sh [BUILD_DIR] [-- extra rumor peer options]
#
#   env: ROUNDS (2), N (4 peers / DDP processes), DATA (Fashion-MNIST directory),
#   MAX_LOCAL_STEPS (local-cluster.sh's bound, default 4; 0: none)
# DDP runs on Debian's PyTorch (python3-torch of deploy/install-deps.sh).
set -eu
src=$(cd "$(dirname "$0")/../.." && pwd)
build=$src/build
if [ $# -gt 0 ] && [ "$1" != "--" ]; then build=$1; shift; fi
[ "${1:-}" = "--" ] && shift
rounds=${ROUNDS:-2}
n=${N:-4}
data=${DATA:-/usr/share/datasets/fashion-mnist}
py=/usr/bin/python3
rumor=$build/peer/rumor
[ -x "$rumor" ] || { echo "build first: $rumor is missing" >&2; exit 1; }
"$py" -c 'import torch.distributed' 2>/dev/null || { echo "$py has no PyTorch: run deploy/install-deps.sh" >&2; exit 1; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
num() { sed -n "s/.*\"$1\":\([0-9.e+-]*\).*/\1/p"; }
now() { date +%s.%N; }
# stats: the mean, lowest and highest of the numbers on stdin
stats() { awk 'NR == 1 {lo = $1; hi = $1} {s += $1; if ($1 < lo) lo = $1; if ($1 > hi) hi = $1}
  END {printf "%.4f %.4f %.4f", s / NR, lo, hi}'; }

echo "bench-ddp.sh: $n peers vs $n DDP processes, $rounds rounds, $(nproc) CPUs" >&2
: > "$work/rows"
r=0
while [ "$r" -lt "$rounds" ]; do
  r=$((r + 1))
  t0=$(now)
  RUMOR=$rumor WORKDIR=$work/run "$src/deploy/local-cluster.sh" "$n" -- --data "$data" --log-every 0 "$@" \
    > "$work/table" 2>&1 || { cat "$work/table" >&2; echo "round $r: the rumor cluster failed" >&2; exit 1; }
  t1=$(now)
  acc=$(cat "$work"/run/peer-*.out | num test_accuracy | stats)
  rate=$(for f in "$work"/run/peer-*.out; do echo "$(num exchanges < "$f") $(num steps < "$f")"; done |
    awk '{x += $1; s += $2} END {printf "%.1f", 100 * x / s}')
  "$py" "$src/tests/bench/ddp_fmnist.py" --data "$data" --world "$n" --batch "$((128 / n > 16 ? 128 / n : 16))" \
    > "$work/ddp" 2> "$work/ddp.err" || { cat "$work/ddp.err" >&2; echo "round $r: DDP failed" >&2; exit 1; }
  t2=$(now)
  dacc=$(num test_accuracy < "$work/ddp" | stats)
  echo "$acc $rate $t0 $t1 $dacc $t2" | awk -v r="$r" '{
    printf "round %d: rumor %.4f (peers %.4f .. %.4f), %.1f applied exchanges per 100 steps, %.1f s; DDP %.4f, %.1f s\n",
      r, $1, $2, $3, $4, $6 - $5, $7, $10 - $6 }' >&2
  echo "$acc $rate $t0 $t1 $dacc $t2" | awk '{print $1, $2, $6 - $5, $7, $10 - $6}' >> "$work/rows"
done
label="rumor, $n peers"
case " $* " in
*" --sync allreduce "* | *" --sync ps "* | *" --sync=allreduce "* | *" --sync=ps "* | *" --max-local-steps "*) ;;
*" --outer sgd "* | *" --outer nesterov "* | *" --outer=sgd "* | *" --outer=nesterov "*) ;; # local-cluster.sh: no bound
*) [ "${MAX_LOCAL_STEPS:-4}" != 0 ] && label="$label, max-local-steps ${MAX_LOCAL_STEPS:-4}" ;;
esac
[ $# -gt 0 ] && label="$label $*"
awk -v label="$label" '{ra += $1; lo = (NR == 1 || $2 < lo) ? $2 : lo; rt += $3; da += $4; dt += $5; n++}
  END {
    ra /= n; rt /= n; da /= n; dt /= n
    printf "\n%-40s %10s %10s\n", "means over " n " rounds", "accuracy", "seconds"
    printf "%-40s %10.4f %10.1f\n", "PyTorch DDP (gloo all-reduce every step)", da, dt
    printf "%-40s %10.4f %10.1f\n", label, ra, rt
    printf "\naccuracy gap DDP - rumor: %.2f points (target <= 0.30: %s); worst peer %.4f\n", 100 * (da - ra),
      (da - ra <= 0.003 ? "met" : "MISSED"), lo
    printf "time DDP / rumor: %.2f (target >= 3: %s)\n", dt / rt, (dt / rt >= 3 ? "met" : "MISSED")
  }' "$work/rows"
