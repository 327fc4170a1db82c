#!/bin/sh
# Installs every build, test, benchmark and data dependency of rumor from
# Debian's packages. Run as root on Debian 12 (bookworm) or later.
# munge and the Slurm daemons are for tests/scripts/slurm_cluster.sh, which
# starts its own private instances; the system's Slurm services stay off
# without an /etc/slurm/slurm.conf.
# CUDA is not installed here: when nvcc is on PATH (or in /usr/local/cuda)
# the build picks it up, otherwise rumor builds for the CPU only.
set -eu

if [ "$(id -u)" -ne 0 ]; then
  echo "install-deps.sh: must run as root (it calls apt-get)" >&2
  exit 1
fi

packages="
  build-essential cmake pkg-config git
  libuv1-dev libmsgpack-dev libsodium-dev zlib1g-dev libdnnl-dev
  libcriterion-dev
  clang libclang-rt-14-dev
  libopenblas0-pthread
  dataset-fashion-mnist
  python3 python3-numpy python3-torch
  munge slurmctld slurmd slurm-client
"

export DEBIAN_FRONTEND=noninteractive
# Skip the index refresh when everything is already present (repeat runs).
missing=""
for p in $packages; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing="$missing $p"
done
if [ -n "$missing" ]; then
  apt-get update -q
  # shellcheck disable=SC2086
  apt-get install -y -q --no-install-recommends $missing
fi
