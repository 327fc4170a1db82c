#!/bin/bash
# Checks deploy/systemd without running systemd (no service is installed on
# this machine; everything happens under a temporary directory):
#
#   tests/scripts/systemd_units.sh RUMOR_BIN SOURCE_DIR [FMNIST_DIR]
#
# 1. deploy/systemd/install.sh with DESTDIR installs the files, modes and
#    directories the units expect;
# 2. `systemd-analyze verify` accepts both units (any warning fails);
# 3. `systemd-analyze security --offline=yes` rates both at most 2.5
#    ("OK"; 0 is the most locked down, 10 the least);
# 4. the units' own Environment=, EnvironmentFile= (the shipped rumor.env,
#    edited as an operator would) and ExecStart= lines, applied by this
#    script as systemd would apply them, start a bootstrap node and two peer
#    instances that train to the end; SIGTERM (KillSignal) makes the bootstrap
#    node leave. Without the sandbox, which needs systemd itself.
#
# Exit status: 0 pass, 1 fail, 77 skip (no systemd-analyze).
set -u
rumor=${1:?usage: $0 RUMOR_BIN SOURCE_DIR [FMNIST_DIR]}
src=${2:?usage: $0 RUMOR_BIN SOURCE_DIR [FMNIST_DIR]}
data=${3:-/usr/share/datasets/fashion-mnist}
max_exposure=25 # tenths: 2.5

say() { echo "systemd_units: $*"; }
command -v systemd-analyze >/dev/null || { echo "SKIP: no systemd-analyze (apt-get install systemd)"; exit 77; }
rumor=$(readlink -f "$rumor")
src=$(readlink -f "$src")
T=$(mktemp -d /tmp/rumor-systemd.XXXXXX) || exit 1
pids=""
cleanup() {
  for p in $pids; do kill -TERM "$p" 2>/dev/null; done
  for p in $pids; do wait "$p" 2>/dev/null; done
  rm -rf "$T"
}
trap cleanup EXIT
trap 'exit 1' INT TERM HUP
fail() {
  echo "FAIL: $*"
  for f in "$T"/*.log; do [ -f "$f" ] && { echo "--- ${f##*/}"; tail -n 10 "$f"; }; done
  exit 1
}

# --- 1. install ---------------------------------------------------------------
root=$T/root
mkdir -p "$T/build/peer" && cp "$rumor" "$T/build/peer/rumor"
DESTDIR=$root "$src/deploy/systemd/install.sh" "$T/build" >"$T/install.out" 2>&1 || fail "install.sh: $(cat "$T/install.out")"
for f in usr/local/bin/rumor usr/local/lib/rumor/rumor-launch etc/systemd/system/rumor-bootstrap.service \
  etc/systemd/system/rumor-peer@.service etc/rumor/rumor.env usr/local/share/doc/rumor/operating.md; do
  [ -f "$root/$f" ] || fail "install.sh did not install /$f"
done
[ "$(stat -c %a "$root/etc/rumor")" = 700 ] || fail "/etc/rumor is not mode 0700"
[ "$(stat -c %a "$root/etc/rumor/rumor.env")" = 600 ] || fail "/etc/rumor/rumor.env is not mode 0600"
say "install.sh: files in place, /etc/rumor 0700"

# --- 2. verify, 3. security ------------------------------------------------------
# The units as installed, with their programs' paths under $root (verify
# checks that ExecStart= names an executable).
mkdir -p "$T/units"
for u in rumor-bootstrap.service rumor-peer@.service; do
  sed -e "s|/usr/local/lib/rumor/|$root/usr/local/lib/rumor/|g" "$root/etc/systemd/system/$u" >"$T/units/$u"
done
ln -s 'rumor-peer@.service' "$T/units/rumor-peer@0.service"
units=("$T/units/rumor-bootstrap.service" "$T/units/rumor-peer@0.service")
out=$(systemd-analyze verify "${units[@]}" 2>&1)
rc=$?
if [ "$rc" -ne 0 ] || [ -n "$out" ]; then fail "systemd-analyze verify (status $rc): $out"; fi
say "systemd-analyze verify: both units clean"
for u in "${units[@]}"; do
  line=$(systemd-analyze security --offline=yes "$u" 2>&1 | grep -a "Overall exposure level" | LC_ALL=C tr -cd "[:print:]")
  systemd-analyze security --offline=yes --threshold=$max_exposure "$u" >/dev/null 2>&1 ||
    fail "${u##*/}: exposure above $((max_exposure / 10)).$((max_exposure % 10)): $line"
  say "${u##*/}: ${line#*: }"
done

