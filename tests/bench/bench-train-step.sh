#!/bin/sh
# Training-step throughput, rumor vs PyTorch (Debian's python3-torch), on the
# same model, batch and thread count, alternating runs in one session, and
# the median ratio rumor/PyTorch per model.
#
#   tests/bench/bench-train-step.sh [BUILD_DIR] [ROUNDS] [DEVICE]
#
# Targets (issue #2, batch 128, one thread): mlp:784-512-256-10 >= 1.25x,
# mlp:784-4096-4096-10 >= 0.95x. Both sides are pinned to one thread for
# every library they use (OpenMP, OpenBLAS).
set -eu
here=$(cd "$(dirname "$0")" && pwd)
build=${1:-$here/../../build}
rounds=${2:-5}
device=${3:-cpu}
bin=$build/tests/bench/bench_train_step
[ -x "$bin" ] || { echo "build first: $bin is missing" >&2; exit 1; }
py=/usr/bin/python3
$py -c 'import torch' 2>/dev/null || { echo "python3-torch is not installed (deploy/install-deps.sh)" >&2; exit 1; }
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 MKL_NUM_THREADS=1

num() { sed -n "s/.*\"$1\": *\([0-9.e+-]*\).*/\1/p"; }
median() { sort -g | awk '{a[NR]=$1} END {print (NR%2) ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2}'; }

printf '%-24s %-6s %12s %12s %8s\n' model device rumor_sps torch_sps ratio
for spec in mlp:784-512-256-10 mlp:784-4096-4096-10; do
  case $spec in *4096*) steps=15; warm=3;; *) steps=300; warm=30;; esac
  : > /tmp/bench-ratio.$$
  r_all=""; t_all=""
  i=0
  while [ $i -lt "$rounds" ]; do
    r=$("$bin" --model $spec --batch 128 --threads 1 --steps $steps --warmup $warm --device "$device" | num samples_per_s)
    t=$($py "$here/bench_train_step.py" --model $spec --batch 128 --threads 1 --steps $steps --warmup $warm \
          --device "$(echo "$device" | sed 's/^cuda$/cuda:0/')" | num samples_per_s)
    echo "$r $t" | awk '{print $1/$2}' >> /tmp/bench-ratio.$$
    r_all="$r_all $r"; t_all="$t_all $t"
    i=$((i + 1))
  done
  rm_=$(echo $r_all | tr ' ' '\n' | median)
  tm_=$(echo $t_all | tr ' ' '\n' | median)
  ratio=$(median < /tmp/bench-ratio.$$)
  printf '%-24s %-6s %12.0f %12.0f %8.3f\n' $spec "$device" "$rm_" "$tm_" "$ratio"
  rm -f /tmp/bench-ratio.$$
done
$py "$here/bench_train_step.py" --steps 1 --warmup 0 | sed -n 's/.*"version": "\([^"]*\)", "blas": "\([^"]*\)".*/(PyTorch \1, BLAS: \2)/p'
