#!/bin/bash
# Soak: a cluster of 8 peers (and a bootstrap) on 127.0.0.1 trains for a long
# time while peers leave and join: every CHURN seconds one churning peer
# leaves (SIGTERM and SIGKILL in turn) or a new one joins. Four anchor peers
# and the bootstrap live through the whole run; every SAMPLE seconds their
# resident memory (VmRSS) and open file descriptors are recorded. Passes when
# nothing crashed, every anchor's RSS stays within 10 % of its value at the
# end of the warm-up (the first fifth of the run), and no anchor's
# descriptor count grows beyond its warm-up maximum (plus FD_SLACK for
# connections being dialled at the moment of a sample).
#
#   tests/scripts/soak.sh [--short] [--duration S] [--churn S] [--rumor BIN] [--keep DIR]
#
#   default   10 minutes, churn every 30 s (the issue's soak)
#   --short   60 s, churn every 10 s (the CI mode, registered with ctest)
#
# Under a sanitizer build (rumor linked with libasan, libtsan or libubsan) the
# RSS limit is reported but not enforced: ASan's quarantine of freed memory
# and shadow memory grow by design (about 40 % in the CI mode); crashes,
# sanitizer reports (LeakSanitizer's at exit included) and descriptors still
# fail the run.
#
# Prints a summary (figures for docs/reliability.md) and, with --keep, leaves
# the logs and samples (samples.csv: seconds, node, rss_kb, fds) in DIR.
# Exit 0: pass; 1: fail (the reason on stderr); 77: skip (no data set).
set -u
duration=600 churn=30 sample=5 rumor="" keep="" fd_slack=3
while [ $# -gt 0 ]; do
  case $1 in
    --short) duration=60 churn=10 sample=2; shift;;
    --duration) duration=$2; shift 2;;
    --churn) churn=$2; shift 2;;
    --rumor) rumor=$2; shift 2;;
    --keep) keep=$2; shift 2;;
    *) echo "usage: $0 [--short] [--duration S] [--churn S] [--rumor BIN] [--keep DIR]" >&2; exit 2;;
  esac
done
here=$(cd "$(dirname "$0")/../.." && pwd)
rumor=${rumor:-$here/build/peer/rumor}
data=${RUMOR_FMNIST_DIR:-/usr/share/datasets/fashion-mnist}
[ -x "$rumor" ] || { echo "soak: $rumor not found (build first, or --rumor BIN)" >&2; exit 1; }
[ -e "$data/train-images-idx3-ubyte.gz" ] || { echo "soak: no Fashion-MNIST at $data; skipping" >&2; exit 77; }
warmup=$((duration / 5))
sanitized=0
ldd "$rumor" 2>/dev/null | grep -qE 'libasan|libtsan|libubsan' && sanitized=1

work=$(mktemp -d /tmp/rumor-soak-XXXXXX)
pids=() names=()
finish() {
  for p in "${pids[@]}"; do [ -n "$p" ] && kill "$p" 2>/dev/null; done
  sleep 1
  for p in "${pids[@]}"; do [ -n "$p" ] && kill -9 "$p" 2>/dev/null; done
  wait 2>/dev/null
  if [ -n "$keep" ]; then
    mkdir -p "$keep" && cp -r "$work"/. "$keep"/ && echo "soak: logs and samples in $keep"
  fi
  rm -rf "$work"
}
trap finish EXIT
trap 'exit 130' INT TERM

fail() { echo "soak: FAIL: $*" >&2; exit 1; }

T=(--period-ms 200 --ping-timeout-ms 100 --suspect-ms 2000)
"$rumor" keygen --cluster -o "$work/cluster.key" >/dev/null 2>&1 || fail "keygen"
"$rumor" keygen -o "$work/boot.key" >/dev/null 2>&1
nice -n 10 "$rumor" bootstrap --listen 127.0.0.1:0 --cluster-key "$work/cluster.key" --identity "$work/boot.key" \
  "${T[@]}" > "$work/boot.out" 2> "$work/boot.log" &
boot_pid=$!
pids+=("$boot_pid") names+=(boot)
for _ in $(seq 100); do grep -q '"listen"' "$work/boot.out" 2>/dev/null && break; sleep 0.1; done
boot=$(sed -n 's/.*"listen":"\([^"]*\)".*/\1/p' "$work/boot.out")
[ -n "$boot" ] || fail "the bootstrap did not start: $(cat "$work/boot.log")"

# start_peer NAME SHARD: a peer that trains until told to stop.
start_peer() {
  "$rumor" keygen -o "$work/$1.key" >/dev/null 2>&1
  nice -n 10 "$rumor" peer --bootstrap "$boot" --cluster-key "$work/cluster.key" --identity "$work/$1.key" \
    --listen 127.0.0.1:0 "${T[@]}" --name "$1" --threads 1 --model mlp:784-64-10 --shard "$2" --epochs 1000000 \
    --batch 64 --lr 0.05 --no-eval --log-every 10 --gossip-every 4 > "$work/$1.out" 2> "$work/$1.log" &
  pids+=($!) names+=("$1")
}
pid_of() { for i in "${!names[@]}"; do [ "${names[$i]}" = "$1" ] && echo "${pids[$i]}"; done; }
forget() { for i in "${!names[@]}"; do [ "${names[$i]}" = "$1" ] && pids[$i]="" names[$i]=""; done; }

