#!/bin/bash
# Runs the Kubernetes wiring of deploy/k8s on this machine, without
# Kubernetes: each "pod" is deploy/rumor-launch with the environment its
# manifest gives it (POD_NAME, POD_IP, RUMOR_*), its own loopback address
# (127.X.Y.Z, all on lo) standing for a pod IP, and the keys from
# deploy/k8s/make-secrets.sh --allow-list, group-readable as a secret volume
# with fsGroup shows them.
#
#   tests/scripts/launch_cluster.sh RUMOR_BIN SOURCE_DIR [FMNIST_DIR]
#
# Checks: the keys step copies keys to mode 0600 and refuses a pod without
# an identity in allow-list mode; a bad RUMOR_SHARDS is refused;
# bootstrap-0 starts the cluster and
# bootstrap-1 joins it through discovery; /healthz turns 200; a peer stopped
# with SIGTERM saves its checkpoint and leaves, and its restart resumes
# from it; both peers finish (test accuracy >= 0.80 after 2 epochs on half
# the data each) and then wait (RUMOR_DONE=wait), also when started again,
# and stop on SIGTERM; an identity not on the allow-list cannot join; a
# bootstrap node stopped with SIGTERM is seen to leave, and on restart joins
# the running cluster again. About 30 s.
#
# Exit status: 0 pass, 1 fail, 77 skip (no Fashion-MNIST).
set -u
rumor=${1:?usage: $0 RUMOR_BIN SOURCE_DIR [FMNIST_DIR]}
src=${2:?usage: $0 RUMOR_BIN SOURCE_DIR [FMNIST_DIR]}
data=${3:-/usr/share/datasets/fashion-mnist}
launch=$src/deploy/rumor-launch

fail() { echo "FAIL: $*"; dump; exit 1; }
say() { echo "launch_cluster: $*"; }
ls "$data"/train-images-idx3-ubyte* >/dev/null 2>&1 || { echo "SKIP: no Fashion-MNIST in $data"; exit 77; }
rumor=$(readlink -f "$rumor")
command -v curl >/dev/null || { echo "SKIP: no curl"; exit 77; }

T=$(mktemp -d /tmp/rumor-launch.XXXXXX) || exit 1
pids=""
pid_b1="" pid_p0="" pid_p1=""
cleanup() {
  for p in $pids; do kill -TERM -- "-$p" 2>/dev/null; done
  sleep 0.5
  for p in $pids; do kill -KILL -- "-$p" 2>/dev/null; wait "$p" 2>/dev/null; done
  rm -rf "$T"
}
trap cleanup EXIT
trap 'exit 1' INT TERM HUP
dump() {
  for f in "$T"/*.log; do
    [ -f "$f" ] || continue
    echo "--- last lines of ${f##*/}"
    tail -n 12 "$f"
  done
}

# Addresses: a random 127.X.Y.0/24 for this run, the same ports in every pod.
net=127.$((RANDOM % 200 + 20)).$((RANDOM % 250 + 1))
ip_b0=$net.10 ip_b1=$net.11 ip_p0=$net.20 ip_p1=$net.21 ip_x=$net.30
bp=$((20000 + RANDOM % 20000)) pp=$((bp + 1)) mp=$((bp + 2))

