#!/bin/sh
# Runs net's libFuzzer harnesses for a bounded time.
#
# usage: tests/fuzz/run-fuzzers.sh [SECONDS]
#
# SECONDS (default 60) is the total budget, split evenly between harnesses.
# Configures a separate clang build (RUMOR_FUZZ_BUILD, default build-fuzz/ in
# the source tree) with -DRUMOR_FUZZ=ON and AddressSanitizer +
# UndefinedBehaviorSanitizer, builds only the fuzz targets, and runs each
# harness on a scratch copy of its committed seed corpus (the committed
# corpus is never modified). A crashing input is saved under
# $RUMOR_FUZZ_BUILD/artifacts/ and the script exits non-zero.
set -eu

total=${1:-60}
case $total in '' | *[!0-9]*) echo "run-fuzzers.sh: SECONDS must be a positive integer" >&2; exit 2 ;; esac
[ "$total" -gt 0 ] || { echo "run-fuzzers.sh: SECONDS must be positive" >&2; exit 2; }

src=$(cd "$(dirname "$0")/../.." && pwd)
build=${RUMOR_FUZZ_BUILD:-$src/build-fuzz}
harnesses="frame msg"
count=$(echo $harnesses | wc -w)
per=$((total / count))
[ "$per" -ge 1 ] || per=1

command -v clang >/dev/null || { echo "run-fuzzers.sh: clang not found" >&2; exit 1; }
CC=clang CXX=clang++ cmake -S "$src" -B "$build" -DRUMOR_FUZZ=ON -DRUMOR_CUDA=OFF \
  -DRUMOR_ASAN=ON -DRUMOR_UBSAN=ON -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DCMAKE_C_FLAGS="-fsanitize=fuzzer-no-link" >/dev/null
targets=""
for h in $harnesses; do targets="$targets --target fuzz_net_$h"; done
# shellcheck disable=SC2086
cmake --build "$build" $targets -j "$(nproc)"

mkdir -p "$build/artifacts"
status=0
for h in $harnesses; do
  work=$(mktemp -d)
  cp "$src/tests/fuzz/corpus/$h/"* "$work/"
  echo "== fuzz_net_$h for ${per}s ($(ls "$work" | wc -l) seeds)"
  if ! "$build/tests/fuzz/fuzz_net_$h" -max_total_time="$per" -max_len=70000 -timeout=10 \
      -rss_limit_mb=2048 -print_final_stats=1 -artifact_prefix="$build/artifacts/$h-" "$work"; then
    echo "run-fuzzers.sh: fuzz_net_$h found a failure; see $build/artifacts/" >&2
    status=1
  fi
  rm -rf "$work"
done
exit $status