# --- 4. the units' command lines, run ---------------------------------------------
ls "$data"/train-images-idx3-ubyte* >/dev/null 2>&1 || { say "no Fashion-MNIST in $data: not running the services"; exit 0; }
command -v curl >/dev/null || { say "no curl: not running the services"; exit 0; }
etc=$root/etc/rumor
state=$T/state
ip=127.$((RANDOM % 200 + 20)).$((RANDOM % 250 + 1)).$((RANDOM % 250 + 1))
bp=$((20000 + RANDOM % 20000))
"$rumor" keygen --cluster -o "$etc/cluster.key" >/dev/null 2>&1
for k in bootstrap peer-0 peer-1; do "$rumor" keygen -o "$etc/$k.key" >/dev/null 2>&1; done
# rumor.env as an operator edits it; one port per node through the
# per-instance files (the defaults, 7470 and 7471+N on 0.0.0.0, could be in
# use on a shared test machine).
sed -i -e "s|^RUMOR_HOST=.*|RUMOR_HOST=$ip|" -e "s|^RUMOR_BOOTSTRAP=.*|RUMOR_BOOTSTRAP=$ip:$bp|" \
  -e "s|^RUMOR_METRICS_HOST=.*|RUMOR_METRICS_HOST=$ip|" -e "s|^RUMOR_SHARDS=.*|RUMOR_SHARDS=2|" \
  -e "s|^RUMOR_DATA=.*|RUMOR_DATA=$data|" \
  -e "s|^RUMOR_PEER_OPTS=.*|RUMOR_PEER_OPTS=--epochs 1 --batch 64 --lr 0.1 --threads 1 --log-every 0 --wait-peers 2|" \
  "$etc/rumor.env"
echo "RUMOR_LISTEN=$ip:$bp" >"$etc/bootstrap.env"
echo "RUMOR_LISTEN=$ip:$((bp + 1))" >"$etc/peer-0.env"
echo "RUMOR_LISTEN=$ip:$((bp + 2))" >"$etc/peer-1.env"

# service UNIT [INSTANCE]: applies the unit's Environment= and
# EnvironmentFile= lines (specifier %i, paths moved under $root), then runs
# its ExecStart= in the background; the PID goes to $svc_pid.
service() {
  local unit=$1 inst=${2:-} line key val f name
  name=${unit%.service}
  name=${name%@}$inst
  local -a envs=()
  while IFS= read -r line; do
    line=${line//%i/$inst}
    line=${line//\/etc\/rumor/$etc}
    line=${line//\/var\/lib\/rumor/$state}
    line=${line//\/usr\/local\//$root/usr/local/}
    case $line in
      Environment=*)
        # shellcheck disable=SC2206 # the units' Environment= values have no quotes or spaces
        envs+=(${line#Environment=})
        ;;
      EnvironmentFile=*)
        f=${line#EnvironmentFile=}
        f=${f#-}
        [ -f "$f" ] || { [ "${line#EnvironmentFile=-}" != "$line" ] && continue; fail "$unit: no $f"; }
        while IFS= read -r kv; do
          case $kv in '' | '#'*) continue ;; esac
          key=${kv%%=*}
          val=${kv#*=}
          envs+=("$key=$val")
        done <"$f"
        ;;
      ExecStart=*) exec_start=${line#ExecStart=} ;;
    esac
  done <"$root/etc/systemd/system/$unit"
  mkdir -p "$state"
  # shellcheck disable=SC2086 # ExecStart= is split on spaces, as systemd does for ours
  env -i PATH=/usr/bin:/bin "${envs[@]}" $exec_start >"$T/$name.out" 2>"$T/$name.log" &
  svc_pid=$!
  pids="$pids $svc_pid"
}
healthz() { [ "$(curl -s -o /dev/null -w '%{http_code}' --max-time 2 "http://$1/healthz")" = 200 ]; }
wait_for() {
  local n=$(($1 * 5)) what=$2
  shift 2
  for _ in $(seq 1 "$n"); do "$@" && return 0; sleep 0.2; done
  fail "$what"
}
has() { grep -q -- "$2" "$T/$1" 2>/dev/null; }

service rumor-bootstrap.service
boot_pid=$svc_pid
wait_for 10 "the bootstrap service is not ready on $ip:9470" healthz "$ip:9470"
service rumor-peer@.service 0
p0=$svc_pid
service rumor-peer@.service 1
p1=$svc_pid
for p in "$p0" "$p1"; do wait "$p" || fail "a peer service exited with status $?"; done
for i in 0 1; do
  acc=$(sed -n 's/.*"test_accuracy":\([0-9.]*\).*/\1/p' "$T/rumor-peer$i.out")
  [ -n "$acc" ] || fail "peer $i printed no result"
  has "rumor-peer$i.log" "shard $i/2" || fail "peer $i did not train shard $i/2"
  [ -f "$state/peer-$i.safetensors" ] || fail "peer $i wrote no checkpoint in its state directory"
  say "rumor-peer@$i: test accuracy $acc, checkpoint $(basename "$state/peer-$i.safetensors")"
done
kill -TERM "$boot_pid"
wait "$boot_pid" || fail "the bootstrap service exited with status $? on SIGTERM"
has rumor-bootstrap.log "stopping (signal 15)" || fail "the bootstrap service did not stop on SIGTERM"
has rumor-bootstrap.log "leaving: told" || fail "the bootstrap service did not send LEAVE"
say "PASS (systemd itself and its sandbox were not run)"