# Keys: as the Secrets give them (allow-list mode: 2 bootstrap nodes, 2 peers).
RUMOR=$rumor "$src/deploy/k8s/make-secrets.sh" --allow-list 2 2 "$T/keydir" >/dev/null || fail "make-secrets.sh"
mkdir -p "$T/secret"
cp "$T/keydir"/cluster.key "$T/keydir"/allow-list "$T/keydir"/*-[0-9].key "$T/secret/"
chmod 0440 "$T/secret"/*

# pod NAME POD_NAME IP ROLE [VAR=VALUE...]: runs the keys step, then the node
# in the background, in its own process group; its PID goes to pid_NAME.
pod() {
  local name=$1 pod_name=$2 ip=$3 role=$4
  shift 4
  env RUMOR="$rumor" RUMOR_KEYS="$T/$name" POD_NAME="$pod_name" \
    "$launch" keys "$role" "$T/secret" 2>>"$T/$name.log" || return 1
  setsid env RUMOR="$rumor" RUMOR_KEYS="$T/$name" POD_NAME="$pod_name" POD_IP="$ip" \
    RUMOR_METRICS="$ip:$mp" "$@" "$launch" "$role" >>"$T/$name.out" 2>>"$T/$name.log" &
  eval "pid_$name=$!"
  pids="$pids $!"
}
healthz() { curl -s -o /dev/null -w '%{http_code}' --max-time 2 "http://$1:$mp/healthz"; }
wait_for() { # SECONDS DESCRIPTION COMMAND...: until COMMAND succeeds
  local n=$(($1 * 5)) what=$2
  shift 2
  for _ in $(seq 1 "$n"); do "$@" && return 0; sleep 0.2; done
  fail "$what (after ${n}/5 s)"
}
is_ready() { [ "$(healthz "$1")" = 200 ]; }
has() { grep -q -- "$2" "$T/$1" 2>/dev/null; }
gone() { ! kill -0 "$1" 2>/dev/null; }

# --- keys ---------------------------------------------------------------------
env RUMOR="$rumor" RUMOR_KEYS="$T/k-check" POD_NAME=rumor-peer-1 "$launch" keys peer "$T/secret" 2>/dev/null ||
  fail "the keys step failed"
[ "$(stat -c %a "$T/k-check/cluster.key") $(stat -c %a "$T/k-check/peer-1.key")" = "600 600" ] ||
  fail "the keys step did not leave mode 0600 keys"
cmp -s "$T/k-check/peer-1.key" "$T/keydir/peer-1.key" || fail "the keys step did not copy peer-1.key"
if env RUMOR="$rumor" RUMOR_KEYS="$T/k-none" POD_NAME=rumor-peer-7 "$launch" keys peer "$T/secret" 2>"$T/k-none.err"; then
  fail "the keys step made an identity that the allow-list cannot hold"
fi
say "keys step: mode 0600 copies; refuses a pod with no listed identity ($(cut -c1-80 "$T/k-none.err"))"
# A RUMOR_SHARDS that is not a number of shards: exit 2 naming it (it was a
# shell arithmetic error, or a division by zero).
for bad in abc 0 999999; do
  env RUMOR="$rumor" RUMOR_KEYS="$T/k-check" POD_NAME=rumor-peer-1 RUMOR_SHARDS=$bad RUMOR_BOOTSTRAP=127.0.0.1:1 \
    "$launch" peer >/dev/null 2>"$T/shards.err"
  st=$?
  if [ "$st" != 2 ] || ! grep -q "RUMOR_SHARDS must be a number of shards from 1 to 65536, not '$bad'" "$T/shards.err"; then
    fail "RUMOR_SHARDS=$bad: exit $st: $(cat "$T/shards.err")"
  fi
done
say "a bad RUMOR_SHARDS is refused naming it"

# --- bootstrap nodes ------------------------------------------------------------
boot_list=$ip_b0:$bp,$ip_b1:$bp
pod b0 rumor-bootstrap-0 "$ip_b0" bootstrap RUMOR_LISTEN="$ip_b0:$bp" RUMOR_DISCOVER= || fail "keys for b0"
wait_for 10 "bootstrap-0 ready" is_ready "$ip_b0"
# What the headless Service would answer now: bootstrap-0 (ready) and itself.
pod b1 rumor-bootstrap-1 "$ip_b1" bootstrap RUMOR_LISTEN="$ip_b1:$bp" RUMOR_DISCOVER="$ip_b0:$bp,$ip_b1:$bp" ||
  fail "keys for b1"
wait_for 10 "bootstrap-1 ready" is_ready "$ip_b1"
has b1.log "joined through $ip_b0:$bp" || fail "bootstrap-1 did not join through bootstrap-0"
say "bootstrap-0 started the cluster, bootstrap-1 joined it through discovery; both ready"

# --- peers ----------------------------------------------------------------------
# --finish-wait-ms: peer-0 trains on while peer-1 is stopped and restarted,
# so it finishes first; without it, it would leave with a replica it had
# been averaging with peer-1's older one (test_peer_poison's start()).
peer_env=(RUMOR_BOOTSTRAP="$boot_list" RUMOR_SHARDS=2 RUMOR_CHECKPOINT_DIR="$T/ck" RUMOR_DONE=wait
  RUMOR_DATA="$data"
  RUMOR_OPTS="--epochs 2 --batch 32 --lr 0.05 --threads 1 --log-every 0 --wait-peers 2 --finish-wait-ms 60000")
pod p0 rumor-peer-0 "$ip_p0" peer RUMOR_LISTEN="$ip_p0:$pp" "${peer_env[@]}" || fail "keys for p0"
pod p1 rumor-peer-1 "$ip_p1" peer RUMOR_LISTEN="$ip_p1:$pp" "${peer_env[@]}" || fail "keys for p1"
wait_for 30 "peer-1 ready" is_ready "$ip_p1"
# Stopped as soon as it trains: a fixed sleep raced the whole run on a fast
# machine (2 epochs take about 3 s here).
wait_for 30 "peer-1 training" has p1.log "first step: loss"
kill -TERM "$pid_p1"
wait_for 20 "peer-1 stopped by SIGTERM" gone "$pid_p1"
wait "$pid_p1"
rc=$?
[ "$rc" -eq 0 ] || fail "peer-1 exited with status $rc after SIGTERM"
has p1.log "signal 15: leaving the cluster" || fail "peer-1 did not leave on SIGTERM"
[ -f "$T/ck/peer-1.safetensors" ] || fail "peer-1 saved no checkpoint on SIGTERM"
[ ! -f "$T/ck/peer-1.done" ] || fail "peer-1 was marked done although it was stopped"
say "peer-1 stopped by SIGTERM: checkpoint saved, left the cluster"
pod p1 rumor-peer-1 "$ip_p1" peer RUMOR_LISTEN="$ip_p1:$pp" "${peer_env[@]}" || fail "keys for p1 (again)"
wait_for 10 "peer-1 restarted from its checkpoint" has p1.log "--resume $T/ck/peer-1.safetensors"
for p in p0 p1; do
  wait_for 120 "$p finished and waiting" has "$p.log" "finished its run; waiting"
done
for r in 0 1; do
  acc=$(sed -n 's/.*"test_accuracy":\([0-9.]*\).*/\1/p' "$T/p$r.out" | tail -n 1)
  [ -n "$acc" ] || fail "peer-$r printed no result"
  awk -v a="$acc" 'BEGIN { exit !(a >= 0.80) }' || fail "peer-$r: test accuracy $acc < 0.80"
  [ -f "$T/ck/peer-$r.done" ] || fail "peer-$r wrote no done marker"
  say "peer-$r: test accuracy $acc, done"
