#!/bin/sh
# Makes the README's monitoring pictures from a live 4-peer run of the main
# job on this machine (deploy/local-cluster.sh), watched three ways:
#
#   docs/top-terminal.png  `rumor top` in a terminal: its text, drawn by
#                          headless Chromium in a monospace font
#   docs/top-web.png       `rumor top --web`, as headless Chromium renders it
#   docs/tensorboard.png   TensorBoard (from PyPI, in the virtual environment
#                          of tests/bench/tensorboard-check.sh) over the
#                          peers' and top's --tensorboard files
#
#   docs/make-pictures.sh        env: RUMOR (build/peer/rumor), SECONDS_LIVE
#                                (how long the run is watched first, 25),
#                                EPOCHS (the run's, 40: longer than the
#                                watch), TB_VENV (build/tensorboard-venv)
# Needs chromium (deploy/install-deps.sh installs it) and PyPI for TensorBoard.
set -eu
cd "$(dirname "$0")/.."
root=$(pwd)
rumor=${RUMOR:-build/peer/rumor}
live=${SECONDS_LIVE:-25}
venv=${TB_VENV:-$root/build/tensorboard-venv}
[ -x "$rumor" ] || { echo "make-pictures.sh: no $rumor; build first" >&2; exit 1; }
command -v chromium >/dev/null || { echo "make-pictures.sh: chromium is missing (deploy/install-deps.sh)" >&2; exit 1; }
work=$(mktemp -d)
pids=""
cleanup() {
  for p in $pids; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT INT TERM
shot() { # URL FILE WIDTH HEIGHT [virtual ms]
  chromium --headless --no-sandbox --disable-gpu --hide-scrollbars --window-size="$3,$4" \
    --virtual-time-budget="${5:-5000}" --screenshot="$2" "$1" >/dev/null 2>&1
  echo "make-pictures.sh: $2 ($(($(wc -c < "$2") / 1024)) KiB)" >&2
}

# The run: the README's main job (longer), with TensorBoard files.
EPOCHS=${EPOCHS:-40} WORKDIR=$work/cluster RUMOR=$rumor deploy/local-cluster.sh 4 -- --tensorboard "$work/tb" > "$work/cluster.out" 2>&1 &
pids="$pids $!"
for _ in $(seq 1 100); do grep -q "bootstrap node on" "$work/cluster.out" && break; sleep 0.1; done
boot=$(sed -n 's/^bootstrap node on \([^;]*\);.*/\1/p' "$work/cluster.out")
[ -n "$boot" ] || { cat "$work/cluster.out" >&2; exit 1; }
"$rumor" keygen -o "$work/monitor.key" >/dev/null 2>&1
watch="--bootstrap $boot --cluster-key $work/cluster/cluster.key --identity $work/monitor.key"
# shellcheck disable=SC2086
"$rumor" top $watch --interval 1 --web 127.0.0.1:0 --tensorboard "$work/tb" > /dev/null 2> "$work/top.err" &
pids="$pids $!"
sleep "$live"
url=$(grep -o 'http://127.0.0.1:[0-9]*/' "$work/top.err" | head -1)
[ -n "$url" ] || { cat "$work/top.err" >&2; exit 1; }
shot "$url" docs/top-web.png 1200 640

# The terminal view: one refresh of the table, drawn as a terminal would.
# shellcheck disable=SC2086
"$rumor" top $watch --once > "$work/top.txt"
{
  printf '<!doctype html><meta charset="utf-8"><body style="margin:0;background:#1e1e1e">'
  printf '<pre style="margin:0;padding:12px;color:#d4d4d4;font:13px DejaVu Sans Mono,monospace">'
  printf '$ rumor top --bootstrap %s --cluster-key cluster.key --identity monitor.key\n' "$boot"
  sed 's/&/\&amp;/g; s/</\&lt;/g; s/>/\&gt;/g' "$work/top.txt"
  printf '</pre>'
} > "$work/top.html"
lines=$(($(wc -l < "$work/top.txt") + 2))
shot "file://$work/top.html" docs/top-terminal.png 1400 $((lines * 17 + 24)) 1000

# TensorBoard over the files written so far.
tests/bench/tensorboard-check.sh "$work/tb" > "$work/tb-check.txt"
"$venv/bin/tensorboard" --logdir "$work/tb" --host 127.0.0.1 --port 0 > "$work/tb.out" 2>&1 &
pids="$pids $!"
tb=""
for _ in $(seq 1 300); do
  tb=$(grep -o 'http://127.0.0.1:[0-9]*/' "$work/tb.out" | head -1) && [ -n "$tb" ] && break
  sleep 0.1
done
[ -n "$tb" ] || { cat "$work/tb.out" >&2; exit 1; }
# The Scalars dashboard: its charts draw without WebGL (the Time Series
# one's do not in headless Chromium).
shot "${tb}#scalars&tagFilter=xi%7Cmean_loss%7Closs_avg%7Ctest_accuracy" docs/tensorboard.png 1400 900 10000
