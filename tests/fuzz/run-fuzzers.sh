#!/bin/sh
# Runs rumor's libFuzzer harnesses (tests/fuzz/CMakeLists.txt) for a bounded
# time.
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
# <module>:<harness>, as in RUMOR_FUZZ_HARNESSES (tests/fuzz/CMakeLists.txt).
harnesses="net:frame net:msg net:http peer:safetensors peer:tokens peer:codec util:json gossip:updates"
count=$(echo "$harnesses" | wc -w)
per=$((total / count))
[ "$per" -ge 1 ] || per=1

command -v clang >/dev/null || { echo "run-fuzzers.sh: clang not found" >&2; exit 1; }
# -Wno-pass-failed: the safetensors harness links the tensor layer, whose
# `omp simd` loops clang cannot vectorise once the sanitizers instrument them;
# it says so with a warning, which CI's -Werror would make fatal.
CC=clang CXX=clang++ cmake -S "$src" -B "$build" -DRUMOR_FUZZ=ON -DRUMOR_CUDA=OFF \
  -DRUMOR_ASAN=ON -DRUMOR_UBSAN=ON -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DCMAKE_C_FLAGS="-fsanitize=fuzzer-no-link -Wno-pass-failed" >/dev/null
targets=""
for mh in $harnesses; do targets="$targets --target fuzz_${mh%%:*}_${mh#*:}"; done
# shellcheck disable=SC2086
cmake --build "$build" $targets -j "$(nproc)"

mkdir -p "$build/artifacts"
status=0
for mh in $harnesses; do
  h=${mh#*:}
  bin=fuzz_${mh%%:*}_$h
  work=$(mktemp -d)
  cp "$src/tests/fuzz/corpus/$h/"* "$work/"
  echo "== $bin for ${per}s ($(find "$work" -type f | wc -l) seeds)"
  if ! "$build/tests/fuzz/$bin" -max_total_time="$per" -max_len=70000 -timeout=10 \
      -rss_limit_mb=2048 -print_final_stats=1 -artifact_prefix="$build/artifacts/$h-" "$work"; then
    echo "run-fuzzers.sh: $bin found a failure; see $build/artifacts/" >&2
    status=1
  fi
  rm -rf "$work"
done
exit $status
