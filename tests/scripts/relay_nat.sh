#!/bin/bash
# Peers behind a real NAT (deploy/testnet.sh `nat`: a router namespace that
# masquerades and lets no connection in). Four test hosts: a bootstrap node
# that relays, a public peer, and two peers behind NATs that listen on their
# private address as if nothing were wrong. The bootstrap node cannot dial
# them back, tells them so, and they move to the relay on their own; the
# three peers train to the usual accuracy and the two NATed peers exchange
# with each other through the relay. About 20 s.
#
#   tests/scripts/relay_nat.sh RUMOR_BIN SOURCE_DIR NETSIM_BIN [FMNIST_DIR]
#
# Exit status: 0 pass, 1 fail, 77 skip (no namespaces, no nft, no data).
set -u
rumor=$(readlink -f "${1:?usage: $0 RUMOR_BIN SOURCE_DIR NETSIM_BIN [FMNIST_DIR]}")
src=${2:?usage}
TESTNET_NETSIM=$(readlink -f "${3:?usage}")
export TESTNET_NETSIM
data=${4:-/usr/share/datasets/fashion-mnist}
ls "$data"/train-images-idx3-ubyte* >/dev/null 2>&1 || { echo "SKIP: no Fashion-MNIST in $data"; exit 77; }
command -v nft >/dev/null 2>&1 || { echo "SKIP: no nft (apt-get install nftables)"; exit 77; }
testnet=$src/deploy/testnet.sh
"$testnet" check || exit 77
export TESTNET_NAME=rnat$$ TESTNET_OWNER=$$

T=$(mktemp -d /tmp/rumor-relay-nat.XXXXXX) || exit 1
pids=""
cleanup() {
  for p in $pids; do kill -9 "$p" 2>/dev/null; done
  wait 2>/dev/null
  "$testnet" down >/dev/null 2>&1
  rm -rf "$T"
}
trap cleanup EXIT
trap 'exit 130' INT TERM
fail() { echo "FAIL: $*"; for f in "$T"/*.log; do echo "--- $f"; tail -n 25 "$f"; done; exit 1; }

"$testnet" up 4 >/dev/null || fail "cannot make test hosts"
"$testnet" nat 3 || fail "cannot put host 3 behind a NAT"
"$testnet" nat 4 || fail "cannot put host 4 behind a NAT"
"$rumor" keygen --cluster -o "$T/cluster.key" >/dev/null 2>&1
for i in 1 2 3 4; do "$rumor" keygen -o "$T/id$i.key" >/dev/null 2>&1; done
timing="--period-ms 100 --ping-timeout-ms 60 --suspect-ms 1000"

boot=$("$testnet" addr 1):7470
"$testnet" exec 1 "$rumor" bootstrap --relay --listen "$boot" --cluster-key "$T/cluster.key" \
  --identity "$T/id1.key" $timing > "$T/boot.out" 2> "$T/boot.log" &
pids=$!
for _ in $(seq 1 100); do grep -q '"listen"' "$T/boot.out" 2>/dev/null && break; sleep 0.1; done

for i in 2 3 4; do
  addr=$("$testnet" addr "$i"):7471
  "$testnet" exec "$i" "$rumor" peer --bootstrap "$boot" --listen "$addr" --cluster-key "$T/cluster.key" \
    --identity "$T/id$i.key" $timing --data "$data" --model mlp:784-64-10 --shard "$((i - 2))/3" --epochs 4 \
    --batch 64 --lr 0.1 --threads 1 --wait-peers 3 > "$T/peer$i.out" 2> "$T/peer$i.log" &
  pids="$pids $!"
  peer_pids="${peer_pids:-} $!"
done
# The peers (the bootstrap node runs until the end), each bounded: a
# watchdog kills what is still running after 120 s.
# (Its sleep runs in the background and is waited for with the `wait`
# builtin, so that killing the watchdog ends it at once: bash would finish
# a foreground sleep before acting on the signal.)
( trap 'kill "$s" 2>/dev/null; exit 0' TERM
  sleep "${RELAY_NAT_WATCHDOG_S:-120}" & s=$!
  wait "$s" && kill -9 $peer_pids 2>/dev/null ) &
watchdog=$!
status=0
for p in $peer_pids; do wait "$p" || status=1; done
kill "$watchdog" 2>/dev/null
[ $status = 0 ] || fail "a peer failed or did not finish within 120 s"

result() { tail -n 1 "$T/peer$1.out" | sed -n "s/.*\"$2\":\\([^,}]*\\).*/\\1/p"; }
for i in 2 3 4; do
  acc=$(result "$i" test_accuracy)
  echo "peer $i: accuracy $acc, $(result "$i" exchanges) exchanges, $(result "$i" relayed_bytes) relayed bytes, via $(result "$i" relay_via)"
  # 0.75, not the 0.80 a longer run reaches: 4 epochs at lr 0.1 end anywhere
  # in 0.79-0.85 (a peer that finishes first averages with fewer partners;
  # CI once saw 0.7951). An untrained or diverged model is at 0.10-0.30.
  awk -v a="$acc" 'BEGIN { exit !(a > 0.75) }' || fail "peer $i ended at accuracy $acc"
done
for i in 3 4; do
  grep -q "could not dial us back" "$T/peer$i.log" || fail "peer $i was not told that it cannot be dialed"
  grep -q "reachable through the relay $boot" "$T/peer$i.log" || fail "peer $i did not go through the relay"
  [ "$(result "$i" relayed_bytes)" -gt 0 ] || fail "peer $i sent nothing over the relay"
done
grep -q "could not dial us back" "$T/peer2.log" && fail "the public peer was judged unreachable"
# The NATed peers dial out: a link the public peer opened to one of them
# through the relay is replaced by their direct dial (links.c, go_direct),
# so little of the public peer's traffic crosses the relay.
# (relayed_bytes counts both directions.)
rb=$(result 2 relayed_bytes) bo=$(result 2 bytes_out) bi=$(result 2 bytes_in)
awk -v r="${rb:-0}" -v b="$((${bo:-0} + ${bi:-0}))" 'BEGIN { exit !(b > 0 && r * 10 < b) }' ||
  fail "the public peer moved $rb of its $bo + $bi bytes through the relay: its links to the NATed peers did not go direct"
k3=$(sed -n 's/.*"id":"\(.\{12\}\).*/\1/p' "$T/peer3.out" | head -n 1)
k4=$(sed -n 's/.*"id":"\(.\{12\}\).*/\1/p' "$T/peer4.out" | head -n 1)
grep -q " @$boot key=$k4" "$T/peer3.log" || grep -q " @$boot key=$k3" "$T/peer4.log" ||
  fail "the two NATed peers never connected through the relay"
echo "PASS: two peers behind NATs trained through the relay"
