#!/bin/sh
# Runs a gossip cluster on this machine: a bootstrap node and N peers, each
# training on 1/N of Fashion-MNIST, keeps one log per process, and prints
# every peer's final test accuracy.
#
#   deploy/local-cluster.sh [N] [-- extra rumor peer options]
#
# A language model on text: deploy/local-cluster.sh 4 -- --model
# gpt:L4-H4-C128-T128-V256 --data /usr/local/share/rumor/kjv.txt --optimizer
# adamw --lr 1e-3 --max-steps 300 (each peer trains on a quarter of the
# text's windows; the table shows each peer's validation loss per token).
#
# Environment: RUMOR (the binary, default build/peer/rumor), WORKDIR (keys
# and logs, default ./cluster-run), EPOCHS (passes of each peer over its
# 1/N shard, default 10: the cluster together sees 10 epochs' worth of data),
# BATCH (each peer's batch, default 128/N and at least 16: the cluster then
# takes as many steps as one peer with batch 128 would, on the same samples),
# THREADS (CPU threads per peer, default: cores / N, at least 1),
# MAX_LOCAL_STEPS (gossiping peers' --max-local-steps, default 4: a peer that
# took 4 steps without an applied exchange holds training until one applies,
# which bounds the drift between replicas; 0: training never waits for the
# network; not given to --sync allreduce or ps, or when gossip is off:
# --gossip-every 0 and no --gossip-interval).
# A --batch or --max-local-steps among the peer options overrides ours.
# N is at most 256. Exit status: 0 when every peer finished, 1 otherwise
# (each failed peer's last log line is shown), 2 for a bad N or
# MAX_LOCAL_STEPS.
set -eu
cd "$(dirname "$0")/.."
n=${1:-4}
[ $# -gt 0 ] && shift
[ "${1:-}" = "--" ] && shift
case $n in ''|*[!0-9]*|0) echo "usage: $0 [N>0] [-- peer options]" >&2; exit 2;; esac
# Every peer is a process (and an identity) on this machine.
if [ "${#n}" -gt 3 ] || [ "$n" -gt 256 ]; then echo "$0: N is $n; at most 256 peers run on one machine" >&2; exit 2; fi
rumor=${RUMOR:-build/peer/rumor}
[ -x "$rumor" ] || { echo "$0: $rumor not found; run deploy/build.sh first" >&2; exit 1; }
work=${WORKDIR:-cluster-run}
epochs=${EPOCHS:-10}
# A run given --max-steps and no EPOCHS trains by steps (language models):
# no --epochs then, so the learning-rate schedule spans those steps.
epochs_flag="--epochs"
case " $* " in *" --max-steps "*|*" --max-steps="*) [ -z "${EPOCHS:-}" ] && epochs_flag="" ;; esac
cores=$(nproc)
threads=${THREADS:-$(( cores / n > 0 ? cores / n : 1 ))}
batch=${BATCH:-$(( 128 / n > 16 ? 128 / n : 16 ))}
bound=${MAX_LOCAL_STEPS:-4}
case $bound in
''|*[!0-9]*) echo "$0: MAX_LOCAL_STEPS must be a whole number of steps (0: no bound), not '$bound'" >&2; exit 2 ;;
esac
mkdir -p "$work"
rm -f "$work"/*.log "$work"/*.out

pids=""
cleanup() {
  for p in $pids; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
}
trap cleanup EXIT INT TERM

[ -f "$work/cluster.key" ] || "$rumor" keygen --cluster -o "$work/cluster.key" >/dev/null 2>&1
for i in $(seq 0 "$n"); do
  [ -f "$work/id$i.key" ] || "$rumor" keygen -o "$work/id$i.key" >/dev/null 2>&1
done

"$rumor" bootstrap --listen 127.0.0.1:0 --cluster-key "$work/cluster.key" --identity "$work/id0.key" \
  > "$work/bootstrap.out" 2> "$work/bootstrap.log" &
boot_pid=$!
pids="$boot_pid"
for _ in $(seq 1 100); do
  grep -q '"listen"' "$work/bootstrap.out" 2>/dev/null && break
  sleep 0.1
done
boot=$(sed -n 's/.*"listen":"\([^"]*\)".*/\1/p' "$work/bootstrap.out")
[ -n "$boot" ] || { echo "$0: the bootstrap node did not start; see $work/bootstrap.log" >&2; exit 1; }
# What the peers will be told, for the line below: a --batch, --max-steps or
# --max-local-steps among the peer options wins over ours (the last flag
# counts); the bound is only for gossip with exchanges on.
steps="" prev="" sync=gossip every="" interval="" outer=none
for a in "$@"; do
  case $prev in
  --batch) batch=$a ;; --max-steps) steps=$a ;; --sync) sync=$a ;; --gossip-every) every=$a ;;
  --gossip-interval) interval=$a ;; --max-local-steps) bound=$a ;; --outer) outer=$a ;;
  esac
  case $a in
  --batch=*) batch=${a#--batch=} ;; --max-steps=*) steps=${a#--max-steps=} ;; --sync=*) sync=${a#--sync=} ;;
  --gossip-every=*) every=${a#--gossip-every=} ;; --gossip-interval=*) interval=${a#--gossip-interval=} ;;
  --max-local-steps=*) bound=${a#--max-local-steps=} ;; --outer=*) outer=${a#--outer=} ;;
  esac
  prev=$a
done
# zero VALUE: true for 0, 00, 0.0 and the like
zero() { case $1 in *[!0.]*) return 1 ;; *) return 0 ;; esac; }
gossips=true
[ -n "$every" ] && zero "$every" && { [ -z "$interval" ] || zero "$interval"; } && gossips=false
bound_flag=""
# An outer optimizer (--outer) communicates once a round: no bound then.
[ "$sync" = gossip ] && [ "$outer" = none ] && $gossips && ! zero "$bound" && bound_flag="--max-local-steps"
span="$epochs epochs"
[ -z "$epochs_flag" ] && span="$steps steps"
how="batch $batch, $threads thread(s) each"
[ -n "$bound_flag" ] && how="$how, at most $bound steps between applied exchanges"
echo "bootstrap node on $boot; starting $n peers ($span each on 1/$n of the data, $how)"
echo "logs: $work/peer-<i>.log"

