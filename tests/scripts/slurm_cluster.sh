#!/bin/bash
# Runs deploy/slurm/rumor.sbatch on a real, single-node Slurm cluster started
# on this machine, and checks that every one of its 4 peers reaches a test
# accuracy of at least 0.85. Then submits it again with checkpoints, cancels
# it (scancel) once the peers train, checks that every peer saved its
# checkpoint and left, resubmits it, and checks that every peer resumed from
# its checkpoint and finished with the same accuracy bound.
#
#   tests/scripts/slurm_cluster.sh RUMOR_BIN SOURCE_DIR [FMNIST_DIR]
#
# What it does: installs Debian's slurmctld, slurmd, slurm-client and munge
# (apt-get, as root) when they are missing; writes a munge key and a
# slurm.conf into a new temporary directory (its own ports, state, spool,
# logs and munge socket, so nothing of a Slurm installation already on the
# machine is used or touched); starts munged, slurmctld and slurmd by hand
# (no systemd), each in the foreground in the background, recording its PID;
# submits the job with 4 tasks (--overcommit: 4 tasks on the 2 CPUs it
# declares), waits for it with a deadline, checks the job's summary and every
# peer's result line; then cancels what is left, stops the daemons by PID and
# removes the directory, whatever happened.
#
# Exit status: 0 pass, 1 fail, 77 skip (not root, packages cannot be
# installed, the daemons do not come up here, or RUMOR_SKIP_SLURM is set),
# with the reason on stdout.
#
# Time: everything (apt-get included) is bounded by RUMOR_SLURM_TEST_BUDGET_S
# seconds (default 540, under ctest's 600 s timeout, so the script's own
# clean-up always runs). Measured on the 2-core development machine with the
# packages installed: about 35 s in all (the first job 16-18 s, the
# cancelled one 3 s, the resumed one 11 s).
set -u
t_end=$(($(date +%s) + ${RUMOR_SLURM_TEST_BUDGET_S:-540}))
left() { echo $((t_end - $(date +%s))); }
# min A B
min() { if [ "$1" -lt "$2" ]; then echo "$1"; else echo "$2"; fi; }

rumor=${1:?usage: $0 RUMOR_BIN SOURCE_DIR [FMNIST_DIR]}
src=${2:?usage: $0 RUMOR_BIN SOURCE_DIR [FMNIST_DIR]}
data=${3:-/usr/share/datasets/fashion-mnist}
ntasks=4
min_acc=0.85
# 4 peers on 1/4 of Fashion-MNIST each, sharing 2 cores: about 15 s of training.
# --finish-wait-ms: a peer that finishes first (it ran ahead of peers starved
# of CPU, or resumed at a later step: below) has spent its last steps
# averaging with replicas that the others' last averaging leaves behind, and
# would leave with that (0.849-0.866 seen for the resumed job, against
# 0.87-0.877 for the others); as for a straggler (docs/benchmarks.md), it
# keeps averaging until the last one finished.
peer_opts=(--epochs 3 --batch 64 --lr 0.1 --log-every 0 --max-local-steps 4 --finish-wait-ms 20000)

skip() { echo "SKIP: $*"; exit 77; }
fail() { echo "FAIL: $*"; exit 1; }
say() { echo "slurm_cluster: $*"; }

[ -z "${RUMOR_SKIP_SLURM:-}" ] || skip "RUMOR_SKIP_SLURM is set"
[ "$(id -u)" -eq 0 ] || skip "needs root: it installs Slurm with apt-get and runs slurmd"
[ -x "$rumor" ] || fail "no rumor binary at $rumor"
ls "$data"/train-images-idx3-ubyte* >/dev/null 2>&1 || skip "no Fashion-MNIST in $data"
rumor=$(readlink -f "$rumor")
sbatch_script=$(readlink -f "$src/deploy/slurm/rumor.sbatch")
[ -f "$sbatch_script" ] || fail "no $src/deploy/slurm/rumor.sbatch"

