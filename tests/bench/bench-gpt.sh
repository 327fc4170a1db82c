#!/bin/sh
# GPT benchmarks against PyTorch 2.x eager (issue #14), measured side by side
# in one run. PyTorch, numpy and transformers come from PyPI into a virtual
# environment this script creates ($VENV); the reference model is
# tests/scripts/gpt_torch.py (plain PyTorch, F.scaled_dot_product_attention).
#
#   tests/bench/bench-gpt.sh [BUILD_DIR]
#
# Environment: PARTS (default "1 2 3 4 5"), ROUNDS (alternating runs per
# throughput row, default 2), STEPS (training steps of parts 2 and 3,
# default 300), PEER_BATCH (each peer's batch in part 3, default 2; the
# single process then takes 4 times it), PEER_SYNC (part 3's scheme:
# gossip, the default, or allreduce), PEER_OPTS (more options for part 3's
# peers, e.g. "--max-local-steps 2"), GPU_TF32 (part 6: 1 runs both rumor
# and PyTorch with TF32 matrix products, rumor --tf32; default 0, FP32),
# GPU_PY (part 6's Python), VENV (default
# ~/.cache/rumor/bench-venv), DATA (a text file, default the KJV corpus of
# deploy/install-deps.sh).
#
#  1. Training tokens/s, rumor vs PyTorch, same model, AdamW, batch and
#     threads: gpt:L6-H6-C384-T256-V256 at batch 8 and gpt2 at batch 2
#     (T 1024), one thread and every core; the median ratio (target >= 1.2 on
#     one thread) and rumor's achieved GFLOP/s as a fraction of one core's
#     FMA peak measured by bench_fma_peak. FLOPs per token:
#     6·(12·L·C² + V·C) + 6·L·T·C (the matrix products forward and backward,
#     and causal attention's).
#  2. Quality: the small model trained by both on the same text, schedule
#     (warm-up, cosine), steps and batch: final validation loss on the same
#     160 windows (target: within 0.03).
#  3. 4 gossiping peers (rumor peer), each on a quarter of the windows at a
#     quarter of the batch for the same steps (the same tokens in all), vs
#     one process at 4 times the batch (part 2's run when PEER_BATCH is 2):
#     validation loss (target: within 0.05).
#  4. Peak RSS of one gpt2 training step at batch 4, T 1024 (target: rumor's
#     at most PyTorch's).
#  5. transformers' GPT2LMHeadModel.from_pretrained loads a rumor checkpoint
#     directory, and its logits match rumor's reference model.
#  6. (PARTS=6, not by default) on a GPU: part 1's step in rumor --device
#     cuda vs PyTorch on the same GPU, FP32 or (GPU_TF32=1) TF32 in both;
#     GPU_PY names a Python whose torch sees it. Skipped with the reason
#     where there is none.
set -eu
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
build=${1:-$root/build}
rumor=$build/peer/rumor
peak_bin=$build/tests/bench/bench_fma_peak
parts=${PARTS:-1 2 3 4 5}
rounds=${ROUNDS:-2}
steps=${STEPS:-300}
peer_batch=${PEER_BATCH:-2}
peer_sync=${PEER_SYNC:-gossip}
peer_opts=${PEER_OPTS:-}
venv=${VENV:-$HOME/.cache/rumor/bench-venv}
data=${DATA:-/usr/local/share/rumor/kjv.txt}
ref=$root/tests/scripts/gpt_torch.py
cores=$(nproc)
[ -x "$rumor" ] && [ -x "$peak_bin" ] || { echo "build first: $rumor or $peak_bin is missing" >&2; exit 1; }
[ -s "$data" ] || { echo "no text at $data: run deploy/install-deps.sh or deploy/make-corpus.sh $data" >&2; exit 1; }
py=$venv/bin/python
case " $parts " in
*" 1 "* | *" 2 "* | *" 4 "* | *" 5 "*) # part 3 alone runs only rumor
  if [ ! -x "$py" ] || ! "$py" -c 'import torch, numpy, transformers' 2>/dev/null; then
    echo "installing PyTorch 2.x, numpy and transformers from PyPI into $venv (once)"
    /usr/bin/python3 -m venv "$venv"
    "$venv/bin/pip" install -q --upgrade pip
    "$venv/bin/pip" install -q "torch>=2" numpy transformers
  fi
  torch_version=$("$py" -c 'import torch; print("PyTorch", torch.__version__)')
  ;;
