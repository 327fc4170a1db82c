#!/bin/sh
# Benchmark (issue #15, item 5): how fast a newcomer pulls the training state
# of a large model on loopback. Each round starts a bootstrap node and a peer
# on MODEL (default mlp:784-7000-7000-10 with momentum: 54.5 M parameters, a
# 436 MB state of parameters and momentum); once it trains, a second peer
# joins and pulls that state from it over the encrypted transport (f32, with
# the transfer digest), takes one step and leaves. The newcomer's log gives
# the pull's figure, from the donor's BEGIN to the checked END:
#   received the state of ... : 436.0 MB in 0.300 s, 1.45 GB/s
# In the same run, raw TCP moves the same bytes one way with no encryption
# (bench_net_tcp --one-way) as the reference. Target: >= 1 GB/s.
#
#   tests/bench/bench-join.sh [BUILD_DIR] [-- extra rumor peer options]
#
#   env: ROUNDS (3), MODEL (mlp:784-7000-7000-10)
set -eu
src=$(cd "$(dirname "$0")/../.." && pwd)
build=$src/build
if [ $# -gt 0 ] && [ "$1" != "--" ]; then build=$1; shift; fi
[ "${1:-}" = "--" ] && shift
rounds=${ROUNDS:-3}
model=${MODEL:-mlp:784-7000-7000-10}
rumor=$build/peer/rumor
tcp=$build/tests/bench/bench_net_tcp
for b in "$rumor" "$tcp"; do [ -x "$b" ] || { echo "build first: $b is missing" >&2; exit 1; }; done
work=$(mktemp -d)
pids=""
cleanup() {
  for p in $pids; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT INT TERM
# wait_for FILE TEXT SECONDS: polls until FILE contains TEXT
wait_for() {
  i=0
  while ! grep -q "$2" "$1" 2>/dev/null; do
    i=$((i + 1))
    [ "$i" -le $(($3 * 10)) ] || return 1
    sleep 0.1
  done
}

"$rumor" keygen --cluster -o "$work/cluster.key" >/dev/null 2>&1
for i in 0 1 2; do "$rumor" keygen -o "$work/id$i.key" >/dev/null 2>&1; done
common="--cluster-key $work/cluster.key --listen 127.0.0.1:0"
echo "bench-join.sh: $rounds rounds, --model $model, $(nproc) CPUs ($(grep -o -m1 -w 'avx512f\|vaes' /proc/cpuinfo |
  sort -u | tr '\n' ' ')in /proc/cpuinfo)" >&2
: > "$work/pulls"
r=0
while [ "$r" -lt "$rounds" ]; do
  r=$((r + 1))
  # shellcheck disable=SC2086
  "$rumor" bootstrap $common --identity "$work/id0.key" > "$work/boot.out" 2> "$work/boot.log" &
  boot_pid=$!
  pids="$boot_pid"
  wait_for "$work/boot.out" '"listen"' 10 || { cat "$work/boot.log" >&2; exit 1; }
  boot=$(sed -n 's/.*"listen":"\([^"]*\)".*/\1/p' "$work/boot.out")
  peer_opts="--bootstrap $boot --model $model --batch 16 --threads 1 --gossip-every 0 --log-every 0 --eval-batches 1"
  # shellcheck disable=SC2086
  "$rumor" peer $common $peer_opts --identity "$work/id1.key" --max-steps 100000 --name donor "$@" \
    > "$work/donor.out" 2> "$work/donor.log" &
  donor_pid=$!
  pids="$pids $donor_pid"
  wait_for "$work/donor.log" 'first step' 120 || { cat "$work/donor.log" >&2; echo "the donor did not train" >&2; exit 1; }
  # shellcheck disable=SC2086
  "$rumor" peer $common $peer_opts --identity "$work/id2.key" --max-steps 1 --name newcomer "$@" \
    > "$work/new.out" 2> "$work/new.log" || { cat "$work/new.log" >&2; echo "round $r: the newcomer failed" >&2; exit 1; }
  kill "$donor_pid" "$boot_pid" 2>/dev/null || true
  wait "$donor_pid" "$boot_pid" 2>/dev/null || true
  pids=""
  line=$(grep 'received the state of' "$work/new.log" | tail -1 || true)
  [ -n "$line" ] || { cat "$work/new.log" >&2; echo "round $r: the newcomer pulled no state" >&2; exit 1; }
  echo "$line" | sed -n 's/.*: \([0-9.]*\) MB in \([0-9.]*\) s, \([0-9.]*\) GB\/s.*/\1 \2 \3/p' >> "$work/pulls"
  echo "round $r: $(tail -1 "$work/pulls" | awk '{printf "%.1f MB in %.3f s, %.2f GB/s", $1, $2, $3}')" >&2
done
mb=$(head -1 "$work/pulls" | awk '{printf "%d", $1}')
"$tcp" --mb "$mb" --reps "$rounds" --one-way > "$work/tcp" || { echo "bench_net_tcp failed" >&2; exit 1; }
tcp_ms=$(sed -n 's/.*median_ms=\([0-9.]*\).*/\1/p' "$work/tcp")
sort -n -k2 "$work/pulls" | awk -v n="$rounds" -v tcp="$tcp_ms" -v mb="$mb" '
  NR == int((n + 1) / 2) {s = $2; g = $3}
  END {
    printf "\nstate pull of %d MB on loopback (medians of %d)   %10s %8s %10s\n", mb, n, "ms", "GB/s", "raw/this"
    printf "%-46s %10.0f %8.2f %10s\n", "raw TCP, one way, no encryption", tcp, mb / tcp, "1.00"
    printf "%-46s %10.0f %8.2f %10.2f\n", "rumor: newcomer pulls the state (AEAD, digest)", s * 1e3, g, tcp / (s * 1e3)
    printf "\ntarget: >= 1 GB/s: %s\n", (g >= 1 ? "met" : "MISSED")
  }'
