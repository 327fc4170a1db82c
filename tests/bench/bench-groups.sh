#!/bin/sh
# Groups that average with other groups (issue #31, "Between groups"):
# two groups of one layout (default: --data-parallel 2 --zero 1; LAYOUT
# changes it), each on its own half of the text (--shard g/2), trained side
# by side on loopback, against one group alone on its half, in the same run:
#
#   alone    one group, shard 0/2
#   gossip   two groups, process k averaging its piece with process k of the
#            other group every step (--finish-wait-ms: both end together)
#   allreduce two groups, --sync allreduce: process k's piece of every
#            step's gradient averaged with process k's of the other group
#   diloco   two groups, --sync allreduce --outer nesterov --local-steps H:
#            an outer round of each piece every H steps
#   overlap  the same with --outer-overlap: each round lands a round later
#            while the processes train on (not in the default ROWS)
#   peers    the reference for diloco: two `rumor peer`s (whole replicas,
#            one process each) running the same DiLoCo on the same shards;
#            a group's steps equal one process's, so the two rows should
#            end at the same loss
#
# For each: the validation loss of group 0 (DiLoCo's groups end equal), and
# the bytes between groups per step and process (the result lines'
# bytes_out + bytes_in of the processes' gossip runtimes over their steps,
# the traffic inside a group not counted), beside the ratio to gossip's.
#
#   tests/bench/bench-groups.sh [BUILD_DIR]
#
# Environment: MODEL (default gpt:L2-H2-C64-T64-V256), LAYOUT, BATCH (8),
# STEPS (600), H (50), OUTER (more options for the diloco row, e.g.
# "--outer-lr 0.7"), DATA (a text file, default the KJV corpus of
# deploy/install-deps.sh), ROWS (default "alone gossip allreduce diloco
# peers").
#
# Each process runs one thread; two groups of two processes share the
# machine's cores (on the 2-core machine this was written on, four
# processes on two cores: the figures are loss and bytes, not speed).
set -eu
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
build=${1:-$root/build}
rumor=$build/peer/rumor
MODEL=${MODEL:-gpt:L2-H2-C64-T64-V256}
LAYOUT=${LAYOUT:---data-parallel 2 --zero 1}
BATCH=${BATCH:-8}
STEPS=${STEPS:-600}
H=${H:-50}
DATA=${DATA:-/usr/local/share/rumor/kjv.txt}
ROWS=${ROWS:-alone gossip allreduce diloco peers}
OUTER=${OUTER:-}
[ -x "$rumor" ] || { echo "bench-groups.sh: build rumor first (no $rumor)" >&2; exit 1; }
[ -f "$DATA" ] || { echo "bench-groups.sh: no corpus at $DATA (set DATA)" >&2; exit 1; }
tmp=$(mktemp -d)
pids=""
cleanup() {
  for p in $pids; do kill "$p" 2>/dev/null || true; done
  rm -rf "$tmp"
}
trap cleanup EXIT
"$rumor" keygen --cluster -o "$tmp/c.key" >/dev/null 2>&1
for g in 0 1; do "$rumor" keygen -o "$tmp/id$g.key" >/dev/null 2>&1; done

field() { printf '%s\n' "$1" | sed -n "s/.*\"$2\":\([-+0-9.e]*\).*/\1/p" | head -n 1; }

# group G OUT EXTRA...: starts group G (shard G/2) in the background.
group() {
  g=$1 out=$2
  shift 2
  # shellcheck disable=SC2086 # LAYOUT is a list of options
  "$rumor" group $LAYOUT --model "$MODEL" --data "$DATA" --batch "$BATCH" --max-steps "$STEPS" --shard "$g/2" \
    --seed 1 --threads 1 --log-every 0 --eval-batches 20 --cluster-key "$tmp/c.key" --identity "$tmp/id$g.key" \
    --group "g$g" --listen 127.0.0.1:0 "$@" >"$out" 2>"$out.log" &
  pids="$pids $!"
}

# peer G OUT EXTRA...: a whole-replica peer on shard G/2 with the diloco
# row's settings, in the background.
peer() {
  g=$1 out=$2
  shift 2
  # shellcheck disable=SC2086 # OUTER is a list of options
  "$rumor" peer --model "$MODEL" --data "$DATA" --batch "$BATCH" --max-steps "$STEPS" --shard "$g/2" --seed 1 \
    --threads 1 --log-every 0 --eval-batches 20 --cluster-key "$tmp/c.key" --identity "$tmp/id$g.key" \
    --listen 127.0.0.1:0 --wait-peers 2 --sync allreduce --outer nesterov --local-steps "$H" $OUTER "$@" \
    >"$out" 2>"$out.log" &
  pids="$pids $!"
}