*) torch_version="PyTorch not needed" ;;
esac
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

num() { sed -n "s/.*\"$1\": *\([0-9.e+-]*\).*/\1/p" | tail -1; }
median() { sort -g | awk '{a[NR]=$1} END {print (NR%2) ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2}'; }
isa=$("$peak_bin" | sed -n 's/.*"isa":"\([a-z0-9]*\)".*/\1/p')
peak=$("$peak_bin" | num gflops)
echo "machine: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //'), $cores cores, $isa;" \
  "one core's FMA peak $peak GFLOP/s (bench_fma_peak); $torch_version"

# rumor's and PyTorch's training runs of the same configuration.
# Arguments: L H C T V batch steps threads [extra rumor flags...]
rumor_train() {
  L=$1 H=$2 C=$3 T=$4 V=$5 B=$6 S=$7 TH=$8
  shift 8
  OMP_NUM_THREADS=$TH "$rumor" train --model "gpt:L$L-H$H-C$C-T$T-V$V" --data "$data" --optimizer adamw \
    --batch "$B" --max-steps "$S" --threads "$TH" --log-every 0 --no-eval "$@" 2>"$work/rumor.log"
}
torch_train() {
  L=$1 H=$2 C=$3 T=$4 V=$5 B=$6 S=$7 TH=$8
  shift 8
  OMP_NUM_THREADS=$TH "$py" "$ref" train --config \
    "{\"n_layer\":$L,\"n_head\":$H,\"n_embd\":$C,\"n_positions\":$T,\"vocab_size\":$V}" --data "$data" \
    --batch "$B" --steps "$S" --threads "$TH" "$@"
}

part1() {
  echo
  echo "1. training throughput (tokens/s), median of $rounds alternating runs"
  printf '%-32s %7s %5s %12s %12s %7s %9s %9s\n' model threads batch rumor torch ratio GFLOP/s of_peak
  for cfg in "6 6 384 256 256 8 12" "12 12 768 1024 50257 2 3"; do
    # shellcheck disable=SC2086
    set -- $cfg
    L=$1 H=$2 C=$3 T=$4 V=$5 B=$6 S=$7
    flops=$(echo "$L $C $T $V" | awk '{print 6*(12*$1*$2*$2 + $4*$2) + 6*$1*$3*$2}')
    for th in 1 "$cores"; do
      rs="" ts="" ratios=""
      i=0
      while [ $i -lt "$rounds" ]; do
        r=$(rumor_train "$L" "$H" "$C" "$T" "$V" "$B" "$S" "$th" --eval-batches 1 | num samples_per_s)
        r=$(echo "$r $T" | awk '{print $1*$2}')
        t=$(torch_train "$L" "$H" "$C" "$T" "$V" "$B" "$S" "$th" --eval-windows 1 | num tokens_per_s)
        rs="$rs $r" ts="$ts $t" ratios="$ratios $(echo "$r $t" | awk '{print $1/$2}')"
        i=$((i + 1))
      done
      rm_=$(echo $rs | tr ' ' '\n' | median)
      tm_=$(echo $ts | tr ' ' '\n' | median)
      ratio=$(echo $ratios | tr ' ' '\n' | median)
      gf=$(echo "$rm_ $flops" | awk '{printf "%.1f", $1*$2/1e9}')
      frac=$(echo "$gf $peak $th" | awk '{printf "%.2f", $1/($2*$3)}')
      printf '%-32s %7s %5s %12.0f %12.0f %7.2f %9s %9s\n' "gpt:L$L-H$H-C$C-T$T-V$V" "$th" "$B" "$rm_" "$tm_" \
        "$ratio" "$gf" "$frac"
    done
  done
  echo "(of_peak: rumor's GFLOP/s over threads × one core's FMA peak)"
}