peer_pids=""
for i in $(seq 1 "$n"); do
  "$rumor" peer --bootstrap "$boot" --cluster-key "$work/cluster.key" --identity "$work/id$i.key" \
    --listen 127.0.0.1:0 --shard "$((i - 1))/$n" ${epochs_flag:+"$epochs_flag" "$epochs"} --batch "$batch" \
    --threads "$threads" ${bound_flag:+"$bound_flag" "$bound"} \
    --wait-peers "$n" --name "peer-$i" "$@" > "$work/peer-$i.out" 2> "$work/peer-$i.log" &
  peer_pids="$peer_pids $!"
  pids="$pids $!"
done

status=0
i=0
for p in $peer_pids; do
  i=$((i + 1))
  # The failure, as the peer's last log line says it (a bad option, a bad file).
  wait "$p" || { status=1; echo "peer-$i failed: $(tail -n 1 "$work/peer-$i.log" 2>/dev/null); see $work/peer-$i.log" >&2; }
done
kill "$boot_pid" 2>/dev/null || true

# A classifier reports test_accuracy; a language model val_loss (per token).
metric=test_accuracy
grep -q '"val_loss"' "$work"/peer-*.out 2>/dev/null && metric=val_loss
# mixes: how the peers mixed (gossip: exchanges applied; --sync allreduce:
# all-reduce rounds, one a step; --outer: outer rounds); per 100 steps: how
# often a step was followed by one.
mixes=exchanges label=exchanges
case $sync,$outer in
allreduce,none) mixes=allreduce_rounds label=rounds ;;
*,none) ;;
*) mixes=outer_rounds label="outer rounds" ;;
esac
printf '\n%-8s %-6s %14s %12s %13s %10s\n' peer shard "$metric" "$label" "per 100 steps" samples/s
i=0
for p in $peer_pids; do
  i=$((i + 1))
  line=$(grep "\"$metric\"" "$work/peer-$i.out" 2>/dev/null || true)
  num() { echo "$line" | sed -n "s/.*\"$1\":\([0-9.e+-]*\).*/\1/p"; }
  rate=$(echo "$(num $mixes) $(num steps)" | awk 'NF == 2 && $2 > 0 {printf "%.1f", 100 * $1 / $2}')
  sps=$(num samples_per_s | awk 'NF {printf "%.0f", $1}')
  printf '%-8s %-6s %14s %12s %13s %10s\n' "peer-$i" "$((i - 1))/$n" "$(num "$metric")" "$(num $mixes)" \
    "$rate" "$sps"
done
exit $status
