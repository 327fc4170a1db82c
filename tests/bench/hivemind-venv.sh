#!/bin/sh
# Makes the Python environment of tests/bench/hivemind_fmnist.py, the
# decentralized anchor of tests/bench/bench-sync.sh (issue #16, item 4):
# Hivemind 1.1 from PyPI on Debian's PyTorch.
#
#   tests/bench/hivemind-venv.sh DIR
#
# DIR becomes a virtual environment of /usr/bin/python3 (Debian 12's Python
# 3.11) made with --system-site-packages, so that Debian's python3-torch
# (1.13, CPU) and python3-numpy (1.24) serve it instead of a multi-GB torch
# wheel; only hivemind and its pure-Python or small dependencies come from
# PyPI. Does nothing when DIR already works (hivemind 1.1.x imports, torch is
# there, numpy is 1.x and the bundled p2pd daemon runs). The last line of a
# failure says why, in one line.
#
# Which Hivemind: 1.1.10 (1.1.10.post2) is on PyPI only as a source archive
# whose setup.py downloads the p2pd daemon (go-libp2p-daemon v0.3.18) from
# GitHub's release page at build time, with no option or variable to skip it
# (--buildgo downloads the Go source from GitHub instead), so it cannot be
# installed where only PyPI is reachable. 1.1.9 (and 1.1.0 to 1.1.8) has a
# wheel with p2pd inside it; so has 1.1.12 (1.1.11 is yanked);
# HIVEMIND_VERSION picks another version.
#
#   env: HIVEMIND_VERSION (1.1.9), PYTHON (/usr/bin/python3)
set -eu
dir=${1:-}
[ -n "$dir" ] || { echo "usage: $0 DIR" >&2; exit 2; }
version=${HIVEMIND_VERSION:-1.1.9}
python=${PYTHON:-/usr/bin/python3}
die() { echo "hivemind-venv.sh: $*" >&2; exit 1; }

# Whether $1 is a working environment: prints what it has, or fails.
check() {
  [ -x "$1/bin/python" ] || return 1
  "$1/bin/python" - "$version" <<'EOF' 2>/dev/null
import os, subprocess, sys
import numpy, torch, hivemind
want = sys.argv[1]
assert hivemind.__version__ == want or hivemind.__version__.startswith(want + "."), hivemind.__version__
assert numpy.__version__.split(".")[0] == "1", "numpy %s: torch 1.13 needs numpy 1.x" % numpy.__version__
p2pd = os.path.join(os.path.dirname(hivemind.__file__), "hivemind_cli", "p2pd")
assert os.access(p2pd, os.X_OK), p2pd + " is missing"
r = subprocess.run([p2pd, "-help"], capture_output=True)
assert b"hostAddrs" in r.stdout + r.stderr, "p2pd does not run"
print("hivemind %s, torch %s, numpy %s, p2pd %s" % (hivemind.__version__, torch.__version__, numpy.__version__, p2pd))
EOF
}

if have=$(check "$dir"); then
  echo "hivemind-venv.sh: $dir is ready ($have)"
  exit 0
fi

[ -x "$python" ] || die "$python is missing (Debian's python3)"
"$python" -c 'import venv, ensurepip' 2>/dev/null ||
  die "$python cannot make virtual environments: apt-get install python3-venv"
"$python" -c 'import torch, numpy' 2>/dev/null ||
  die "$python has no PyTorch: apt-get install python3-torch python3-numpy (deploy/install-deps.sh)"

echo "hivemind-venv.sh: making $dir: hivemind $version from PyPI on $("$python" -c 'import torch; print("torch", torch.__version__)') from Debian"
rm -rf "$dir"
mkdir -p "$(dirname "$dir")"
"$python" -m venv --system-site-packages "$dir" || die "python3 -m venv $dir failed"

# Pins. For every version: numpy 2 breaks torch 1.13's tensor <-> numpy
# bridge (which hivemind's serialisation uses), and so does the latest scipy's
# need for it. For 1.1.9 and older, its own era's dependencies as well:
# hivemind's generated *_pb2.py predate protobuf 5, pydantic 2 is not
# accepted, and multiaddr later than 0.0.9 is not what it was tested with
# (1.1.11 bundles its own); it imports packaging without requiring it (1.1.10
# added it). 1.1.12 resolves to protobuf 7, pydantic 2 and grpcio-tools 1.85
# and ran a short job on torch 1.13 here too.
printf 'numpy<2\nscipy<1.16\n' > "$dir/constraints.txt"
extra=""
case $version in
1.1.[0-9] | 1.1.[0-9].* | 1.0.*)
  printf 'protobuf<5\ngrpcio-tools<1.63\nmultiaddr==0.0.9\npydantic<2\n' >> "$dir/constraints.txt"
  extra=packaging ;;
esac
# A source archive's build (1.1.10) needs pkg_resources, gone from the newest
# setuptools; PIP_CONSTRAINT reaches pip's isolated build environments too.
echo 'setuptools<70' > "$dir/build-constraints.txt"
# shellcheck disable=SC2086
if ! PIP_CONSTRAINT=$dir/build-constraints.txt "$dir/bin/pip" install --disable-pip-version-check --progress-bar off -c "$dir/constraints.txt" \
  "hivemind==$version" $extra > "$dir/pip.log" 2>&1; then
  tail -25 "$dir/pip.log" >&2
  if grep -q "go-libp2p-daemon" "$dir/pip.log"; then
    die "hivemind $version's build downloads p2pd from GitHub, which is not reachable (only PyPI is); use a version with a wheel, e.g. HIVEMIND_VERSION=1.1.9"
  fi
  die "pip install hivemind==$version failed (log: $dir/pip.log): $(grep -E '^ERROR|error:' "$dir/pip.log" | tail -1)"
fi
have=$(check "$dir") || {
  "$dir/bin/python" -c 'import hivemind, torch, numpy' 2>&1 | tail -5 >&2
  die "hivemind $version installed in $dir but does not work (above)"
}
echo "hivemind-venv.sh: $dir is ready ($have)"
