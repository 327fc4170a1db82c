#!/bin/sh
# Runs a command in a CPU cgroup of its own, limited to PERCENT of one CPU
# (100: one whole core): the straggler condition of bench-sync.sh gives
# every worker the same share of the host, as if each had its own machine,
# so a slow worker's idle time is not handed to the others.
#
#   tests/bench/cpu-cap.sh PERCENT NAME COMMAND [ARG...]
#   tests/bench/cpu-cap.sh --check      exit 0 when caps can be set here
#   tests/bench/cpu-cap.sh --remove     remove the groups this script made
#
# cgroup v2 (cpu.max) or v1 (the cpu controller's cfs quota), as root. The
# group is /sys/fs/cgroup[/cpu]/rumor-bench-NAME; a second run with the same
# NAME reuses it.
set -eu
period=100000 # microseconds

base() {
  if [ -f /sys/fs/cgroup/cgroup.controllers ]; then
    grep -qw cpu /sys/fs/cgroup/cgroup.controllers || return 1
    echo /sys/fs/cgroup
  elif [ -f /sys/fs/cgroup/cpu/cpu.cfs_quota_us ]; then
    echo /sys/fs/cgroup/cpu
  else
    return 1
  fi
}

case "${1:-}" in
--check)
  b=$(base) || { echo "cpu-cap.sh: no cgroup cpu controller here" >&2; exit 1; }
  d=$b/rumor-bench-check
  if ! mkdir -p "$d" 2>/dev/null || ! rmdir "$d" 2>/dev/null; then
    echo "cpu-cap.sh: cannot make a cgroup in $b (root?)" >&2
    exit 1
  fi
  exit 0 ;;
--remove)
  b=$(base) || exit 0
  for d in "$b"/rumor-bench-*; do
    if [ -d "$d" ]; then rmdir "$d" 2>/dev/null || true; fi
  done
  exit 0 ;;
esac

[ $# -ge 3 ] || { echo "usage: cpu-cap.sh PERCENT NAME COMMAND [ARG...]" >&2; exit 2; }
pct=$1 name=$2
shift 2
case "$pct" in '' | *[!0-9]*) echo "cpu-cap.sh: PERCENT must be a whole number, not '$pct'" >&2; exit 2 ;; esac
[ "$pct" -ge 1 ] || { echo "cpu-cap.sh: PERCENT must be at least 1" >&2; exit 2; }
b=$(base) || { echo "cpu-cap.sh: no cgroup cpu controller here" >&2; exit 1; }
d=$b/rumor-bench-$name
mkdir -p "$d"
quota=$((pct * period / 100))
if [ "$b" = /sys/fs/cgroup ]; then
  grep -qw cpu "$b/cgroup.subtree_control" || echo +cpu > "$b/cgroup.subtree_control"
  echo "$quota $period" > "$d/cpu.max"
else
  echo "$period" > "$d/cpu.cfs_period_us"
  echo "$quota" > "$d/cpu.cfs_quota_us"
fi
echo $$ > "$d/cgroup.procs"
exec "$@"