QUALITY="6 6 384 256 256"
single_loss=""
part2() {
  echo
  echo "2. quality: gpt:L6-H6-C384-T256-V256, $steps steps of batch 8, AdamW lr 1e-3, warm-up 30, cosine," \
    "weight decay 0.1, gradient clip 1.0, $cores threads"
  # shellcheck disable=SC2086
  r=$(rumor_train $QUALITY 8 "$steps" "$cores" --lr 1e-3 --warmup 30 --weight-decay 0.1 --grad-clip 1.0 \
    --eval-batches 20 | num val_loss)
  # shellcheck disable=SC2086
  t=$(torch_train $QUALITY 8 "$steps" "$cores" --lr 1e-3 --warmup 30 --weight-decay 0.1 --grad-clip 1.0 \
    --eval-windows 160 | num val_loss)
  single_loss=$r
  echo "validation loss: rumor $r, PyTorch $t, difference $(echo "$r $t" | awk '{printf "%+.4f", $1-$2}')" \
    "(target: within 0.03)"
}

part3() {
  echo
  b=$((4 * peer_batch)) # the validation loss is over the same 160 windows for both
  echo "3. 4 peers (--sync $peer_sync${peer_opts:+ $peer_opts}), each $steps steps of batch $peer_batch on a quarter" \
    "of the windows, vs one process at batch $b"
  [ -n "$single_loss" ] && [ "$b" -eq 8 ] || single_loss=$(rumor_train $QUALITY "$b" "$steps" "$cores" --lr 1e-3 \
    --warmup 30 --weight-decay 0.1 --grad-clip 1.0 --eval-batches $((160 / b)) | num val_loss)
  WORKDIR=$work/cluster RUMOR=$rumor "$root/deploy/local-cluster.sh" 4 -- --model gpt:L6-H6-C384-T256-V256 \
    --data "$data" --sync "$peer_sync" --optimizer adamw --batch "$peer_batch" --max-steps "$steps" --lr 1e-3 --warmup 30 \
    --weight-decay 0.1 --grad-clip 1.0 --eval-batches $((160 / peer_batch)) --no-eval --log-every 0 $peer_opts | tail -5
  worst=$(for i in 1 2 3 4; do num val_loss < "$work/cluster/peer-$i.out"; done | sort -g | tail -1)
  echo "worst peer's validation loss $worst vs one process $single_loss:" \
    "difference $(echo "$worst $single_loss" | awk '{printf "%+.4f", $1-$2}') (target: within 0.05)"
}

part4() {
  echo
  echo "4. peak RSS of one gpt2 training step, batch 4, T 1024, $cores threads"
  /usr/bin/time -f '%M' -o "$work/rss.r" "$rumor" train --model gpt2 --data "$data" --optimizer adamw --batch 4 \
    --max-steps 1 --threads "$cores" --log-every 0 --no-eval --eval-batches 1 >/dev/null 2>&1
  /usr/bin/time -f '%M' -o "$work/rss.t" "$py" "$ref" train --config \
    '{"n_layer":12,"n_head":12,"n_embd":768,"n_positions":1024,"vocab_size":50257}' --data "$data" --batch 4 \
    --steps 1 --threads "$cores" --eval-windows 1 >/dev/null 2>&1
  r=$(tail -1 "$work/rss.r") t=$(tail -1 "$work/rss.t")
  echo "peak RSS: rumor $((r / 1024)) MiB, PyTorch $((t / 1024)) MiB, ratio $(echo "$r $t" | awk '{printf "%.2f", $1/$2}')" \
    "(target: at most 1)"
}

part5() {
  echo
  echo "5. transformers' GPT2LMHeadModel.from_pretrained on a rumor checkpoint directory"
  "$rumor" train --model gpt:L2-H2-C64-T64-V256 --data "$data" --optimizer adamw --lr 3e-3 --batch 8 --max-steps 30 \
    --log-every 0 --no-eval --eval-batches 1 --checkpoint "$work/hf/" >/dev/null 2>&1
  HF_HUB_DISABLE_PROGRESS_BARS=1 TRANSFORMERS_VERBOSITY=error "$py" - "$work/hf" "$ref" <<'EOF'
import importlib.util, sys, torch
from transformers import GPT2LMHeadModel
d, ref = sys.argv[1], sys.argv[2]
spec = importlib.util.spec_from_file_location("gpt_torch", ref)
g = importlib.util.module_from_spec(spec); spec.loader.exec_module(g)
hf = GPT2LMHeadModel.from_pretrained(d).eval()
import json; cfg = json.load(open(d + "/config.json"))
mine = g.GPT(cfg); mine.load_dir(d)
x = torch.tensor([list(b"In the beginning God created the heaven and the earth.")[:64]])
with torch.no_grad():
    a, b = hf(x).logits[0], mine(x)[0]
print(f"loaded {type(hf).__name__}: {sum(p.numel() for p in hf.parameters())} parameters; "
      f"largest logit difference from rumor's reference model {float((a - b).abs().max()):.2e}")
EOF
}

