#!/bin/sh
# Reads rumor's TensorBoard event files with TensorBoard's own loader
# (issue #17, item 1): makes a virtual environment with the `tensorboard`
# package from PyPI, then runs tests/bench/tensorboard_check.py, which loads
# every run under LOGDIR with EventAccumulator and prints its scalars.
#
#   tests/bench/tensorboard-check.sh LOGDIR [tensorboard_check.py options]
#   e.g. tests/bench/tensorboard-check.sh /tmp/tb --expect train:eval/test_accuracy=0.6375
#
# Without LOGDIR's runs at hand, `--demo` trains a few steps with
# build/peer/rumor (RUMOR, or build/peer/rumor) into a fresh LOGDIR and
# checks the result line's test accuracy against the file.
#
#   env: TB_VENV (build/tensorboard-venv), TENSORBOARD_VERSION (any),
#        PYTHON (/usr/bin/python3), RUMOR (build/peer/rumor)
set -eu
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
venv=${TB_VENV:-$root/build/tensorboard-venv}
python=${PYTHON:-/usr/bin/python3}
die() { echo "tensorboard-check.sh: $*" >&2; exit 1; }
[ $# -ge 1 ] || { echo "usage: $0 LOGDIR [--expect RUN:TAG=VALUE ...] | --demo" >&2; exit 2; }

check() {
  [ -x "$1/bin/python" ] && "$1/bin/python" -c \
    'import tensorboard; from tensorboard.backend.event_processing import event_accumulator; print(tensorboard.__version__)' 2>/dev/null
}

if ! have=$(check "$venv"); then
  "$python" -c 'import venv, ensurepip' 2>/dev/null || die "$python cannot make virtual environments: apt-get install python3-venv"
  echo "tensorboard-check.sh: making $venv with tensorboard${TENSORBOARD_VERSION:+==$TENSORBOARD_VERSION} from PyPI" >&2
  rm -rf "$venv"
  mkdir -p "$(dirname "$venv")"
  "$python" -m venv "$venv" || die "$python -m venv $venv failed"
  "$venv/bin/pip" install --disable-pip-version-check --progress-bar off \
    "tensorboard${TENSORBOARD_VERSION:+==$TENSORBOARD_VERSION}" > "$venv/pip.log" 2>&1 ||
    { tail -20 "$venv/pip.log" >&2; die "pip install tensorboard failed (log: $venv/pip.log)"; }
  have=$(check "$venv") || die "tensorboard installed in $venv but its loader does not import"
fi
echo "tensorboard-check.sh: tensorboard $have in $venv" >&2

if [ "$1" = "--demo" ]; then
  rumor=${RUMOR:-$root/build/peer/rumor}
  [ -x "$rumor" ] || die "no rumor binary at $rumor (set RUMOR)"
  logdir=$(mktemp -d /tmp/rumor-tb-XXXXXX)
  out=$("$rumor" train --model mlp:784-16-10 --shard 0/200 --batch 32 --epochs 3 --eval-every 4 --eval-batches 5 \
    --threads 1 --log-every 0 --tensorboard "$logdir")
  echo "rumor train: $out" >&2
  acc=$(echo "$out" | sed -n 's/.*"test_accuracy": *\([0-9.eE+-]*\).*/\1/p')
  loss=$(echo "$out" | sed -n 's/.*"train_loss": *\([0-9.eE+-]*\).*/\1/p')
  exec "$venv/bin/python" "$here/tensorboard_check.py" "$logdir" \
    --expect "train:eval/test_accuracy=$acc" --expect "train:train/loss_avg=$loss"
fi
exec "$venv/bin/python" "$here/tensorboard_check.py" "$@"
