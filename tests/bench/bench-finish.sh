#!/bin/sh
# --finish-wait-ms with a straggler: N gossiping peers on the README's job
# (10 epochs each on 1/N of Fashion-MNIST, batch 32, --max-local-steps 4),
# the last one SLOWDOWN times slower (--slowdown), without and with
# --finish-wait-ms 60000, alternating, ROUNDS times. Without it the fast
# peers leave when they finish and the straggler trains its last steps
# alone; with it they keep averaging until it has finished. Prints each
# run's test accuracies and wall time, then the worst and mean accuracy and
# the spread (highest − lowest) of both, side by side.
#
#   tests/bench/bench-finish.sh [BUILD_DIR] [-- extra rumor peer options]
#
#   env: ROUNDS (2), N (4), SLOWDOWN (2), DATA (Fashion-MNIST directory)
set -eu
src=$(cd "$(dirname "$0")/../.." && pwd)
build=$src/build
if [ $# -gt 0 ] && [ "$1" != "--" ]; then build=$1; shift; fi
[ "${1:-}" = "--" ] && shift
rounds=${ROUNDS:-2}
n=${N:-4}
slowdown=${SLOWDOWN:-2}
data=${DATA:-/usr/share/datasets/fashion-mnist}
rumor=$build/peer/rumor
[ -x "$rumor" ] || { echo "build first: $rumor is missing" >&2; exit 1; }
case $n in ''|*[!0-9]*|0|1) echo "N must be a number of peers, at least 2 (not '$n')" >&2; exit 2;; esac
case $rounds in ''|*[!0-9]*|0) echo "ROUNDS must be a positive number (not '$rounds')" >&2; exit 2;; esac
work=$(mktemp -d)
pids=""
trap 'for p in $pids; do kill "$p" 2>/dev/null || true; done; rm -rf "$work"' EXIT
num() { sed -n "s/.*\"$1\":\([0-9.e+-]*\).*/\1/p"; }
now() { date +%s.%N; }
"$rumor" keygen --cluster -o "$work/cluster.key" >/dev/null 2>&1
for i in $(seq 0 "$n"); do "$rumor" keygen -o "$work/id$i.key" >/dev/null 2>&1; done

# run WAIT_MS [peer options]: one cluster; appends "WAIT_MS acc1 ... accN
# seconds" to rows.
run() {
  wait_ms=$1
  shift
  "$rumor" bootstrap --listen 127.0.0.1:0 --cluster-key "$work/cluster.key" --identity "$work/id0.key" \
    > "$work/boot.out" 2> "$work/boot.log" &
  boot_pid=$!
  pids="$boot_pid"
  for k in $(seq 100); do grep -q '"listen"' "$work/boot.out" 2>/dev/null && break; sleep 0.1; done
  boot=$(sed -n 's/.*"listen":"\([^"]*\)".*/\1/p' "$work/boot.out")
  [ -n "$boot" ] || { echo "the bootstrap node did not start: $(cat "$work/boot.log")" >&2; exit 1; }
  t0=$(now)
  peers=""
  for i in $(seq 1 "$n"); do
    slow=1
    [ "$i" = "$n" ] && slow=$slowdown
    "$rumor" peer --bootstrap "$boot" --cluster-key "$work/cluster.key" --identity "$work/id$i.key" \
      --listen 127.0.0.1:0 --data "$data" --shard "$((i - 1))/$n" --epochs 10 --batch 32 --threads 1 \
      --max-local-steps 4 --wait-peers "$n" --slowdown "$slow" --finish-wait-ms "$wait_ms" --name "peer-$i" "$@" \
      > "$work/peer-$i.out" 2> "$work/peer-$i.log" &
    peers="$peers $!"
    pids="$pids $!"
  done
  i=0
  for p in $peers; do
    i=$((i + 1))
    wait "$p" || { echo "peer-$i failed: $(tail -5 "$work/peer-$i.log")" >&2; exit 1; }
  done
  secs=$(echo "$(now) $t0" | awk '{printf "%.1f", $1 - $2}')
  kill "$boot_pid" 2>/dev/null || true
  wait "$boot_pid" 2>/dev/null || true
  row=$wait_ms
  for i in $(seq 1 "$n"); do row="$row $(grep '"test_accuracy"' "$work/peer-$i.out" | num test_accuracy)"; done
  echo "$row $secs" >> "$work/rows"
  echo "  --finish-wait-ms $wait_ms: accuracies $(echo "$row" | cut -d' ' -f2-), $secs s" >&2
}

echo "bench-finish.sh: $n peers, peer-$n ${slowdown}x slower, $rounds rounds, $(nproc) CPUs" >&2
: > "$work/rows"
for r in $(seq 1 "$rounds"); do
  echo "round $r" >&2
  run 0 "$@"
  run 60000 "$@"
done

# Per setting: the worst and mean accuracy over every peer of every round,
# the mean spread within a run, and the mean wall time.
summary() {
  awk -v w="$1" -v n="$n" 'BEGIN { worst = 2 }
    $1 == w {
      lo = 2; hi = -1
      for (i = 2; i <= n + 1; i++) { s += $i; c++; if ($i < lo) lo = $i; if ($i > hi) hi = $i }
      if (lo < worst) worst = lo
      spread += hi - lo; runs++; secs += $(n + 2)
    }
    END { printf "%.4f %.4f %.4f %.1f", worst, s / c, spread / runs, secs / runs }' "$work/rows"
}
set -- $(summary 0)
w0=$1 m0=$2 s0=$3 t0=$4
set -- $(summary 60000)
w1=$1 m1=$2 s1=$3 t1=$4
printf '\n| %d peers, peer-%d %sx slower (%d rounds) | worst peer | mean | spread within a run | wall s |\n' "$n" "$n" "$slowdown" "$rounds"
printf '|---|---:|---:|---:|---:|\n'
printf '| as is (fast peers leave at their last step) | %s | %s | %s | %s |\n' "$w0" "$m0" "$s0" "$t0"
printf '| --finish-wait-ms 60000 | %s | %s | %s | %s |\n' "$w1" "$m1" "$s1" "$t1"
echo "$w0 $w1 $m0 $m1" | awk '{printf "with / without: worst peer %+.2f points, mean %+.2f points\n", 100 * ($2 - $1), 100 * ($4 - $3)}'