# 6. On a GPU: the same training step in rumor (--device cuda: cuBLAS and
# its kernels, FP32; with GPU_TF32=1 --tf32) and in PyTorch on that GPU
# (TF32 off; with GPU_TF32=1 on), tokens/s for
# both configurations of part 1. Skipped with the reason where there is no
# GPU or rumor was built without CUDA. GPU_PY names the Python whose torch
# sees the GPU (default: the benchmark's environment; on a machine with its
# own CUDA PyTorch, e.g. GPU_PY=python3).
part6() {
  echo
  tf32_flag=""
  math=FP32
  if [ "${GPU_TF32:-0}" = 1 ]; then tf32_flag=--tf32 math=TF32; fi
  echo "6. training throughput on a GPU (tokens/s, $math matrix products), median of $rounds alternating runs"
  gpy=${GPU_PY:-$py}
  if ! gpu=$(nvidia-smi -L 2>/dev/null | head -1) || [ -z "$gpu" ]; then
    echo "skipped: no GPU (nvidia-smi -L lists none)"
    return 0
  fi
  if ! "$rumor" train --model gpt:L1-H1-C8-T8-V256 --data "$data" --device cuda --max-steps 1 --no-eval \
    --log-every 0 >/dev/null 2>"$work/gpu.log"; then
    echo "skipped: rumor cannot train on the GPU: $(tail -1 "$work/gpu.log")"
    return 0
  fi
  # Without a PyTorch that sees the GPU, rumor's figures alone (torch and ratio nan).
  have_torch=1
  if ! "$gpy" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    have_torch=0
    echo "PyTorch: $gpy has none that sees the GPU (set GPU_PY); rumor's figures only"
  fi
  [ $have_torch = 1 ] && echo "$gpu; $("$gpy" -c 'import torch; print("PyTorch", torch.__version__)')"
  [ $have_torch = 0 ] && echo "$gpu"
  printf '%-32s %5s %6s %12s %12s %7s\n' model batch steps rumor torch ratio
  for cfg in "6 6 384 256 256 8 200" "12 12 768 1024 50257 4 30"; do
    # shellcheck disable=SC2086
    set -- $cfg
    L=$1 H=$2 C=$3 T=$4 V=$5 B=$6 S=$7
    rs="" ts="" ratios=""
    i=0
    while [ $i -lt "$rounds" ]; do
      # shellcheck disable=SC2086 # empty or one flag
      r=$(rumor_train "$L" "$H" "$C" "$T" "$V" "$B" "$S" 1 --device cuda --eval-batches 1 $tf32_flag |
        num samples_per_s)
      r=$(echo "$r $T" | awk '{print $1*$2}')
      t=nan
      if [ $have_torch = 1 ]; then
        cpu_py=$py py=$gpy
        # shellcheck disable=SC2086
        t=$(torch_train "$L" "$H" "$C" "$T" "$V" "$B" "$S" 1 --device cuda --eval-windows 1 $tf32_flag |
          num tokens_per_s)
        py=$cpu_py
      fi
      rs="$rs $r" ts="$ts $t" ratios="$ratios $(echo "$r $t" | awk '{print ($2 == "nan") ? "nan" : $1/$2}')"
      i=$((i + 1))
    done
    # shellcheck disable=SC2086 # unquoted: the lists' leading space goes
    printf '%-32s %5s %6s %12.0f %12.0f %7.2f\n' "gpt:L$L-H$H-C$C-T$T-V$V" "$B" "$S" \
      "$(echo $rs | tr ' ' '\n' | median)" "$(echo $ts | tr ' ' '\n' | median)" \
      "$(echo $ratios | tr ' ' '\n' | median)"
  done
}

for p in $parts; do "part$p"; done
