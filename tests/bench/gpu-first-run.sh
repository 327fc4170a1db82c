#!/bin/sh
# The first run on a GPU (issue #33): everything a session that finds a GPU
# should run first, into one report.
#
#   tests/bench/gpu-first-run.sh [BUILD_DIR]
#   tests/bench/gpu-first-run.sh --binaries   (the test binaries it runs)
#
#  1. The CUDA tests, each binary with its verbose output: the op tests
#     (test_tensor_cuda, test_tensor_cuda_nn, test_tensor_cuda_shapes: the
#     model's real shapes; test_tensor_cuda_moe: the mixture-of-experts
#     kernels, issue #32; test_peer_moe_ep: expert-parallel ranks on the
#     GPU against one CPU process), the whole-model tests on CUDA against the CPU
#     (test_peer_gpt, test_peer_gradcheck), the start without cuBLAS
#     (test_peer_nocublas) and averaging between GPU peers and between
#     CPU and GPU peers (test_peer_gossip's consensus_lr0 cases), a
#     DiLoCo member on the GPU against the CPU (test_peer_outer). A GPU
#     test that skipped although a GPU is present counts as a failure.
#  2. PARTS=6 tests/bench/bench-gpt.sh: GPT training throughput on the GPU
#     in FP32, then in TF32 (GPU_TF32=1, rumor --tf32), against PyTorch on
#     the same GPU where GPU_PY has one that sees it (else rumor's figures
#     alone).
#  3. Two gossiping peers on the GPU (deploy/local-cluster.sh 2, --device
#     cuda, gpt:L6-H6-C384-T256-V256, 300 steps): both finish, exchange,
#     and their validation losses.
#  4. Groups of two processes on the GPU against the same on the CPU:
#     tensor parallelism, ZeRO 2 and 3, pipeline stages, expert
#     parallelism; and a ZeRO member's device memory at ZeRO 0 against 3.
#
# Each step has its own time limit (20 s for the first GPU step, 120 for the
# tests, 2 × 80 for the benchmark, 60 for the peers, 12 × 10 for the groups:
# 480 s), so the whole run ends within 8 minutes on one GPU (steps 1-3 took
# 2.2 minutes on an H200). STEPS (default "1 2 3 4") picks steps. The report (REPORT, default
# BUILD_DIR/gpu-first-run.txt) starts with the GPU, driver, commit and
# build; its last line is the verdict. Record its figures in
# docs/benchmarks.md.
#
# Environment: REPORT, DATA (a text file for the GPT runs; default the KJV
# corpus of deploy/install-deps.sh, else one made from this tree's docs),
# GPU_PY (a Python whose torch sees the GPU, for step 2), ROUNDS (step 2's
# alternating runs, default 1), LOGS (a .tar.gz to keep every step's full
# log in: the test binaries' verbose output, the benchmark's, the peers').
#
# Exit status: 0 every step passed; 1 a step failed (the report says
# which); 2 not built; 77 no GPU on this machine (nothing is run).
# shellcheck disable=SC2317 # the steps are called as "step$step"
set -u
tests="test_tensor_cuda test_tensor_cuda_nn test_tensor_cuda_shapes test_tensor_cuda_moe test_peer_moe_ep
  test_peer_gpt test_peer_gradcheck test_peer_nocublas"
# Binaries of which only the GPU cases run, each with its filter.
filtered="test_peer_gossip:gossip/consensus_lr0_* test_peer_outer:outer/*_on_cuda_*"
binaries=$(for t in $tests $filtered; do printf '%s ' "${t%%:*}"; done)
# --binaries: the test binaries the steps run (and rumor-testing, which the
# cluster tests may start), for tests/bench/gpu-bundle.sh.
if [ "${1:-}" = "--binaries" ]; then
  echo "${binaries}rumor-testing"
  exit 0
fi
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
build=$(cd "${1:-$root/build}" 2>/dev/null && pwd) || { echo "$0: no build directory ${1:-$root/build}" >&2; exit 2; }
rumor=$build/peer/rumor
report=${REPORT:-$build/gpu-first-run.txt}
rounds=${ROUNDS:-1}

gpu=$(nvidia-smi -L 2>/dev/null | head -1)
if [ -z "$gpu" ]; then
  echo "$0: no GPU on this machine (nvidia-smi -L lists none, or there is no nvidia-smi): nothing to run" >&2
  exit 77
fi
[ -x "$rumor" ] || { echo "$0: $rumor is missing: build with -DRUMOR_CUDA=ON -DRUMOR_TESTS=ON first" >&2; exit 2; }
for t in $binaries; do
  [ -x "$build/tests/$t" ] || { echo "$0: $build/tests/$t is missing: build with -DRUMOR_TESTS=ON" >&2; exit 2; }
done

