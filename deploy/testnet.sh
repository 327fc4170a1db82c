#!/bin/sh
# Test hosts: K network namespaces, each a "host" with one interface (eth0,
# 10.77.0.<i>/24) joined by a veth pair to a switch in its own namespace, with
# per-host delay, loss and rate limits and cuts. Nothing touches the root
# namespace's interfaces, so several test networks may exist at once (each
# with its own TESTNET_NAME) and none can reach the outside.
#
#   deploy/testnet.sh check              exit 0 if test hosts can be made here,
#                                        else 77 with the reason on stderr
#   deploy/testnet.sh up K               make hosts 1..K (removes an old one of the same name)
#   deploy/testnet.sh shape H|all [delay MS] [loss PCT] [rate MBIT]
#                                        impair what host H sends (like netem on its eth0);
#                                        no arguments: clear
#   deploy/testnet.sh cut H|all          cut host H off (every frame to or from it is lost)
#   deploy/testnet.sh heal H|all         undo the cut
#   deploy/testnet.sh nat H              put host H behind a NAT: H's namespace becomes its
#                                        router (masquerading, no inbound connections) and
#                                        the host moves inside, on 192.168.H.2; needs nft
#   deploy/testnet.sh exec H CMD...      run CMD on host H (ip netns exec: the PID is CMD's)
#   deploy/testnet.sh ns H | addr H      the namespace name / the address of host H (behind a
#                                        NAT: the inner host's private address)
#   deploy/testnet.sh status             backend, hosts, impairments, link counters
#   deploy/testnet.sh down               end everything; safe to repeat
#   deploy/testnet.sh gc                 take down test networks whose owner process is gone
#   deploy/testnet.sh run K -- CMD...    up K, run CMD with TESTNET_NAME exported, down
#                                        afterwards whatever happens (trap)
#
# Environment: TESTNET_NAME (namespace prefix, default rtn), TESTNET_OWNER (a
# PID: `gc` removes this network once that process is gone; default: none),
# TESTNET_BACKEND (auto, netem or netsim), TESTNET_NETSIM (the netsim binary,
# default build/tests/netsim/netsim), TESTNET_SEED (netsim's loss seed).
#
# Backends. netem: the switch is a kernel bridge; `shape` sets
# `tc qdisc ... netem delay loss rate` on the host's eth0; `cut` sets netem
# loss 100 % on the host's eth0 and on the switch port towards it. netsim (used when the kernel has no sch_netem, as on
# some VM kernels): the switch is tests/netsim/netsim, a user-space switch
# reading the veth ends with AF_PACKET that applies the same impairments at
# the same place (the host's outgoing frames) and drops a cut host's frames.
# auto picks netem when a netem qdisc can be created.
set -eu
cd "$(dirname "$0")/.."
name=${TESTNET_NAME:-rtn}
state_root=${TESTNET_STATE:-/run/rumor-testnet}
state=$state_root/$name
sw=$name-sw
subnet=10.77.0

die() { echo "testnet: $*" >&2; exit 1; }
host_ns() { echo "$name-h$1"; }

# Exit 77 (skip) with a reason when namespaces cannot be made here.
check() {
  [ "$(id -u)" = 0 ] || { echo "testnet: needs root to create network namespaces" >&2; exit 77; }
  command -v ip >/dev/null 2>&1 || { echo "testnet: no 'ip' command (apt-get install iproute2)" >&2; exit 77; }
  probe=rtn-probe-$$
  if ! ip netns add "$probe" 2>/dev/null; then
    echo "testnet: cannot create network namespaces here (ip netns add failed)" >&2
    exit 77
  fi
  ok=1
  ip link add vprobe$$ netns "$probe" type veth peer name veth1 netns "$probe" 2>/dev/null || ok=0
  ip netns del "$probe" 2>/dev/null || true
  [ $ok = 1 ] || { echo "testnet: cannot create veth pairs here" >&2; exit 77; }
  if [ "$(pick_backend)" = netsim ] && [ ! -x "$(netsim_bin)" ]; then
    echo "testnet: the kernel has no sch_netem and $(netsim_bin) is not built (cmake --build build --target netsim)" >&2
    exit 77
  fi
}