# The gossip addresses the processes writing FILE announced with "role"
# ROLE, in member order, as "A0;A1;..." once there are N of them.
announced() {
  n=0
  while [ "$n" -lt 600 ]; do
    if [ "$2" = shard ]; then # a group's processes, by "member" (inside stages: role "stage")
      list=$(grep -E '"role":"(shard|stage)"' "$1" 2>/dev/null | grep '"member":' |
        sed -n 's/.*"listen":"\([^"]*\)".*"member":\([0-9]*\).*/\2 \1/p' | sort -n | awk '{print $2}' | paste -sd';')
    else
      list=$(grep "\"role\":\"$2\"" "$1" 2>/dev/null | sed -n 's/.*"listen":"\([^"]*\)".*/\1/p' | paste -sd';')
    fi
    k=$(printf '%s' "$list" | tr ';' '\n' | grep -c . || true)
    [ "$k" -ge "$3" ] && { printf '%s\n' "$list"; return 0; }
    sleep 0.1
    n=$((n + 1))
  done
  echo "bench-groups.sh: $1 announced no addresses: $(cat "$1.log")" >&2
  exit 1
}

# The processes of a group of LAYOUT: the product of its -parallel counts.
procs=1
# shellcheck disable=SC2086 # LAYOUT is a list of options
set -- $LAYOUT
while [ $# -gt 0 ]; do
  case $1 in --data-parallel | --tensor-parallel | --stages) procs=$((procs * $2)) ;; esac
  shift
done

# The bytes between groups per step and process: the processes' result
# lines' bytes_out + bytes_in over their steps, averaged over processes.
bytes_per_step() {
  grep '"member":' "$1" | grep '"steps":' | while read -r line; do
    echo "$(field "$line" bytes_out) $(field "$line" bytes_in) $(field "$line" steps)"
  done | awk '{s += ($1 + $2) / $3; n++} END {if (n) printf "%.0f", s / n; else printf "0"}'
}

run_row() {
  row=$1
  a=$tmp/$row.a b=$tmp/$row.b
  case $row in
  alone) group 0 "$a" ;;
  gossip)
    group 0 "$a" --wait-peers 2 --finish-wait-ms 60000
    group 1 "$b" --wait-peers 2 --finish-wait-ms 60000 --bootstrap "$(announced "$a" shard "$procs")"
    ;;
  allreduce)
    group 0 "$a" --wait-peers 2 --sync allreduce
    group 1 "$b" --wait-peers 2 --sync allreduce --bootstrap "$(announced "$a" shard "$procs")"
    ;;
  diloco | overlap)
    more=$OUTER
    [ "$row" = overlap ] && more="$OUTER --outer-overlap"
    # shellcheck disable=SC2086 # OUTER is a list of options
    group 0 "$a" --wait-peers 2 --sync allreduce --outer nesterov --local-steps "$H" $more
    # shellcheck disable=SC2086
    group 1 "$b" --wait-peers 2 --sync allreduce --outer nesterov --local-steps "$H" $more --bootstrap "$(announced "$a" shard "$procs")"
    ;;
  peers)
    peer 0 "$a"
    peer 1 "$b" --bootstrap "$(announced "$a" peer 1)"
    ;;
  *) echo "bench-groups.sh: unknown row $row" >&2; exit 2 ;;
  esac
  for p in $pids; do wait "$p" || { echo "bench-groups.sh: a group of row $row failed: $(tail -5 "$a.log")" >&2; exit 1; }; done
  pids=""
  if [ "$row" = peers ]; then
    summary=$(grep '"steps":' "$a" | tail -n 1)
    eval "bytes_$row=$(echo "$(field "$summary" bytes_out) $(field "$summary" bytes_in) $(field "$summary" steps)" |
      awk '{printf "%.0f", ($1 + $2) / $3}')"
  else
    summary=$(grep '"status":"ok"' "$a" | tail -n 1)
  fi
  eval "loss_$row=$(field "$summary" val_loss)"
  case $row in
  alone) eval "bytes_$row=0" ;;
  gossip | allreduce | diloco | overlap) eval "bytes_$row=$(bytes_per_step "$a")" ;;
  esac
}

echo "bench-groups: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ *//'), $(nproc) cores," \
  "$MODEL, layout '$LAYOUT', batch $BATCH, $STEPS steps, H=$H, ${OUTER:+$OUTER, }$(date +%F)"
for row in $ROWS; do run_row "$row"; done
printf '%-9s %10s %22s %10s\n' row val_loss "bytes/step/process" "vs gossip"
for row in $ROWS; do
  l=$(eval "echo \"\$loss_$row\"")
  by=$(eval "echo \"\$bytes_$row\"")
  ratio=-
  if [ "$row" = gossip ]; then
    ratio=1
  elif [ "$row" != alone ] && [ -n "${bytes_gossip:-}" ] && [ "$by" -gt 0 ]; then
    ratio=$(awk -v g="$bytes_gossip" -v b="$by" 'BEGIN {if (b > g) printf "%.1fx more", b / g; else printf "%.1fx fewer", g / b}')
  fi
  printf '%-9s %10s %22s %10s\n' "$row" "$l" "$by" "$ratio"
done
if [ -n "${loss_diloco:-}" ] && [ -n "${loss_peers:-}" ]; then
  awk -v g="$loss_diloco" -v p="$loss_peers" 'BEGIN {
    d = g - p; if (d < 0) d = -d
    printf "groups against whole peers, same DiLoCo: %.2g apart (within 1e-3: %s)\n", d, d <= 1e-3 ? "PASS" : "MISS" }'
fi
