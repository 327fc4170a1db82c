#!/bin/sh
# Installs rumor as systemd services on this host (as root):
#
#   deploy/systemd/install.sh [BUILD_DIR]      (default: build)
#
# - the binary at /usr/local/bin/rumor, rumor-launch at /usr/local/lib/rumor/,
#   the guide at /usr/local/share/doc/rumor/operating.md;
# - a system user and group `rumor` (no login, home /var/lib/rumor);
# - /etc/rumor, owned by rumor, mode 0700, with rumor.env (kept if present);
# - rumor-bootstrap.service and rumor-peer@.service in /etc/systemd/system.
#
# It starts nothing and makes no keys; it prints what to do next. With
# DESTDIR set it installs under that directory instead, without the user
# and without touching systemd (for packaging and tests).
set -eu
cd "$(dirname "$0")/../.."
build=${1:-build}
root=${DESTDIR:-}
[ -x "$build/peer/rumor" ] || { echo "install.sh: no $build/peer/rumor; run deploy/build.sh first" >&2; exit 1; }
if [ -z "$root" ] && [ "$(id -u)" -ne 0 ]; then
  echo "install.sh: must run as root (or set DESTDIR)" >&2
  exit 1
fi

install -D -m 0755 "$build/peer/rumor" "$root/usr/local/bin/rumor"
install -D -m 0755 deploy/rumor-launch "$root/usr/local/lib/rumor/rumor-launch"
install -D -m 0644 docs/operating.md "$root/usr/local/share/doc/rumor/operating.md"
install -D -m 0644 deploy/systemd/rumor-bootstrap.service "$root/etc/systemd/system/rumor-bootstrap.service"
install -D -m 0644 deploy/systemd/rumor-peer@.service "$root/etc/systemd/system/rumor-peer@.service"

owner=""
if [ -z "$root" ]; then
  if ! getent passwd rumor >/dev/null; then
    useradd --system --user-group --home-dir /var/lib/rumor --no-create-home --shell /usr/sbin/nologin rumor
  fi
  owner="-o rumor -g rumor"
fi
# shellcheck disable=SC2086 # $owner: no options, or -o and -g
install -d -m 0700 $owner "$root/etc/rumor"
if [ ! -f "$root/etc/rumor/rumor.env" ]; then
  # shellcheck disable=SC2086
  install -m 0600 $owner deploy/systemd/rumor.env "$root/etc/rumor/rumor.env"
fi
if [ -z "$root" ] && [ -d /run/systemd/system ]; then systemctl daemon-reload; fi

cat <<'NEXT'
Installed. Next, as root:
  1. Keys, made as the rumor user so it owns them (mode 0600):
       runuser -u rumor -- rumor keygen --cluster -o /etc/rumor/cluster.key   # once per cluster;
                                                    # copy the same file to every host
       runuser -u rumor -- rumor keygen -o /etc/rumor/bootstrap.key           # a bootstrap host
       runuser -u rumor -- rumor keygen -o /etc/rumor/peer-0.key              # one per peer instance
  2. Edit /etc/rumor/rumor.env (RUMOR_HOST, RUMOR_BOOTSTRAP, RUMOR_SHARDS, ...).
  3. systemctl enable --now rumor-bootstrap.service        # on bootstrap hosts
     systemctl enable --now rumor-peer@0.service           # peer 0 (port 7471)
  Status: systemctl status 'rumor-*'; logs: journalctl -u 'rumor-*' -f
  Guide: /usr/local/share/doc/rumor/operating.md
NEXT
