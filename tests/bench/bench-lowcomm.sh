#!/bin/sh
# Low-communication training side by side (issue #29): all-reduce and gossip
# every step against DiLoCo and NoLoCo (with compression and overlap), on
# loopback and on slow test hosts; see tests/bench/bench_lowcomm.py for the
# rows, the targets and the environment it reads.
#
#   tests/bench/bench-lowcomm.sh [BUILD_DIR]
set -eu
exec python3 "$(dirname "$0")/bench_lowcomm.py" "$@"
