#!/bin/sh
# Makes rumor's keys and prints them as Kubernetes Secrets, for
# deploy/k8s/bootstrap.yaml, peers.yaml and peers-job.yaml:
#
#   deploy/k8s/make-secrets.sh KEYDIR | kubectl apply -n NAMESPACE -f -
#   deploy/k8s/make-secrets.sh --allow-list 2 4 KEYDIR | kubectl apply -n NAMESPACE -f -
#
# Keys are made with `rumor keygen` in KEYDIR (mode 0700) and kept there: an
# existing key is reused, so running it again prints the same Secrets. Keep
# KEYDIR private (it holds every secret key of the cluster) and keep
# operator.key for `rumor top`.
#
# Without --allow-list: the Secret rumor-cluster holds cluster.key, the one
# secret every member needs; each pod makes its own identity when it starts
# (the keys init container runs `rumor keygen` into a memory-backed
# emptyDir), so identities cost nothing to manage, but any holder of the
# cluster key may join.
#
# With --allow-list B P: identities are made here for B bootstrap nodes
# (bootstrap-0.key ...), P peers (peer-0.key ...) and the operator
# (operator.key, for `rumor top`); their public keys form the allow-list,
# which rumor-cluster carries too. Then only those keys are admitted, even
# with the cluster key. The bootstrap nodes' identities go into the Secret
# rumor-bootstrap-identities and the peers' into rumor-peer-identities, so a
# peer pod never holds a bootstrap node's key. Adding peers later: run it
# again with a larger P, apply, and restart the running pods (rumor reads the
# allow-list when it starts).
#
# Environment: RUMOR, the rumor binary (default: rumor on PATH, else
# build/peer/rumor).
set -eu

die() { echo "make-secrets.sh: $*" >&2; exit 2; }
usage="usage: $0 [--allow-list BOOTSTRAP_NODES PEERS] KEYDIR"

nboot=""
npeer=""
if [ "${1:-}" = --allow-list ]; then
  [ $# -eq 4 ] || die "$usage"
  nboot=$2
  npeer=$3
  shift 3
  case $nboot$npeer in *[!0-9]*) die "$usage" ;; esac
fi
[ $# -eq 1 ] || die "$usage"
dir=$1
if [ -z "${RUMOR:-}" ]; then
  RUMOR=$(command -v rumor || echo "$(dirname "$0")/../../build/peer/rumor")
fi
[ -x "$RUMOR" ] || die "no rumor binary at $RUMOR (set RUMOR)"
(umask 077 && mkdir -p "$dir") || die "cannot create $dir"
chmod 700 "$dir"

case $dir in *[[:space:]]*) die "KEYDIR must not contain white space" ;; esac
keygen() { [ -f "$1" ] || "$RUMOR" keygen -o "$1" >/dev/null 2>&1 || die "rumor keygen -o $1 failed"; }
[ -f "$dir/cluster.key" ] || "$RUMOR" keygen --cluster -o "$dir/cluster.key" >/dev/null 2>&1 ||
  die "rumor keygen --cluster -o $dir/cluster.key failed"

b64() { base64 -w 0 < "$1"; }
# secret NAME FILE...: a Secret whose keys are the files' base names.
secret() {
  name=$1
  shift
  printf -- '---\napiVersion: v1\nkind: Secret\nmetadata:\n  name: %s\n' "$name"
  printf '  labels:\n    app.kubernetes.io/name: rumor\ntype: Opaque\ndata:\n'
  for f in "$@"; do printf '  %s: %s\n' "$(basename "$f")" "$(b64 "$f")"; done
}

if [ -z "$nboot" ]; then
  rm -f "$dir/allow-list"
  secret rumor-cluster "$dir/cluster.key"
  exit 0
fi

boot_files=""
peer_files=""
i=0
while [ "$i" -lt "$nboot" ]; do
  keygen "$dir/bootstrap-$i.key"
  boot_files="$boot_files $dir/bootstrap-$i.key"
  i=$((i + 1))
done
i=0
while [ "$i" -lt "$npeer" ]; do
  keygen "$dir/peer-$i.key"
  peer_files="$peer_files $dir/peer-$i.key"
  i=$((i + 1))
done
keygen "$dir/operator.key"
{
  echo "# rumor allow-list: one public key a line (deploy/k8s/make-secrets.sh)"
  for f in $boot_files $peer_files "$dir/operator.key"; do
    printf '%s # %s\n' "$("$RUMOR" keygen --public "$f")" "$(basename "$f" .key)"
  done
} > "$dir/allow-list.tmp" && mv "$dir/allow-list.tmp" "$dir/allow-list"
secret rumor-cluster "$dir/cluster.key" "$dir/allow-list"
# shellcheck disable=SC2086 # lists of file names without spaces
[ -n "$boot_files" ] && secret rumor-bootstrap-identities $boot_files
# shellcheck disable=SC2086
[ -n "$peer_files" ] && secret rumor-peer-identities $peer_files
exit 0