netsim_bin() { echo "${TESTNET_NETSIM:-build/tests/netsim/netsim}"; }

# netem when the kernel has it (probed in a scratch namespace), else netsim.
pick_backend() {
  b=${TESTNET_BACKEND:-auto}
  if [ "$b" = auto ]; then
    probe=rtn-netem-$$
    b=netsim
    if ip netns add "$probe" 2>/dev/null; then
      ip netns exec "$probe" tc qdisc add dev lo root netem delay 1ms 2>/dev/null && b=netem
      ip netns del "$probe" 2>/dev/null || true
    fi
  fi
  echo "$b"
}

hosts() { cat "$state/hosts" 2>/dev/null || die "no test network '$name' (run: $0 up K)"; }
backend() { cat "$state/backend"; }

# "all" or one host number, checked.
targets() {
  k=$(hosts)
  if [ "$1" = all ]; then seq 1 "$k"; return; fi
  case $1 in ''|*[!0-9]*) die "bad host '$1' (1..$k or all)";; esac
  [ "$1" -ge 1 ] && [ "$1" -le "$k" ] || die "no host $1 (1..$k)"
  echo "$1"
}

# Kills the processes inside our namespaces (by PID) and removes them.
down() {
  if [ -f "$state/netsim.pid" ]; then
    pid=$(cat "$state/netsim.pid")
    if [ -n "$pid" ] && grep -q netsim "/proc/$pid/cmdline" 2>/dev/null; then
      kill "$pid" 2>/dev/null || true
    fi
  fi
  for ns in $(ip netns list 2>/dev/null | awk '{print $1}' | grep -E "^$name-(h[0-9]+|h[0-9]+-in|sw)\$" || true); do
    for pid in $(ip netns pids "$ns" 2>/dev/null); do kill -9 "$pid" 2>/dev/null || true; done
    ip netns del "$ns" 2>/dev/null || true
  done
  rm -rf "$state"
}

ns_sysctl() { ip netns exec "$1" sh -c "echo $3 > /proc/sys/$2" 2>/dev/null || true; }

up() {
  k=$1
  case $k in ''|*[!0-9]*) die "usage: $0 up K (1..60)";; esac
  [ "$k" -ge 1 ] && [ "$k" -le 60 ] || die "K must be 1..60"
  check
  down
  b=$(pick_backend)
  mkdir -p "$state"
  echo "$k" > "$state/hosts"
  echo "$b" > "$state/backend"
  [ -n "${TESTNET_OWNER:-}" ] && echo "$TESTNET_OWNER" > "$state/owner"
  ip netns add "$sw"
  ip -n "$sw" link set lo up
  ns_sysctl "$sw" net/ipv6/conf/all/disable_ipv6 1
  ns_sysctl "$sw" net/ipv6/conf/default/disable_ipv6 1
  if [ "$b" = netem ]; then
    ip -n "$sw" link add br0 type bridge
    ip -n "$sw" link set br0 up
  fi
  for i in $(seq 1 "$k"); do
    h=$(host_ns "$i")
    ip netns add "$h"
    ns_sysctl "$h" net/ipv6/conf/all/disable_ipv6 1
    ns_sysctl "$h" net/ipv6/conf/default/disable_ipv6 1
    ip -n "$h" link set lo up
    ip link add "vh$i" netns "$sw" type veth peer name eth0 netns "$h"
    ip -n "$h" link set eth0 address "02:77:00:00:00:$(printf %02x "$i")"
    ip -n "$h" addr add "$subnet.$i/24" dev eth0
    ip -n "$h" link set eth0 up
    [ "$b" = netem ] && ip -n "$sw" link set "vh$i" master br0
    ip -n "$sw" link set "vh$i" up
    echo "0 0 0" > "$state/h$i.shape"
    echo 0 > "$state/h$i.cut"
  done
  if [ "$b" = netsim ]; then
    mkfifo "$state/ctl"
    echo 0 > "$state/seq"
    ip netns exec "$sw" "$(netsim_bin)" "$state" "$k" "${TESTNET_SEED:-1}" \
      > "$state/netsim.log" 2>&1 < /dev/null &
    echo $! > "$state/netsim.pid"
    for _ in $(seq 1 100); do [ -f "$state/ready" ] && break; sleep 0.05; done
    [ -f "$state/ready" ] || { cat "$state/netsim.log" >&2; down; die "netsim did not start"; }
  fi
  echo "testnet $name: $k hosts ($subnet.1-$subnet.$k), backend $b"
}

