#!/bin/bash
# Runs the threaded parts of rumor (training thread, network loop thread,
# crypto workers, signal thread) in shell-driven clusters with a sanitizer
# build of rumor's testing binary (rumor-testing: the attacks below exist
# only there), and fails on any sanitizer report. For ThreadSanitizer, which
# Criterion cannot start under here:
#
#   cmake -S . -B build-tsan -DRUMOR_TSAN=ON
#   cmake --build build-tsan --target rumor-testing
#   tests/scripts/sanitizer-clusters.sh build-tsan/tests/rumor-testing
#
# What runs: the soak's CI mode (8 peers, joins, SIGTERM and SIGKILL churn,
# state donations), then for each testing-only attack (flood, signflip, nan,
# short, replay) a bootstrap, 3 honest peers with clipping and 1 attacker for
# 3 epochs of a quarter of Fashion-MNIST each; then two all-reduce clusters
# of 3 in which one member freezes itself (SIGSTOP) before its round of step
# 20, is dropped, and is resumed once the others went on: beside two honest
# members it catches up and all finish; beside two "baddonor" members it
# refuses both states and stops (exit 1).
# Exit 0: no report and every peer finished; 1: otherwise; 77: no data set.
set -u
rumor=${1:?usage: $0 RUMOR_BINARY}
here=$(cd "$(dirname "$0")/../.." && pwd)
data=${RUMOR_FMNIST_DIR:-/usr/share/datasets/fashion-mnist}
[ -e "$data/train-images-idx3-ubyte.gz" ] || { echo "no Fashion-MNIST at $data; skipping" >&2; exit 77; }
export TSAN_OPTIONS=${TSAN_OPTIONS:-"halt_on_error=0 second_deadlock_stack=1"}
reports="AddressSanitizer|ThreadSanitizer|LeakSanitizer|runtime error:"
status=0

T=(--period-ms 100 --ping-timeout-ms 60 --suspect-ms 1000)

# start_cluster NPEERS: a scratch directory ($work) with a cluster key and
# identities id0..idNPEERS, and a bootstrap node (PID $bp) at $boot.
start_cluster() {
  work=$(mktemp -d /tmp/rumor-san-XXXXXX)
  "$rumor" keygen --cluster -o "$work/ck" >/dev/null 2>&1
  for i in $(seq 0 "$1"); do "$rumor" keygen -o "$work/id$i" >/dev/null 2>&1; done
  "$rumor" bootstrap --listen 127.0.0.1:0 --cluster-key "$work/ck" --identity "$work/id0" "${T[@]}" \
    > "$work/b.out" 2> "$work/b.log" &
  bp=$!
  for _ in $(seq 100); do grep -q '"listen"' "$work/b.out" 2>/dev/null && break; sleep 0.1; done
  boot=$(sed -n 's/.*"listen":"\([^"]*\)".*/\1/p' "$work/b.out")
}

# report LABEL OK WHAT: stops the bootstrap node, then prints the sanitizer
# reports of $work's logs, or that a node ended otherwise than expected (OK
# 0; the logs are kept), or WHAT (the directory is removed).
report() {
  local ok=$2
  kill -TERM "$bp" 2>/dev/null
  wait "$bp" || ok=0
  if grep -qE "$reports" "$work"/*.log; then
    echo "== $1: sanitizer reports:"
    grep -hE -A20 "$reports" "$work"/*.log | head -80
    status=1
  elif [ "$ok" = 0 ]; then
    echo "== $1: a node ended otherwise than expected; logs in $work"
    status=1
  else
    echo "== $1: $3, no sanitizer report"
    rm -rf "$work"
  fi
}

echo "== soak, CI mode"
"$here/tests/scripts/soak.sh" --short --rumor "$rumor" || status=1

for kind in flood signflip nan short replay; do
  start_cluster 4
  pids=()
  for i in 1 2 3 4; do
    extra=()
    [ $i = 3 ] && extra=(--attack "$kind")
    nice "$rumor" peer --bootstrap "$boot" --cluster-key "$work/ck" --identity "$work/id$i" --listen 127.0.0.1:0 \
      "${T[@]}" --threads 1 --log-every 0 --shard $((i - 1))/4 --wait-peers 4 --name "p$i" --model mlp:784-64-10 \
      --epochs 3 --batch 64 --lr 0.1 --no-eval --clip "${extra[@]}" > "$work/p$i.out" 2> "$work/p$i.log" &
    pids+=($!)
  done
  ok=1
  for p in "${pids[@]}"; do wait "$p" || ok=0; done
  report "$kind" $ok "4 peers finished"
done

# A frozen all-reduce member, resumed: `others` is the two others' attack,
# `want` the exit status expected of the frozen one.
allreduce_behind() {
  local others=$1 want=$2 steps=$3
  start_cluster 3
  local pids=() attack
  for i in 1 2 3; do
    attack=$others
    [ $i = 3 ] && attack=freeze
    "$rumor" peer --bootstrap "$boot" --cluster-key "$work/ck" --identity "$work/id$i" --listen 127.0.0.1:0 \
      "${T[@]}" --threads 1 --shard $((i - 1))/3 --wait-peers 3 --model mlp:784-32-10 --sync allreduce \
      --batch 16 --max-steps "$steps" --no-eval --attack "$attack" > "$work/p$i.out" 2> "$work/p$i.log" &
    pids+=($!)
  done
  local ok=1 frozen=${pids[2]}
  for _ in $(seq 600); do [ "$(awk '{print $3}' "/proc/$frozen/stat" 2>/dev/null)" = T ] && break; sleep 0.1; done
  for _ in $(seq 300); do grep -q "is now failed" "$work/p1.log" && break; sleep 0.1; done
  sleep 3 # the two others go on without it (no timing is asserted here)
  kill -CONT "$frozen"
  wait "$frozen"
  [ $? = "$want" ] || ok=0
  if [ "$want" = 0 ]; then
    for p in "${pids[0]}" "${pids[1]}"; do wait "$p" || ok=0; done
  else
    kill -TERM "${pids[0]}" "${pids[1]}" 2>/dev/null
    for p in "${pids[0]}" "${pids[1]}"; do wait "$p"; done
  fi
  report "all-reduce, frozen member beside two '$others'" $ok "ended as expected"
}
allreduce_behind none 0 3000
allreduce_behind baddonor 1 1000000

exit $status
