#!/bin/sh
# Benchmark of net (issue #3): two processes on loopback exchange an fp32
# buffer in both directions at once, the way one gossip exchange does,
# sealed with OpenSSL's AEAD (protocol version 2), compared in the same run with
#   (a) the same exchange over raw TCP (bench_net_tcp: no encryption), and
#   (b) PyTorch gloo all_reduce of the same buffer between 2 processes.
#
# usage: tests/bench/bench-net.sh [BUILD_DIR]
#   env: MB (default 100), REPS (rounds per program after a warm-up, default 7),
#        EXTRA=0 to skip the informative variants (no digest, bf16 wire, ChaCha20, through a relay).
# Builds bench_net_exchange and bench_net_tcp in BUILD_DIR (default
# build-bench/, Release) and prints a table of medians and the targets of
# issue #15: the encrypted f32 exchange (digest off) at gloo_time /
# rumor_time >= 1.25 and >= 75 % of raw TCP's goodput; with the transfer
# digest, gloo/rumor >= 1.0; the digest costing at most 15 %.
set -eu

src=$(cd "$(dirname "$0")/../.." && pwd)
build=${1:-$src/build-bench}
MB=${MB:-100}
REPS=${REPS:-7}
EXTRA=${EXTRA:-1}
PY=/usr/bin/python3 # Debian's, with python3-torch (a pyenv python3 on PATH lacks torch)

if [ ! -f "$build/CMakeCache.txt" ]; then
  cmake -S "$src" -B "$build" -DCMAKE_BUILD_TYPE=Release -DRUMOR_CUDA=OFF >/dev/null
fi
cmake --build "$build" --target bench_net_exchange bench_net_tcp -j "$(nproc)" >/dev/null
bin=$build/tests/bench
log=$(mktemp)
trap 'rm -f "$log"' EXIT

# run NAME CMD...: runs a benchmark, shows its output, returns its median in ms.
median() { sed -n 's/.*median_ms=\([0-9.]*\).*/\1/p' "$log" | tail -n 1; }
run() {
  name=$1
  shift
  echo "== $name" >&2
  "$@" | tee "$log" >&2
  m=$(median)
  [ -n "$m" ] || { echo "bench-net.sh: $name printed no median" >&2; exit 1; }
  echo "$m"
}

echo "bench-net.sh: $MB MB each way, $REPS rounds per program (medians), $(nproc) CPUs" >&2
raw=$(run "raw TCP" "$bin/bench_net_tcp" --mb "$MB" --reps "$REPS")
rumor=$(run "rumor (AES-256-GCM, tag digest, f32)" "$bin/bench_net_exchange" --mb "$MB" --reps "$REPS")
gloo=$(run "gloo all_reduce" env OMP_NUM_THREADS=1 "$PY" "$src/tests/bench/bench_gloo.py" --mb "$MB" --reps "$REPS")
if [ "$EXTRA" = 1 ]; then
  nodig=$(run "rumor, digest off" "$bin/bench_net_exchange" --mb "$MB" --reps "$REPS" --no-digest)
  bf16=$(run "rumor, bf16 on the wire" "$bin/bench_net_exchange" --mb "$MB" --reps "$REPS" --wire bf16)
  chacha=$(run "rumor, ChaCha20-Poly1305" "$bin/bench_net_exchange" --mb "$MB" --reps "$REPS" --suite chacha)
  relayed=$(run "rumor, through a relay (a third process)" "$bin/bench_net_exchange" --mb "$MB" --reps "$REPS" --relay)
fi

echo "(load average at the end: $(cut -d' ' -f1-3 /proc/loadavg); other processes on this machine disturb the figures)" >&2
awk -v mb="$MB" -v raw="$raw" -v rumor="$rumor" -v gloo="$gloo" -v extra="$EXTRA" \
    -v nodig="${nodig:-0}" -v bf16="${bf16:-0}" -v chacha="${chacha:-0}" -v relayed="${relayed:-0}" 'BEGIN {
  printf "\n%-46s %10s %14s %10s %10s\n", "two-way exchange of " mb " MB (medians)", "ms", "MB/s each way", "gloo/this", "raw/this"
  row("raw TCP, no encryption (bench_net_tcp)", raw)
  row("gloo all_reduce (reference)", gloo)
  row("rumor: AES-256-GCM, tag digest, f32", rumor)
  if (extra == 1) {
    row("rumor: digest off (AEAD only), f32", nodig)
    row("rumor: tag digest, bf16 on the wire", bf16)
    row("rumor: ChaCha20-Poly1305, digest, f32", chacha)
    row("rumor: through a relay (net/relay.c)", relayed)
  }
  printf "\ntarget (digest on):  gloo/rumor = %.2f (>= 1.0: %s)\n", gloo / rumor, ((gloo / rumor >= 1.0) ? "met" : "MISSED")
  if (extra == 1) {
    printf "targets (digest off): gloo/rumor = %.2f (>= 1.25: %s), rumor/raw goodput = %.2f (>= 0.75: %s)\n",
           gloo / nodig, ((gloo / nodig >= 1.25) ? "met" : "MISSED"), raw / nodig, ((raw / nodig >= 0.75) ? "met" : "MISSED")
    printf "digest cost: digest on / digest off = %.2f (<= 1.15: %s)\n", rumor / nodig, ((rumor / nodig <= 1.15) ? "met" : "MISSED")
    printf "relay cost: relayed / direct = %.2f (each byte crosses loopback twice and is sealed twice; no target)\n", relayed / rumor
  }
}
function row(name, ms) {
  printf "%-46s %10.1f %14.0f %10.2f %10.2f\n", name, ms, mb / (ms / 1000), gloo / ms, raw / ms
}'