# Applies host i's recorded shape and cut.
apply() {
  i=$1
  read -r delay loss rate < "$state/h$i.shape"
  cut=$(cat "$state/h$i.cut")
  if [ "$(backend)" = netem ]; then
    # A cut loses everything both ways with the carrier up (a partition
    # beyond the host, not an unplugged cable): netem loss 100 % on the
    # host's eth0 and on the switch port towards it.
    h=$(host_ns "$i")
    if [ "$cut" = 1 ]; then
      tc -n "$h" qdisc replace dev eth0 root netem loss 100%
      tc -n "$sw" qdisc replace dev "vh$i" root netem loss 100%
    else
      tc -n "$sw" qdisc del dev "vh$i" root 2>/dev/null || true
      if [ "$delay" = 0 ] && [ "$loss" = 0 ] && [ "$rate" = 0 ]; then
        tc -n "$h" qdisc del dev eth0 root 2>/dev/null || true
      else
        set -- limit 100000
        [ "$delay" != 0 ] && set -- "$@" delay "${delay}ms"
        [ "$loss" != 0 ] && set -- "$@" loss "${loss}%"
        [ "$rate" != 0 ] && set -- "$@" rate "${rate}mbit"
        tc -n "$h" qdisc replace dev eth0 root netem "$@"
      fi
    fi
  else
    # One writer at a time, so sequence numbers and FIFO lines do not interleave.
    exec 9> "$state/lock"
    flock 9
    seq=$(( $(cat "$state/seq") + 1 ))
    echo "$seq" > "$state/seq"
    echo "set $i $delay $loss $rate $cut $seq" > "$state/ctl"
    for _ in $(seq 1 200); do
      [ "$(cat "$state/applied" 2>/dev/null || echo 0)" -ge "$seq" ] && break
      sleep 0.01
    done
    [ "$(cat "$state/applied" 2>/dev/null || echo 0)" -ge "$seq" ] || die "netsim did not apply the change"
    exec 9>&-
  fi
}

# Host i behind a NAT. Its namespace keeps eth0 on the switch (so shapes and
# cuts work as before) and becomes the router; the host proper lives in
# $name-h<i>-in on 192.168.<i>.2/24, routed through 192.168.<i>.1. The
# router masquerades what leaves through eth0 and forwards inwards only
# packets of connections the inside opened: nothing outside can connect in.
nat() {
  i=$1
  h=$(host_ns "$i")
  in=$h-in
  command -v nft >/dev/null 2>&1 || die "nat: needs nft (apt-get install nftables)"
  ip netns list | awk '{print $1}' | grep -qx "$in" && die "nat: host $i is already behind a NAT"
  ip netns add "$in"
  ns_sysctl "$in" net/ipv6/conf/all/disable_ipv6 1
  ip -n "$in" link set lo up
  ip link add lan0 netns "$h" type veth peer name eth0 netns "$in"
  ip -n "$h" addr add "192.168.$i.1/24" dev lan0
  ip -n "$h" link set lan0 up
  ip -n "$in" addr add "192.168.$i.2/24" dev eth0
  ip -n "$in" link set eth0 up
  ip -n "$in" route add default via "192.168.$i.1"
  ns_sysctl "$h" net/ipv4/ip_forward 1
  ip netns exec "$h" nft -f - <<NFT
table ip rtn_nat {
  chain outward { type nat hook postrouting priority 100; oifname "eth0" masquerade; }
  chain inward {
    type filter hook forward priority 0; policy drop;
    iifname "lan0" accept
    ct state established,related accept
  }
}
NFT
  echo 1 > "$state/h$i.nat"
}

