#!/bin/sh
# Installs every build, test, benchmark and data dependency of rumor from
# Debian's packages. Run as root on Debian 12 (bookworm) or later.
# munge and the Slurm daemons are for tests/scripts/slurm_cluster.sh, which
# starts its own private instances; the system's Slurm services stay off
# without an /etc/slurm/slurm.conf.
# CUDA is not installed here: when nvcc is on PATH (or in /usr/local/cuda)
# the build picks it up, otherwise rumor builds for the CPU only.
# bible-kjv is the default language-model corpus: its `bible` command prints
# the King James Bible, which this script writes as plain text to
# /usr/local/share/rumor/kjv.txt (deploy/make-corpus.sh).
# chromium (headless) and a font render `rumor top --web`'s page in
# test_peer_top_web and for docs/top-web.png.
set -eu

if [ "$(id -u)" -ne 0 ]; then
  echo "install-deps.sh: must run as root (it calls apt-get)" >&2
  exit 1
fi

packages="
  build-essential cmake pkg-config git
  libuv1-dev libmsgpack-dev libsodium-dev libssl-dev zlib1g-dev libdnnl-dev libjansson-dev
  libcriterion-dev
  clang libclang-rt-14-dev
  libopenblas0-pthread
  dataset-fashion-mnist bible-kjv
  python3 python3-numpy python3-torch
  prometheus
  chromium fonts-dejavu-core
  munge slurmctld slurmd slurm-client
  python3-venv shellcheck systemd
  iproute2 nftables
"

export DEBIAN_FRONTEND=noninteractive
# Skip the index refresh when everything is already present (repeat runs).
missing=""
for p in $packages; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing="$missing $p"
done
if [ -n "$missing" ]; then
  apt-get update -q
  # Only promtool (the metrics test) is wanted from `prometheus`: when this
  # script installs it, its server must not start or be enabled. Debian's
  # policy-rc.d keeps maintainer scripts from starting services.
  new_prometheus=false
  case " $missing " in *" prometheus "*) new_prometheus=true ;; esac
  policy=/usr/sbin/policy-rc.d
  made_policy=false
  if $new_prometheus && [ ! -e "$policy" ]; then
    printf '#!/bin/sh\nexit 101\n' > "$policy" && chmod 755 "$policy" && made_policy=true
  fi
  # shellcheck disable=SC2086
  apt-get install -y -q --no-install-recommends $missing || { $made_policy && rm -f "$policy"; exit 1; }
  $made_policy && rm -f "$policy"
  if $new_prometheus && [ -d /run/systemd/system ]; then
    systemctl disable --now prometheus >/dev/null 2>&1 || true
  fi
fi

# The default corpus for language models (TOKEN_DEFAULT_CORPUS in
# peer/data/data.h): the King James Bible as 4.3 MB of plain text, printed by
# `bible "Gen1:1-Rev22:21"` from bible-kjv. Written only when missing or
# empty, so repeat runs leave it alone.
corpus=/usr/local/share/rumor/kjv.txt
if [ ! -s "$corpus" ]; then
  sh "$(dirname "$0")/make-corpus.sh" "$corpus"
fi
