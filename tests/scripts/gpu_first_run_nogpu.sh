#!/bin/sh
# tests/bench/gpu-first-run.sh where there is no GPU (about 1 s): it says so
# and exits 77 without writing a report; and with a GPU listed that rumor
# cannot use (a fake nvidia-smi first on PATH), it writes a report that
# ends in a failing verdict naming the reason, and exits 1. On a machine
# with a GPU this test skips: run the script itself there.
#
#   tests/scripts/gpu_first_run_nogpu.sh SOURCE_DIR BUILD_DIR
#
# Exit status: 0 pass, 1 fail, 77 skip.
set -u
src=${1:?usage: $0 SOURCE_DIR BUILD_DIR}
build=${2:?usage: $0 SOURCE_DIR BUILD_DIR}
script=$src/tests/bench/gpu-first-run.sh
if [ -n "$(nvidia-smi -L 2>/dev/null | head -1)" ]; then
  echo "SKIP: this machine has a GPU: run $script itself"
  exit 77
fi
T=$(mktemp -d /tmp/rumor-gpu-first-run-test.XXXXXX) || exit 1
trap 'rm -rf "$T"' EXIT
fail() { echo "FAIL: $*"; exit 1; }

REPORT=$T/none.txt "$script" "$build" >"$T/out" 2>&1
rc=$?
[ $rc = 77 ] || fail "without a GPU: exit $rc, want 77: $(cat "$T/out")"
grep -q "no GPU on this machine" "$T/out" || fail "without a GPU: no clear message: $(cat "$T/out")"
[ ! -e "$T/none.txt" ] || fail "without a GPU a report was written"

mkdir "$T/bin"
printf '#!/bin/sh\necho "GPU 0: Fake GPU (UUID: GPU-test)"\n' >"$T/bin/nvidia-smi"
chmod +x "$T/bin/nvidia-smi"
PATH=$T/bin:$PATH REPORT=$T/report.txt "$script" "$build" >"$T/out" 2>&1
rc=$?
[ $rc = 1 ] || fail "a GPU rumor cannot use: exit $rc, want 1: $(cat "$T/out")"
grep -q "Fake GPU" "$T/report.txt" || fail "the report does not name the GPU: $(cat "$T/report.txt")"
tail -1 "$T/report.txt" | grep -q "^VERDICT: FAIL (rumor cannot use the GPU)" ||
  fail "the report's last line is not the verdict: $(cat "$T/report.txt")"
echo "PASS"