is_nat() { [ -f "$state/h$1.nat" ]; }

shape() {
  t=$1
  shift
  delay=0 loss=0 rate=0
  while [ $# -gt 0 ]; do
    [ $# -ge 2 ] || die "shape: '$1' needs a value"
    case $1 in
      delay) delay=$2;; loss) loss=$2;; rate) rate=$2;;
      *) die "shape: unknown '$1' (delay MS, loss PCT, rate MBIT)";;
    esac
    shift 2
  done
  for v in "$delay" "$loss" "$rate"; do
    case $v in ''|*[!0-9.]*) die "shape: '$v' is not a number";; esac
  done
  for i in $(targets "$t"); do
    echo "$delay $loss $rate" > "$state/h$i.shape"
    apply "$i"
  done
}

setcut() {
  for i in $(targets "$1"); do
    echo "$2" > "$state/h$i.cut"
    apply "$i"
  done
}

status() {
  echo "testnet $name: $(hosts) hosts, backend $(backend)"
  for i in $(seq 1 "$(hosts)"); do
    read -r delay loss rate < "$state/h$i.shape"
    printf 'host %s  %s  %s  delay %s ms  loss %s %%  rate %s Mbit/s%s\n' "$i" "$(host_ns "$i")" "$subnet.$i" \
      "$delay" "$loss" "$rate" "$([ "$(cat "$state/h$i.cut")" = 1 ] && echo '  CUT' || true)"
  done
  [ -f "$state/stats" ] && cat "$state/stats"
  return 0
}

# Removes test networks whose owner (TESTNET_OWNER at `up`) has exited.
gc() {
  [ -d "$state_root" ] || return 0
  for d in "$state_root"/*; do
    [ -f "$d/owner" ] || continue
    owner=$(cat "$d/owner")
    kill -0 "$owner" 2>/dev/null && continue
    TESTNET_NAME=$(basename "$d") TESTNET_STATE=$state_root "$0" down
  done
}

cmd=${1:-}
[ $# -gt 0 ] && shift
case $cmd in
  check) check;;
  up) up "${1:-}";;
  down) down;;
  gc) gc;;
  shape) [ $# -ge 1 ] || die "usage: $0 shape H|all [delay MS] [loss PCT] [rate MBIT]"; shape "$@";;
  cut) [ $# -eq 1 ] || die "usage: $0 cut H|all"; setcut "$1" 1;;
  heal) [ $# -eq 1 ] || die "usage: $0 heal H|all"; setcut "$1" 0;;
  nat) [ $# -eq 1 ] || die "usage: $0 nat H"; nat "$(targets "$1")";;
  ns) targets "${1:-}" >/dev/null; if is_nat "$1"; then echo "$(host_ns "$1")-in"; else host_ns "$1"; fi;;
  addr) targets "${1:-}" >/dev/null; if is_nat "$1"; then echo "192.168.$1.2"; else echo "$subnet.$1"; fi;;
  exec)
    [ $# -ge 2 ] || die "usage: $0 exec H CMD..."
    t=$(targets "$1")
    shift
    ns=$(host_ns "$t")
    is_nat "$t" && ns=$ns-in
    exec ip netns exec "$ns" "$@";;
  status) status;;
  run)
    k=${1:-}
    shift
    [ "${1:-}" = -- ] && shift
    [ $# -ge 1 ] || die "usage: $0 run K -- CMD..."
    trap 'down' EXIT
    trap 'exit 130' INT TERM
    up "$k"
    export TESTNET_NAME="$name"
    set +e
    "$@"
    rc=$?
    set -e
    exit $rc;;
  *) sed -n '2,40p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2;;
esac