# --- packages -------------------------------------------------------------
pkgs="slurmctld slurmd slurm-client munge"
missing=""
for p in $pkgs; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing="$missing $p"
done
if [ -n "$missing" ]; then
  command -v apt-get >/dev/null || skip "no apt-get to install$missing"
  say "installing$missing"
  # The packages' maintainer scripts would start the system's own munge and
  # Slurm services; a policy-rc.d that denies every start keeps them off (only
  # ours, from a temporary directory, should run). Removed again if we made it.
  made_policy=""
  if [ ! -e /usr/sbin/policy-rc.d ]; then
    printf '#!/bin/sh\n# temporary, from rumor tests/scripts/slurm_cluster.sh\nexit 101\n' > /usr/sbin/policy-rc.d
    chmod 755 /usr/sbin/policy-rc.d
    made_policy=1
  fi
  export DEBIAN_FRONTEND=noninteractive
  # shellcheck disable=SC2086
  # apt-get gets at most what leaves 150 s for the daemons and the job.
  if ! timeout "$(min 240 $(($(left) - 150)))" apt-get install -y -q --no-install-recommends $missing \
    >/tmp/rumor-slurm-apt.$$ 2>&1; then
    timeout "$(min 120 $(($(left) - 200)))" apt-get update -q >>/tmp/rumor-slurm-apt.$$ 2>&1
    # shellcheck disable=SC2086
    timeout "$(min 240 $(($(left) - 150)))" apt-get install -y -q --no-install-recommends $missing \
      >>/tmp/rumor-slurm-apt.$$ 2>&1 || apt_failed=1
  fi
  [ -n "$made_policy" ] && rm -f /usr/sbin/policy-rc.d
  if [ -n "${apt_failed:-}" ]; then
    tail -n 5 /tmp/rumor-slurm-apt.$$
    rm -f /tmp/rumor-slurm-apt.$$
    skip "apt-get could not install$missing"
  fi
  rm -f /tmp/rumor-slurm-apt.$$
fi
for c in munged mungekey slurmctld slurmd sbatch squeue scontrol scancel sinfo; do
  command -v "$c" >/dev/null || skip "$c is not on PATH after installing $pkgs"
done

# --- a private Slurm cluster under one temporary directory ---------------
# 0755: munged insists that every directory above its socket is searchable.
T=$(mktemp -d /tmp/rumor-slurm.XXXXXX) || fail "mktemp"
chmod 755 "$T"
pids=""        # daemons we started, stopped by PID in cleanup
jobids=""      # jobs we submitted, cancelled in cleanup
cleanup() {
  set +e
  for j in $jobids; do
    scancel "$j" 2>/dev/null
    # Let slurmd end the job's steps (bounded) before it is stopped itself.
    for _ in $(seq 1 50); do
      [ -z "$(squeue -h -j "$j" 2>/dev/null)" ] && break
      sleep 0.2
    done
  done
  # Reverse order: slurmd, slurmctld, then munged.
  for p in $(echo "$pids" | tr ' ' '\n' | tac); do kill -TERM "$p" 2>/dev/null; done
  for p in $pids; do
    for _ in $(seq 1 50); do kill -0 "$p" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$p" 2>/dev/null
    wait "$p" 2>/dev/null
  done
  rm -rf "$T"
}
trap cleanup EXIT
trap 'exit 1' INT TERM HUP

dump_logs() {
  for f in "$T"/log/*.log; do
    [ -f "$f" ] || continue
    echo "--- last lines of $f"
    tail -n 15 "$f"
  done
  # The peers' own account: how each started, its warnings, and its end.
  for f in "$T"/job/run*/peer-*.log; do
    [ -f "$f" ] || continue
    echo "--- $f: start, warnings and last lines"
    grep -E "starting from|WARN|ERROR" "$f" | head -n 10
    tail -n 6 "$f"
  done
}
daemon_skip() { dump_logs; skip "$*"; }

