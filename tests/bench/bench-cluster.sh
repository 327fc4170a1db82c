#!/bin/sh
# Gossip training quality and overhead (issue #4), on this machine:
#
#  1. quality: one peer trains 10 epochs of Fashion-MNIST (batch 128); then N
#     peers (default 8) each train 10 epochs of their 1/N shard with batch
#     128/N, so the cluster sees the same samples in the same number of steps.
#     Target: every peer within 1 point of the single peer's test accuracy.
#     The cluster runs twice: as is (training never waits for the network),
#     and with --max-local-steps BOUND (default 4): training holds after BOUND
#     steps without an applied exchange, which bounds drift at a price in
#     time (both wall times are printed).
#  2. overhead: the same N peers for TEPOCHS epochs (default 2; each run then
#     trains about 3 s here, and start-up skew is a good part of its wall
#     time: more epochs give steadier ratios) (batch TBATCH, default 128) with
#     --gossip-every 1 and with gossip off (--gossip-every 0), alternating,
#     ROUNDS times; the ratio of cluster throughput (all samples over the wall
#     time from the first step to the last peer's end). Target: >= 0.90.
#
#   tests/bench/bench-cluster.sh [BUILD_DIR]
#  3. with SPLIT=1 (and 2 cores or more), the overhead again with every
#     peer's training on cores 0..C-2 (--train-cpus) and its network threads
#     (the gossip loop and libuv's pool, which encrypts) on core C-1
#     (--net-cpus), gossip on and off alike: a stand-in for machines where
#     training has a device of its own and exchanges do not compete with it.
#
#   env: N (8), ROUNDS (2), TBATCH (128), BOUND (4; 0 skips the bounded run),
#   GOSSIP_ARGS (extra peer options for the gossip-on runs, e.g. "--wire f16"),
#   SKIP_QUALITY=1 (overhead only), SPLIT=1 (part 3 too), SPLIT=only (part 3
#   alone), TEPOCHS (2)
set -eu
src=$(cd "$(dirname "$0")/../.." && pwd)
build=${1:-$src/build}
n=${N:-8}
rounds=${ROUNDS:-2}
rumor=$build/peer/rumor
[ -x "$rumor" ] || { echo "build first: $rumor is missing" >&2; exit 1; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
num() { sed -n "s/.*\"$1\":\([0-9.e+-]*\).*/\1/p"; }

if [ -z "${SKIP_QUALITY:-}" ]; then
echo "== single peer, 10 epochs, batch 128"
single=$("$rumor" train --epochs 10 --batch 128 --log-every 0 2>/dev/null | num test_accuracy)
echo "single-peer test accuracy: $single"

batch=$((128 / n))
# quality LABEL [peer options]: runs the cluster, prints the worst gap.
quality() {
  label=$1
  shift
  echo "== $n peers, 10 epochs of 1/$n each, batch $batch$label"
  q0=$(date +%s.%N)
  RUMOR=$rumor WORKDIR=$work/q EPOCHS=10 MAX_LOCAL_STEPS=0 "$src/deploy/local-cluster.sh" "$n" -- --batch "$batch" --log-every 0 "$@" \
    | tail -n "$((n + 1))"
  q1=$(date +%s.%N)
  accs=$(cat "$work"/q/peer-*.out | num test_accuracy)
  echo "$accs" | awk -v s="$single" -v l="$label" -v t="$(echo "$q0 $q1" | awk '{printf "%.0f", $2 - $1}')" \
    'NR == 1 {lo = $1; hi = $1} {if ($1 < lo) lo = $1; if ($1 > hi) hi = $1}
    END {printf "peers%s: %.4f .. %.4f; worst gap to the single peer %.2f points (target <= 1.00); %s s\n", l, lo, hi, (s - lo) * 100, t}'
  for f in "$work"/q/peer-*.out; do echo "$(num exchanges < "$f") $(num steps < "$f") $(num longest_local_steps < "$f")"; done |
    awk -v l="$label" '{x += $1; s += $2; if ($3 > m) m = $3}
      END {printf "peers%s: %.1f exchanges applied per 100 steps; at most %d steps between applied exchanges\n", l, 100 * x / s, m}'
}
quality ""
bound=${BOUND:-4}
if [ "$bound" -gt 0 ]; then quality ", --max-local-steps $bound" --max-local-steps "$bound"; fi
fi
batch=$((128 / n))

tbatch=${TBATCH:-128}
GOSSIP_ARGS=${GOSSIP_ARGS:-}
tepochs=${TEPOCHS:-2}
echo "== overhead: $n peers, $tepochs epochs, batch $tbatch, gossip every step vs off ($rounds rounds)"
# Cluster throughput: all samples trained, over the wall time from the first
# peer's first step to the last peer's end of training (log stamps HH:MM:SS.mmm).
total() {
  samples=$(cat "$work"/t/peer-*.out | num steps | awk -v b="$tbatch" '{s += $1 * b} END {print s}')
  t0=$(grep -h "first step:" "$work"/t/peer-*.log | cut -c1-12 | sort | head -n 1)
  t1=$(grep -h "training done" "$work"/t/peer-*.log | cut -c1-12 | sort | tail -n 1)
  echo "$samples $t0 $t1" | awk '{split($2, a, ":"); split($3, b, ":");
    s = (b[1] - a[1]) * 3600 + (b[2] - a[2]) * 60 + (b[3] - a[3]); printf "%.0f", $1 / s}'
}
# overhead LABEL [peer options for both runs]: alternating runs, prints the
# median ratio.
overhead() {
  label=$1
  shift
  ratios=""
  i=0
  while [ "$i" -lt "$rounds" ]; do
    RUMOR=$rumor WORKDIR=$work/t EPOCHS=$tepochs MAX_LOCAL_STEPS=0 "$src/deploy/local-cluster.sh" "$n" -- --batch "$tbatch" --log-every 0 \
      --no-eval --gossip-every 0 "$@" > /dev/null
    off=$(total)
    RUMOR=$rumor WORKDIR=$work/t EPOCHS=$tepochs MAX_LOCAL_STEPS=0 "$src/deploy/local-cluster.sh" "$n" -- --batch "$tbatch" --log-every 0 \
      --no-eval --gossip-every 1 $GOSSIP_ARGS "$@" > /dev/null
    on=$(total)
    r=$(echo "$on $off" | awk '{printf "%.3f", $1 / $2}')
    echo "round $i$label: gossip off $off samples/s, gossip every step $on samples/s, ratio $r"
    ratios="$ratios $r"
    i=$((i + 1))
  done
  echo "$ratios" | tr ' ' '\n' | grep . | sort -g | awk -v l="$label" '{a[NR] = $1}
    END {printf "median ratio%s %.3f (target >= 0.90)\n", l, (NR % 2) ? a[(NR + 1) / 2] : (a[NR / 2] + a[NR / 2 + 1]) / 2}'
}
[ "${SPLIT:-}" = only ] || overhead ""

cores=$(nproc)
if [ -n "${SPLIT:-}" ] && [ "$cores" -ge 2 ]; then
  last=$((cores - 1))
  echo "== overhead, training on cores 0-$((last - 1)), network threads on core $last"
  overhead " (split cores)" --train-cpus "0-$((last - 1))" --net-cpus "$last"
fi
echo "machine: $(nproc) cores; $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ *//')"