anchors=(a1 a2 a3 a4)
for i in 0 1 2 3; do start_peer "${anchors[$i]}" "$i/8"; done
churners=() serial=0
for i in 4 5 6 7; do serial=$((serial + 1)); start_peer "c$serial" "$i/8"; churners+=("c$serial"); done

echo "soak: 8 peers on $boot for ${duration} s, churn every ${churn} s, warm-up ${warmup} s; work dir $work"
echo "t,node,rss_kb,fds" > "$work/samples.csv"
start=$(date +%s)
next_churn=$churn leave_next=1 kill_next=0 events=0
while :; do
  now=$(( $(date +%s) - start ))
  [ "$now" -ge "$duration" ] && break
  for n in boot "${anchors[@]}"; do
    p=$(pid_of "$n")
    [ -d "/proc/$p" ] || fail "$n (pid $p) died: $(tail -5 "$work/$n.log")"
    rss=$(awk '/^VmRSS/ {print $2}' "/proc/$p/status")
    fds=$(ls "/proc/$p/fd" 2>/dev/null | wc -l)
    echo "$now,$n,$rss,$fds" >> "$work/samples.csv"
  done
  if [ "$now" -ge "$next_churn" ]; then
    next_churn=$((next_churn + churn))
    events=$((events + 1))
    if [ "$leave_next" = 1 ] && [ ${#churners[@]} -gt 0 ]; then
      victim=${churners[0]}
      churners=("${churners[@]:1}")
      vp=$(pid_of "$victim")
      if [ "$kill_next" = 1 ]; then sig=KILL; else sig=TERM; fi
      kill -s $sig "$vp"
      wait "$vp" 2>/dev/null
      st=$?
      if [ $sig = TERM ] && [ $st -ne 0 ]; then fail "$victim did not leave cleanly on SIGTERM (status $st)"; fi
      echo "soak: t=${now}s $victim left (SIG$sig)"
      forget "$victim"
      kill_next=$((1 - kill_next))
    else
      serial=$((serial + 1))
      start_peer "c$serial" "$(( (serial - 1) % 4 + 4 ))/8"
      churners+=("c$serial")
      echo "soak: t=${now}s c$serial joined"
    fi
    leave_next=$((1 - leave_next))
  fi
  # Every churning peer still running must be alive (no crash).
  for n in "${churners[@]}"; do
    p=$(pid_of "$n")
    [ -d "/proc/$p" ] || fail "$n (pid $p) died: $(tail -5 "$work/$n.log")"
  done
  sleep "$sample"
done

# Clean shutdown: everyone leaves on SIGTERM with status 0.
for n in "${anchors[@]}" "${churners[@]}" boot; do
  p=$(pid_of "$n")
  kill -TERM "$p" 2>/dev/null
  wait "$p"
  st=$?
  [ $st -eq 0 ] || fail "$n exited with status $st on SIGTERM: $(tail -5 "$work/$n.log")"
  forget "$n"
done
if grep -l "AddressSanitizer\|runtime error:\|ThreadSanitizer\|LeakSanitizer" "$work"/*.log >/dev/null 2>&1; then
  fail "sanitizer reports: $(grep -l "AddressSanitizer\|runtime error:\|ThreadSanitizer\|LeakSanitizer" "$work"/*.log)"
fi

# Memory and descriptors of the anchors and the bootstrap.
verdict=0
echo "soak: $events churn events; after the ${warmup} s warm-up:"
printf "  %-5s %12s %12s %8s %10s %10s\n" node "rss@warmup" "rss max" growth "fds warmup" "fds after"
for n in boot "${anchors[@]}"; do
  line=$(awk -F, -v n="$n" -v w="$warmup" '
    $2 == n && $1 <= w { base = $3; if ($4 > fdw) fdw = $4 }
    $2 == n && $1 > w  { if ($3 > rmax) rmax = $3; if ($4 > fda) fda = $4 }
    END { printf "%d %d %d %d", base, rmax, fdw, fda }' "$work/samples.csv")
  set -- $line
  base=$1 rmax=$2 fdw=$3 fda=$4
  growth=$(awk -v b="$base" -v m="$rmax" 'BEGIN { printf "%.1f", b ? 100 * (m - b) / b : 0 }')
  printf "  %-5s %10s kB %10s kB %7s%% %10s %10s\n" "$n" "$base" "$rmax" "$growth" "$fdw" "$fda"
  if awk -v g="$growth" 'BEGIN { exit !(g > 10) }'; then
    if [ $sanitized = 1 ]; then
      echo "soak: $n's RSS grew by $growth % after the warm-up (not judged: a sanitizer build)" >&2
    else
      echo "soak: $n's RSS grew by $growth % after the warm-up" >&2
      verdict=1
    fi
  fi
  if [ "$fda" -gt $((fdw + fd_slack)) ]; then
    echo "soak: $n's descriptors grew from at most $fdw to $fda" >&2
    verdict=1
  fi
done
[ $verdict = 0 ] || fail "memory or descriptors grew"
echo "soak: PASS"