mkdir -p "$T/munge" "$T/state" "$T/spool" "$T/log" "$T/job/keys"
chmod 755 "$T/munge"
# A free TCP port on this machine, not one of those already picked, in $port
# (not printed: a $(...) subshell would lose the record of those picked).
taken=""
free_port() {
  local p
  for p in $(shuf -i 20000-60000 -n 50); do
    case " $taken " in *" $p "*) continue ;; esac
    if [ -z "$(ss -Htln "sport = :$p" 2>/dev/null)" ]; then taken="$taken $p"; port=$p; return 0; fi
  done
  return 1
}
free_port || skip "no free TCP port"
ctld_port=$port
free_port || skip "no free TCP port"
slurmd_port=$port
node=$(hostname -s)
ncpu=2
mem_mb=$(awk '/^MemTotal:/ {print int($2 / 1024 / 2)}' /proc/meminfo)

mungekey --create --keyfile="$T/munge/munge.key" 2>"$T/log/mungekey.log" ||
  daemon_skip "mungekey could not create a key"
munged --foreground --key-file="$T/munge/munge.key" --socket="$T/munge/munge.socket" \
  --pid-file="$T/munge/munged.pid" --log-file="$T/log/munged.log" --seed-file="$T/munge/munged.seed" \
  >/dev/null 2>&1 &
pids="$pids $!"
for _ in $(seq 1 50); do [ -S "$T/munge/munge.socket" ] && break; sleep 0.1; done
munge -S "$T/munge/munge.socket" -n 2>/dev/null | unmunge -S "$T/munge/munge.socket" >/dev/null 2>&1 ||
  daemon_skip "munged did not start (see its log above)"

cat > "$T/slurm.conf" <<EOF
# Written by rumor's tests/scripts/slurm_cluster.sh: one node, this machine.
ClusterName=rumortest
SlurmctldHost=$node(127.0.0.1)
SlurmctldPort=$ctld_port
SlurmdPort=$slurmd_port
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$T/munge/munge.socket
StateSaveLocation=$T/state
SlurmdSpoolDir=$T/spool
SlurmctldPidFile=$T/slurmctld.pid
SlurmdPidFile=$T/slurmd.pid
SlurmctldLogFile=$T/log/slurmctld.log
SlurmdLogFile=$T/log/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
PlugStackConfig=$T/plugstack.conf
# No cgroups: linuxproc tracks a step's processes through /proc.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SwitchType=switch/none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
SlurmdParameters=config_overrides
KillWait=10
InactiveLimit=0
MinJobAge=300
NodeName=$node NodeAddr=127.0.0.1 CPUs=$ncpu RealMemory=$mem_mb State=UNKNOWN
PartitionName=rumor Nodes=$node Default=YES MaxTime=INFINITE State=UP
EOF
: > "$T/plugstack.conf"
export SLURM_CONF=$T/slurm.conf

slurmctld -D -f "$SLURM_CONF" -i >"$T/log/slurmctld.stdout" 2>&1 &
pids="$pids $!"
ok=""
for _ in $(seq 1 100); do
  scontrol ping 2>/dev/null | grep -q "UP" && { ok=1; break; }
  sleep 0.2
done
[ -n "$ok" ] || daemon_skip "slurmctld did not come up"
slurmd -D -f "$SLURM_CONF" -N "$node" >"$T/log/slurmd.stdout" 2>&1 &
pids="$pids $!"
ok=""
for _ in $(seq 1 150); do
  state=$(sinfo -h -n "$node" -o %T 2>/dev/null)
  case $state in idle*) ok=1; break ;; esac
  sleep 0.2
done
[ -n "$ok" ] || daemon_skip "slurmd did not register (node state '${state:-?}')"
say "Slurm is up: node $node ($ncpu CPUs), slurmctld on port $ctld_port, slurmd on port $slurmd_port"

# --- the job ---------------------------------------------------------------
# What is left of the budget, less 30 s for the clean-up; at most 300 s.
job_deadline_s=$(min 300 $(($(left) - 30)))
[ "$job_deadline_s" -gt 60 ] || skip "only $(left) s of the time budget left for the job"
chmod 700 "$T/job/keys"