done
for p in p0 p1; do
  pid=pid_$p
  kill -0 "${!pid}" 2>/dev/null || fail "$p did not wait after its run (RUMOR_DONE=wait)"
  kill -TERM "${!pid}"
  wait_for 5 "$p stopped while waiting" gone "${!pid}"
done
pod p0 rumor-peer-0 "$ip_p0" peer RUMOR_LISTEN="$ip_p0:$pp" "${peer_env[@]}" || fail "keys for p0 (again)"
wait_for 10 "peer-0 restarted after its run waits" has p0.log "finished its run earlier"
kill -TERM "$pid_p0"
wait_for 5 "peer-0 stopped while waiting (again)" gone "$pid_p0"
say "finished peers wait, also when started again, and stop on SIGTERM"

# --- an identity not on the allow-list -------------------------------------------
mkdir -p "$T/x"
(umask 077 && cp "$T/keydir/cluster.key" "$T/keydir/allow-list" "$T/x/")
"$rumor" keygen -o "$T/x/peer-9.key" >/dev/null 2>&1
if env RUMOR="$rumor" RUMOR_KEYS="$T/x" POD_NAME=rumor-peer-9 POD_IP="$ip_x" RUMOR_LISTEN="$ip_x:$pp" \
  RUMOR_BOOTSTRAP="$boot_list" RUMOR_DATA="$data" RUMOR_OPTS="--epochs 1 --join-timeout-ms 3000" \
  timeout 30 "$launch" peer >"$T/x.out" 2>"$T/x.log"; then
  fail "a peer whose key is not on the allow-list joined"
fi
grep -q test_accuracy "$T/x.out" && fail "a peer whose key is not on the allow-list trained"
cat "$T/b0.log" "$T/b1.log" | grep -q "is not on the allow-list" ||
  fail "no bootstrap node logged refusing the unlisted key"
say "a key not on the allow-list is not admitted: $(grep -m1 -o 'could not join.*' "$T/x.log" | cut -c1-60)..."

# --- a bootstrap node leaves and comes back ---------------------------------------
kill -TERM "$pid_b1"
wait_for 10 "bootstrap-1 stopped by SIGTERM" gone "$pid_b1"
has b1.log "stopping (signal 15)" || fail "bootstrap-1 did not stop on SIGTERM"
wait_for 10 "bootstrap-0 saw bootstrap-1 leave" has b0.log "is now left"
: >"$T/b1.log"
pod b1 rumor-bootstrap-1 "$ip_b1" bootstrap RUMOR_LISTEN="$ip_b1:$bp" RUMOR_DISCOVER="$ip_b0:$bp" || fail "keys for b1 (again)"
wait_for 10 "bootstrap-1 ready again" is_ready "$ip_b1"
has b1.log "joined through $ip_b0:$bp" || fail "bootstrap-1 did not rejoin through bootstrap-0"
has b1.log "keeping identity" || fail "bootstrap-1 did not keep its identity across the restart"
say "bootstrap-1 left on SIGTERM and rejoined the running cluster with the same identity"
say "PASS"