work=$(mktemp -d /tmp/rumor-gpu-first-run.XXXXXX) || exit 2
# shellcheck disable=SC2317 # called by the trap
keep_logs() {
  [ -n "${LOGS:-}" ] && tar -czf "$LOGS" -C "$work" --exclude=text.txt --exclude='*.key' . 2>/dev/null
  rm -rf "$work"
}
trap keep_logs EXIT
data=${DATA:-/usr/local/share/rumor/kjv.txt}
if [ ! -s "$data" ]; then
  # About 4 MB of this tree's prose: enough windows for the runs below.
  data=$work/text.txt
  i=0
  while [ $i -lt 8 ]; do cat "$root"/README.md "$root"/docs/*.md >>"$data"; i=$((i + 1)); done
fi

failed=""
: >"$report"
say() { echo "$*" | tee -a "$report"; }
# section TITLE: a heading in the report and on the terminal.
section() { say ""; say "== $* == ($(date -u +%H:%M:%S) UTC)"; }

section "machine"
say "$gpu"
nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap --format=csv,noheader 2>&1 | tee -a "$report"
say "rumor: $("$rumor" --version 2>&1), commit $(git -C "$root" rev-parse --short HEAD 2>/dev/null || echo unknown)"
say "build: $(grep -E '^(CMAKE_BUILD_TYPE|CMAKE_CUDA_ARCHITECTURES|RUMOR_CUDA):' "$build/CMakeCache.txt" 2>/dev/null |
  tr '\n' ' ')"
say "data: $data ($(wc -c <"$data") bytes)"
if ! timeout 20 "$rumor" train --model gpt:L1-H1-C8-T8-V256 --data "$data" --device cuda --max-steps 1 --no-eval \
  --eval-batches 1 --log-every 0 >/dev/null 2>"$work/open.log"; then
  say "rumor cannot train on the GPU:"
  tee -a "$report" <"$work/open.log"
  say ""
  say "VERDICT: FAIL (rumor cannot use the GPU)"
  exit 1
fi
grep -m1 "cuda:0" "$work/open.log" | tee -a "$report"

# 1. The CUDA tests, all binaries at once (16 cores, one GPU), 120 s.
step1() {
  section "1. CUDA tests"
  for t in $tests; do
    (cd "$work" && timeout 120 "$build/tests/$t" --verbose --jobs 2 >"$work/$t.log" 2>&1; echo $? >"$work/$t.rc") &
  done
  for tf in $filtered; do
    t=${tf%%:*}
    (cd "$work" && timeout 120 "$build/tests/$t" --verbose --jobs 1 --filter "${tf#*:}" >"$work/$t.log" 2>&1
      echo $? >"$work/$t.rc") &
  done
  wait
  for tf in $tests $filtered; do
    t=${tf%%:*}
    rc=$(cat "$work/$t.rc")
    synth=$(grep -a "Synthesis" "$work/$t.log" | tail -1 | sed 's/.*Synthesis: //')
    skips=$(grep -a -c -E "^\[SKIP\].*no (usable )?CUDA GPU" "$work/$t.log")
    say "$t: exit $rc; ${synth:-no synthesis (killed after 120 s?)}; $skips skipped for want of a GPU"
    # Failures, skips for any reason (no data, not enough device memory: gaps
    # to note) and the figures the tests print.
    grep -a -E "^\[(FAIL|----|SKIP)\]|gradient check|gpt on cuda|consensus:" "$work/$t.log" |
      grep -v -e "Criterion v" -e "Test is disabled" | head -20 | sed 's/^/    /' | tee -a "$report"
    if [ "$rc" != 0 ] || [ "$skips" != 0 ]; then failed="$failed $t"; fi
  done
}

# 2. bench-gpt.sh part 6, FP32 and TF32, 80 s each.
step2() {
  for math in FP32 TF32; do
    section "2. PARTS=6 bench-gpt.sh, $math"
    tf=0
    [ "$math" = TF32 ] && tf=1
    if PARTS=6 ROUNDS=$rounds GPU_TF32=$tf DATA=$data timeout 80 "$root/tests/bench/bench-gpt.sh" "$build" \
      >"$work/bench-$math.log" 2>&1 && ! grep -q "^skipped:" "$work/bench-$math.log"; then
      tee -a "$report" <"$work/bench-$math.log"
    else
      tee -a "$report" <"$work/bench-$math.log"
      say "bench-gpt.sh ($math) failed, skipped its GPU part or ran past 80 s"
      failed="$failed bench-$math"
    fi
  done
}

# 3. Two gossiping peers on the GPU, 60 s.
step3() {
  section "3. two gossiping peers on the GPU"
  if WORKDIR=$work/cluster RUMOR=$rumor timeout 60 "$root/deploy/local-cluster.sh" 2 -- \
    --model gpt:L6-H6-C384-T256-V256 --data "$data" --device cuda --optimizer adamw --lr 1e-3 --warmup 30 \
    --batch 8 --max-steps 300 --no-eval --eval-batches 8 --log-every 0 >"$work/cluster.log" 2>&1; then
    tail -5 "$work/cluster.log" | tee -a "$report"
    for i in 1 2; do
      out=$work/cluster/peer-$i.out
      say "peer $i: $(grep -o '"val_loss":[0-9.e+-]*' "$out" | tail -1)," \
        "$(grep -o '"exchanges":[0-9]*' "$out" | tail -1), $(grep -o '"samples_per_s":[0-9.e+-]*' "$out" | tail -1)"
      grep -q '"exchanges":[1-9]' "$out" || { say "peer $i applied no exchange"; failed="$failed gossip"; }
    done
  else
    tail -15 "$work/cluster.log" | tee -a "$report"
    say "the 2-peer run failed or ran past 60 s"
    failed="$failed gossip"
  fi
}

# 4. Groups on the GPU against the same groups on the CPU, 100 s: tensor
# parallelism, ZeRO 2 and 3, pipeline stages and expert parallelism, two
# processes each on the one GPU (cuda:0), 30 AdamW steps of a small GPT;
# each layout's validation loss on the GPU within 1e-3 of the CPU's. Then
# the device memory a ZeRO member holds (device_peak_bytes: its buffers at
# most, what ZeRO gave back not counted) at ZeRO 0 against 3, on a larger
# GPT (gpt:L8-H8-C512-T128-V8192, 10 steps), 20 s.
step4() {
  section "4. groups on the GPU against the CPU"
  grp=$work/groups
  mkdir -p "$grp"
  "$rumor" keygen --cluster -o "$grp/cluster.key" >/dev/null 2>&1 && "$rumor" keygen -o "$grp/id.key" >/dev/null 2>&1
  for layout in "--tensor-parallel 2" "--data-parallel 2 --zero 2" "--data-parallel 2 --zero 3" \
    "--stages 2 --micro-batches 2" "--expert-parallel 2" "--expert-parallel 2 --zero 3"; do
    c=$(group_run 30 val_loss cpu gpt:L2-H4-C64-T64-V256 "$layout")
    g=$(group_run 30 val_loss cuda:0 gpt:L2-H4-C64-T64-V256 "$layout")
    verdict=$(echo "$c $g" | awk '$1 != "failed" && $2 != "failed" && $1 - $2 <= 1e-3 && $2 - $1 <= 1e-3 {print "ok"}')
    say "group $layout: val loss cpu ${c:-none}, cuda:0 ${g:-none} ${verdict:-MISMATCH}"
    [ "$verdict" = ok ] || failed="$failed group($layout)"
  done
  m=gpt:L8-H8-C512-T128-V8192
  z0=$(group_run 10 device_peak_bytes cuda:0 "$m" "--data-parallel 2 --zero 0")
  z3=$(group_run 10 device_peak_bytes cuda:0 "$m" "--data-parallel 2 --zero 3")
  ratio=$(echo "$z0 $z3" | awk '$1 + 0 > 0 && $2 + 0 > 0 {printf " (%.2fx less)", $1 / $2}')
  say "$m, --data-parallel 2 on cuda:0, a member's device memory at most (bytes): --zero 0 ${z0:-none}," \
    "--zero 3 ${z3:-none}$ratio"
  if ! echo "$z0 $z3" | awk '$1 + 0 > 0 && $2 + 0 > 0 && $2 + 0 < $1 + 0 {ok = 1} END {exit !ok}'; then
    failed="$failed zero-memory"
  fi
}

# group_run STEPS FIELD DEVICE MODEL LAYOUT: a group's FIELD from its
# result line, or "failed". The layout's words split; -E4-K2 added to the
# model for --expert-parallel.
group_run() {
  steps=$1 field=$2 dev=$3 m=$4
  shift 4
  case " $* " in *" --expert-parallel "*) m=$m-E4-K2 ;; esac
  log=$grp/$(echo "$dev $m $*" | tr -c 'a-zA-Z0-9\n' _).log
  # shellcheck disable=SC2068 # the layout's words
  if timeout 10 "$rumor" group $@ --devices "$dev" --model "$m" --data "$data" --batch 8 --max-steps "$steps" \
    --eval-batches 4 --optimizer adamw --lr 1e-3 --seed 1 --threads 1 --cluster-key "$grp/cluster.key" \
    --identity "$grp/id.key" >"$log.out" 2>"$log"; then
    tail -1 "$log.out" | sed -n "s/.*\"$field\":\([0-9.e+-]*\).*/\1/p"
  else
    echo failed
  fi
}

for step in ${STEPS:-1 2 3 4}; do
  case $step in
  1 | 2 | 3 | 4) "step$step" ;;
  *) say "STEPS: no step $step (steps are 1 2 3 4)" && failed="$failed step$step" ;;
  esac
done
say ""
if [ -z "$failed" ]; then
  say "VERDICT: PASS (report: $report)"
  exit 0
fi
say "VERDICT: FAIL:$failed (report: $report)"
exit 1