# submit RUN_DIR [VAR=VALUE...]: submits the script with 4 tasks, the test's
# keys and peer options, and the environment given; sets $jobid.
submit() {
  local run=$1
  shift
  jobid=$(cd "$T/job" && env RUMOR="$rumor" RUMOR_KEYS="$T/job/keys" RUMOR_RUN_DIR="$run" RUMOR_IFACE=lo \
    RUMOR_DEVICE=cpu "$@" sbatch --parsable --ntasks=$ntasks --overcommit --time=10 \
    --output="$T/job/slurm-%j.out" "$sbatch_script" --data "$data" "${peer_opts[@]}" 2>"$T/log/sbatch.err") ||
    fail "sbatch refused the job: $(cat "$T/log/sbatch.err")"
  jobid=${jobid%%;*}
  jobids="$jobids $jobid"
  say "submitted job $jobid: $ntasks tasks, rumor peer ${peer_opts[*]}${*:+ ($*)}"
}
# wait_job: waits for $jobid to end, within what is left of job_deadline_s
# since $start; sets $jstate.
wait_job() {
  jstate=""
  while :; do
    jstate=$(scontrol show job "$jobid" 2>/dev/null | sed -n 's/.*JobState=\([A-Z_]*\).*/\1/p')
    case $jstate in
      PENDING | CONFIGURING | RUNNING | COMPLETING | "") ;;
      *) break ;;
    esac
    if [ $(($(date +%s) - start)) -gt "$job_deadline_s" ]; then
      echo "--- job output so far"; cat "$T/job/slurm-$jobid.out" 2>/dev/null
      dump_logs
      fail "job $jobid still $jstate after ${job_deadline_s}s"
    fi
    sleep 1
  done
}

start=$(date +%s)
submit "$T/job/run"
wait_job
elapsed=$(($(date +%s) - start))
say "job $jobid ended $jstate after ${elapsed}s; its output:"
sed 's/^/  | /' "$T/job/slurm-$jobid.out" 2>/dev/null

# --- checks ----------------------------------------------------------------
problems=0
for ((r = 0; r < ntasks; r++)); do
  out=$T/job/run/peer-$r.out
  line=$(grep '"test_accuracy"' "$out" 2>/dev/null | tail -n1)
  acc=$(echo "$line" | sed -n 's/.*"test_accuracy":\([0-9.]*\).*/\1/p')
  if [ -z "$acc" ]; then
    echo "peer $r: no result line in $out; last lines of its log:"
    tail -n 10 "$T/job/run/peer-$r.log" 2>/dev/null | sed 's/^/  | /'
    problems=$((problems + 1))
  elif awk -v a="$acc" -v m="$min_acc" 'BEGIN { exit !(a >= m) }'; then
    say "peer $r: test accuracy $acc >= $min_acc"
  else
    echo "peer $r: test accuracy $acc < $min_acc"
    problems=$((problems + 1))
  fi
done
# Each task trained its own shard under its own identity, and the bootstrap
# node was stopped with SIGTERM (so it told the cluster it left), not killed.
ids=$(sed -n 's/.*"test_accuracy".*"id":"\([^"]*\)".*/\1/p' "$T"/job/run/peer-*.out 2>/dev/null | sort -u | wc -l)
[ "$ids" -eq "$ntasks" ] || { echo "$ids distinct peer identities, expected $ntasks"; problems=$((problems + 1)); }
for ((r = 0; r < ntasks; r++)); do
  grep -q "shard $r/$ntasks" "$T/job/run/peer-$r.log" 2>/dev/null ||
    { echo "peer $r did not train shard $r/$ntasks"; problems=$((problems + 1)); }
done
grep -q "stopping (signal 15)" "$T/job/run/bootstrap.log" 2>/dev/null ||
  { echo "the bootstrap node did not stop on SIGTERM"; problems=$((problems + 1)); }
[ -f "$T/job/run/summary.tsv" ] || { echo "the job wrote no summary.tsv"; problems=$((problems + 1)); }
[ "$jstate" = COMPLETED ] || { echo "job state $jstate, not COMPLETED"; problems=$((problems + 1)); }
for k in cluster bootstrap peer-0 peer-1 peer-2 peer-3; do
  [ -f "$T/job/keys/$k.key" ] || { echo "the job made no $k.key"; problems=$((problems + 1)); }
