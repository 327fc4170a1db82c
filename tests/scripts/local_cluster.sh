#!/bin/bash
# deploy/local-cluster.sh, the README's main job, in short runs: 2 peers of
# a small MLP for a few steps, through a wrapper that records each peer's
# command line. Checks that the runs finish and print their table, and the
# drift bound the script adds: --max-local-steps 4 for gossiping peers by
# default (also with --gossip-every 0 and a --gossip-interval); none with
# MAX_LOCAL_STEPS=0, --sync allreduce or --gossip-every 0 alone; a
# --max-local-steps (or --max-local-steps=N) among the peer options comes
# last (it wins); a bad MAX_LOCAL_STEPS or N is refused before anything
# starts; a bad peer option fails the run showing the peers' error.
# About 15 s.
#
#   tests/scripts/local_cluster.sh RUMOR_BIN SOURCE_DIR [FMNIST_DIR]
#
# Exit status: 0 pass, 1 fail, 77 skip (no Fashion-MNIST).
set -u
rumor=${1:?usage: $0 RUMOR_BIN SOURCE_DIR [FMNIST_DIR]}
src=${2:?usage: $0 RUMOR_BIN SOURCE_DIR [FMNIST_DIR]}
data=${3:-/usr/share/datasets/fashion-mnist}
ls "$data"/train-images-idx3-ubyte* >/dev/null 2>&1 || { echo "SKIP: no Fashion-MNIST in $data"; exit 77; }
rumor=$(readlink -f "$rumor")

T=$(mktemp -d /tmp/rumor-local-cluster.XXXXXX) || exit 1
trap 'rm -rf "$T"' EXIT
# The wrapper: each `rumor peer` writes its arguments, one per line, to
# peer-args.N (N: its pid), then becomes the real binary.
cat > "$T/rumor" <<EOF
#!/bin/sh
[ "\$1" = peer ] && printf '%s\n' "\$@" > "$T/peer-args.\$\$"
exec "$rumor" "\$@"
EOF
chmod +x "$T/rumor"

fail() { echo "FAIL: $*"; echo "--- output:"; cat "$T/out"; exit 1; }

# run NAME [env ...] -- [peer options]: one short run; its peers' argument
# files end up in $T/NAME/.
run() {
  local name=$1
  shift
  local envs=()
  while [ "$1" != -- ]; do envs+=("$1"); shift; done
  shift
  rm -f "$T"/peer-args.*
  mkdir -p "$T/$name"
  if ! env ${envs[@]+"${envs[@]}"} RUMOR="$T/rumor" WORKDIR="$T/work" THREADS=1 timeout 120 "$src/deploy/local-cluster.sh" 2 -- \
      --data "$data" --model mlp:784-16-10 --max-steps 5 --no-eval --log-every 0 "$@" > "$T/out" 2>&1; then
    fail "$name: deploy/local-cluster.sh failed"
  fi
  grep -q '^peer-2 ' "$T/out" || fail "$name: no table row for peer-2"
  mv "$T"/peer-args.* "$T/$name/" 2>/dev/null
  local files=("$T/$name"/peer-args.*)
  if [ "${#files[@]}" != 2 ] || [ ! -f "${files[0]}" ]; then fail "$name: expected the arguments of 2 peers"; fi
}
# bound NAME: the last --max-local-steps value each peer of run NAME got
# (empty: none), one line per peer.
bound() {
  for f in "$T/$1"/peer-args.*; do awk 'p {v = $0; p = 0} $0 == "--max-local-steps" {p = 1}
    /^--max-local-steps=/ {v = substr($0, 19)} END {print v}' "$f"; done
}
expect_bound() {
  local got
  got=$(bound "$1" | sort -u)
  [ "$got" = "$2" ] || fail "$1: peers got --max-local-steps '$got', expected '$2'"
  echo "local_cluster: $1: --max-local-steps '${2}' as expected"
}

run default --
grep -q "at most 4 steps between applied exchanges" "$T/out" || fail "default: the header does not name the bound"
expect_bound default 4
run off MAX_LOCAL_STEPS=0 --
expect_bound off ""
run mine -- --max-local-steps 2
expect_bound mine 2
run allreduce -- --sync allreduce
expect_bound allreduce ""
grep -q "at most" "$T/out" && fail "allreduce: the header names a bound"
run nogossip -- --gossip-every 0
expect_bound nogossip ""
run interval -- --gossip-every=0 --gossip-interval 0.2
expect_bound interval 4
run mine_eq -- --max-local-steps=3
expect_bound mine_eq 3
# An outer optimizer communicates once a round: no bound, and the table
# counts outer rounds. The table's rows end where its header does, and
# samples/s is a whole number.
run outer -- --outer nesterov --local-steps 2
expect_bound outer ""
grep -q "outer rounds" "$T/out" || fail "outer: the table does not count outer rounds"
head=$(grep '^peer  *shard' "$T/out")
row=$(grep '^peer-1 ' "$T/out")
[ "${#head}" = "${#row}" ] || fail "outer: the header ($head) and a row ($row) end in different columns"
echo "$row" | awk '{exit !($NF ~ /^[0-9]+$/)}' || fail "outer: samples/s is not a whole number: $row"
echo "local_cluster: outer: no bound, outer rounds counted, header and rows aligned"
# A bad MAX_LOCAL_STEPS: exit 2 naming it, before anything starts.
MAX_LOCAL_STEPS=four RUMOR="$T/rumor" WORKDIR="$T/bad" "$src/deploy/local-cluster.sh" 2 > "$T/out" 2>&1
st=$?
if [ "$st" != 2 ] || ! grep -q "MAX_LOCAL_STEPS must be a whole number of steps (0: no bound), not 'four'" "$T/out"; then
  fail "MAX_LOCAL_STEPS=four: exit $st"
fi
[ -e "$T/bad" ] && fail "MAX_LOCAL_STEPS=four: the run started (made $T/bad)"
echo "local_cluster: a bad MAX_LOCAL_STEPS is refused"
# Too many peers for one machine: refused before any key is made.
RUMOR="$T/rumor" WORKDIR="$T/many" "$src/deploy/local-cluster.sh" 99999 > "$T/out" 2>&1
st=$?
if [ "$st" != 2 ] || ! grep -q "N is 99999; at most 256 peers" "$T/out"; then fail "N=99999: exit $st"; fi
[ -e "$T/many" ] && fail "N=99999: the run started (made $T/many)"
# A bad peer option: every peer fails, and the reason is shown.
RUMOR="$T/rumor" WORKDIR="$T/opt" THREADS=1 timeout 60 "$src/deploy/local-cluster.sh" 2 -- --bogus > "$T/out" 2>&1
st=$?
if [ "$st" != 1 ] || ! grep -q "peer-2 failed: rumor peer: unknown option '--bogus'" "$T/out"; then
  fail "a bad peer option: exit $st"
fi
echo "local_cluster: too many peers and a bad peer option are reported"
echo "local_cluster: PASS"
