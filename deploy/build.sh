#!/bin/sh
# Configures and builds rumor into ./build (or $1). Extra arguments after the
# build directory go to cmake, e.g. deploy/build.sh build-asan -DRUMOR_ASAN=ON.
# CUDA is used when nvcc is found (PATH or /usr/local/cuda); the build works
# without it, for the CPU only. With CI set, warnings are errors.
set -eu
cd "$(dirname "$0")/.."
dir=${1:-build}
[ $# -gt 0 ] && shift
cmake -S . -B "$dir" "$@" >/dev/null
cmake --build "$dir" -j"$(nproc)"
echo "built: $dir/peer/rumor"