done
if [ "$problems" -ne 0 ]; then
  dump_logs
  fail "$problems problem(s) with the Slurm job"
fi
say "$ntasks peers under Slurm, each with test accuracy >= $min_acc (job took ${elapsed}s)"

# --- scancel, then resubmit: the peers resume from their checkpoints --------
# The job is cancelled once every peer trains; Slurm's SIGTERM must make each
# peer save its checkpoint and leave, and the resubmitted job must resume
# every peer from its checkpoint and finish the run with the same accuracy.
ck=$T/job/checkpoints
# budget_job: the next job's deadline, from what is left of the time budget.
budget_job() {
  job_deadline_s=$(min 300 $(($(left) - 30)))
  [ "$job_deadline_s" -gt 30 ] || fail "the time budget (RUMOR_SLURM_TEST_BUDGET_S) ran out"
}
budget_job
start=$(date +%s)
submit "$T/job/run2" RUMOR_CHECKPOINT_DIR="$ck"
for ((r = 0; r < ntasks; r++)); do
  until grep -q "peers ready: starting" "$T/job/run2/peer-$r.log" 2>/dev/null; do
    [ $(($(date +%s) - start)) -le 120 ] || { dump_logs; fail "peer $r of job $jobid did not start training"; }
    sleep 0.5
  done
done
sleep 1
scancel "$jobid"
wait_job
say "job $jobid cancelled while training: $jstate"
for ((r = 0; r < ntasks; r++)); do
  grep -q "signal 15: leaving the cluster" "$T/job/run2/peer-$r.log" 2>/dev/null ||
    { echo "peer $r did not leave on scancel's SIGTERM"; problems=$((problems + 1)); }
  [ -f "$ck/peer-$r.safetensors" ] || { echo "peer $r saved no checkpoint on SIGTERM"; problems=$((problems + 1)); }
  grep -q "\"test_accuracy\"" "$T/job/run2/peer-$r.out" 2>/dev/null &&
    { echo "peer $r finished before the job was cancelled (test too slow to interrupt it)"; problems=$((problems + 1)); }
done
grep -q "stopping (signal 15)" "$T/job/run2/bootstrap.log" 2>/dev/null ||
  { echo "the bootstrap node did not stop on scancel's SIGTERM"; problems=$((problems + 1)); }
[ "$problems" -eq 0 ] || { dump_logs; fail "$problems problem(s) when the job was cancelled"; }
budget_job
start=$(date +%s)
# The peers resume at different steps (each saved its checkpoint at its own
# step when the SIGTERM came): --finish-wait-ms (peer_opts) matters most here.
submit "$T/job/run3" RUMOR_CHECKPOINT_DIR="$ck"
wait_job
elapsed2=$(($(date +%s) - start))
say "resubmitted job $jobid ended $jstate after ${elapsed2}s"
for ((r = 0; r < ntasks; r++)); do
  grep -q "starting from the checkpoint" "$T/job/run3/peer-$r.log" 2>/dev/null ||
    { echo "peer $r did not resume from its checkpoint"; problems=$((problems + 1)); }
  acc=$(sed -n 's/.*"test_accuracy":\([0-9.]*\).*/\1/p' "$T/job/run3/peer-$r.out" 2>/dev/null | tail -n1)
  if [ -n "$acc" ] && awk -v a="$acc" -v m="$min_acc" 'BEGIN { exit !(a >= m) }'; then
    say "peer $r resumed: test accuracy $acc >= $min_acc"
  else
    echo "peer $r resumed: test accuracy '${acc:-none}', not >= $min_acc"
    problems=$((problems + 1))
  fi
done
[ "$jstate" = COMPLETED ] || { echo "resubmitted job state $jstate, not COMPLETED"; problems=$((problems + 1)); }
[ "$problems" -eq 0 ] || { dump_logs; fail "$problems problem(s) with the resumed job"; }
say "PASS: $ntasks peers under Slurm, each with test accuracy >= $min_acc (job took ${elapsed}s);" \
  "scancel saved every peer's checkpoint, and the resubmitted job resumed and finished (${elapsed2}s)"
