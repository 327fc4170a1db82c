#!/bin/bash
# Chaos (issue #30, item 3): PEERS peers train a job while a random fault
# hits one of them every FAULT_EVERY seconds, beside a fault-free run of the
# same job in the same run of this script.
#
#   tests/bench/bench-chaos.sh [BUILD_DIR]
#
# Jobs (JOBS): mlp, the README's main job (mlp:784-512-256-10 on Fashion-
# MNIST, each peer on 1/PEERS of it with batch 128/PEERS (at least 16), SGD
# with momentum and a cosine schedule, gossiping peers with
# --max-local-steps 4; learning rate 0.05, and under diloco and noloco
# 0.05 * sqrt(batch / 128): see mlp_lr), and gpt, a short language-model job
# (gpt:L2-H2-C64-T64-V256 on the byte-level King James Bible with AdamW, the
# settings of bench-lowcomm.sh). The job is sized so that its fault-free run
# trains about DURATION seconds: a short probe run (no faults) measures the
# cluster's samples per second and sets the epochs (mlp) or steps (gpt);
# EPOCHS or STEPS fix them instead. Both runs of a job do the same work.
#
# Schemes (SCHEMES): gossip (--sync gossip), allreduce (--sync allreduce),
# diloco (--sync allreduce --outer nesterov: the ring once every 50 steps)
# and noloco (--sync gossip --outer nesterov).
#
# Every peer runs on a test host of its own (deploy/testnet.sh: network
# namespaces; the bootstrap node on host 1, peer i on host i+1, none of them
# reachable from outside), with its own identity key and a checkpoint file
# saved about every CKPT_SECS seconds (--checkpoint-every, from the probe's
# rate). Once every peer trains, every FAULT_EVERY seconds one fault is
# drawn (SEED: the kinds come from a shuffled deck, so that every kind comes
# once in each round of draws; a kind no peer can take now is drawn again
# next time) and hits one peer drawn among those training and under no
# other fault:
#
#   kill   kill -9, then at once a restart with --resume, the same identity
#          key, address, shard and checkpoint file
#   stop   SIGSTOP for STOP_S (10) seconds, then SIGCONT
#   cut    the peer's host cut off from the network for CUT_S (10) seconds
#          (testnet.sh cut / heal)
#   loss   LOSS_PCT (5) % loss on what the peer's host sends, for LOSS_S (30)
#          seconds (testnet.sh shape H loss 5, then shape H)
#   relay  the relay peer killed with kill -9 and restarted like kill; only
#          where `rumor peer --help` lists --no-inbound: then peers 1 and 2
#          run with --no-inbound (reached through a relay; they join
#          through peer 3 first, then the bootstrap node) and peer 3 with
#          --relay, in both runs
#
# Faults go on until the chaos run has finished (every peer done). What is
# measured, for each job and scheme, fault-free beside chaos:
#
#   throughput    training samples per second of the cluster: the samples
#                 in every peer's final checkpoint (what its replica was
#                 trained on; steps redone after a restart from a checkpoint
#                 count once, and a member out of an all-reduce ring
#                 contributes nothing while out) over the wall time from the
#                 first peer's first step to the last peer's end of
#                 training. Retained: chaos / fault-free. Target >= 95 %
#                 for gossip and noloco, >= 85 % for allreduce and diloco.
#   quality       final test accuracy (mlp) or validation loss (gpt) of every
#                 peer's last process; the mean. Target: within 0.5 point
#                 (mlp) or 0.05 (gpt) of fault-free.
#   lost          checkpoints lost: restarts with --resume that did not
#                 resume, or resumed from a step older than the last
#                 checkpoint the killed process logged as saved (from
#                 FILE.prev, say; such fallbacks are also counted apart).
#                 Target 0.
#   crashes       processes (peers, restarted peers, the bootstrap node)
#                 that exited non-zero or by a signal this script did not
#                 send. Target 0.
#   RSS, fds      of the long-lived processes (the bootstrap node and every
#                 peer never killed), sampled every SAMPLE_S seconds from
#                 /proc (VmRSS, entries of fd/): growth from the first
#                 sample after the warm-up (the first WARMUP seconds of
#                 training: buffers and allocator arenas grow until then)
#                 to the last one before the process ended its training.
#                 "Flat": every one grew less than 10 % (as
#                 tests/scripts/soak.sh). fd growth is reported, with no
#                 target. The host's load average is sampled beside (on a
#                 shared machine other work moves the throughput figures).
#
# Environment: DURATION (600 s), SEED (1), PEERS (8), SCHEMES ("gossip
# allreduce diloco"), JOBS ("mlp gpt"), FAULT_EVERY (15 s), FAULTS (the kinds
# to draw from: "kill stop cut loss relay"), WARMUP (DURATION / 5, 5 to
# 120 s), STOP_S (10), CUT_S (10), LOSS_S (30), LOSS_PCT (5), CKPT_SECS (5),
# SAMPLE_S (2), EPOCHS, STEPS, MLP_LR (the MLP job's learning rate under
# every scheme), PEER_ARGS (more options for every peer),
# RUN_TIMEOUT (per run, default 3 * DURATION + 120 s: then the peers left
# are sent SIGTERM), OUT (a directory, default bench-chaos: report.txt,
# bench-chaos.csv (a row per run, ending with the day and the machine),
# faults.csv, samples.csv (run, t, node, process, pid,
# rss_kb, fds; node "load": the load average in rss_kb's place) and every
# process's log under runs/), CKPT_EVERY (steps between checkpoints, instead
# of CKPT_SECS), RUMOR (the binary; default BUILD_DIR/peer/rumor), DATA (Fashion-
# MNIST directory), CORPUS (text for gpt; made with deploy/make-corpus.sh
# when missing), KEEP_CKPT=1 (keep the checkpoints).
#
# Exit status: 0 when every run finished (the targets are reported, not
# enforced), 1 on a failure to run, 77 where test hosts cannot be made here
# (the reason on stderr).
set -u
src=$(cd "$(dirname "$0")/../.." && pwd)
build=${1:-$src/build}
[ -d "$build" ] && build=$(cd "$build" && pwd)
rumor=${RUMOR:-$build/peer/rumor}
duration=${DURATION:-600}
seed=${SEED:-1}
peers=${PEERS:-8}
schemes=${SCHEMES:-gossip allreduce diloco}
jobs=${JOBS:-mlp gpt}
every=${FAULT_EVERY:-15}
kinds=${FAULTS:-kill stop cut loss relay}
warmup=${WARMUP:-$((duration / 5 < 5 ? 5 : duration / 5 > 120 ? 120 : duration / 5))}
stop_s=${STOP_S:-10} cut_s=${CUT_S:-10} loss_s=${LOSS_S:-30} loss_pct=${LOSS_PCT:-5}
ckpt_secs=${CKPT_SECS:-5}
sample_s=${SAMPLE_S:-2}
run_timeout=${RUN_TIMEOUT:-$((3 * duration + 120))}
out=${OUT:-bench-chaos}
data=${DATA:-/usr/share/datasets/fashion-mnist}
corpus=${CORPUS:-/usr/local/share/rumor/kjv.txt}
testnet=$src/deploy/testnet.sh
# testnet.sh runs from the source root: the switch's path must be absolute.
TESTNET_NETSIM=${TESTNET_NETSIM:-$build/tests/netsim/netsim}
[ -e "$TESTNET_NETSIM" ] && TESTNET_NETSIM=$(readlink -f "$TESTNET_NETSIM")
export TESTNET_NETSIM

die() { echo "bench-chaos.sh: $*" >&2; exit 1; }
say() { echo "$*" | tee -a "$out/report.txt"; }
[ -x "$rumor" ] || die "build first: $rumor is missing"
rumor=$(readlink -f "$rumor")
case $peers in ''|*[!0-9]*) die "PEERS must be a number";; esac
[ "$peers" -ge 2 ] && [ "$peers" -le 50 ] || die "PEERS must be 2..50"
# Test hosts, or a skip with testnet.sh's reason.
why=$("$testnet" check 2>&1)
rc=$?
if [ "$rc" = 77 ]; then echo "bench-chaos.sh: skipped: $why" >&2; exit 77; fi
[ "$rc" = 0 ] || die "testnet.sh check failed: $why"
mkdir -p "$out/runs" || die "cannot make $out"
out=$(cd "$out" && pwd)
: > "$out/report.txt"

# Relays exist in this build when `rumor peer --help` mentions --no-inbound.
relays=false
"$rumor" peer --help 2>&1 | grep -q -- '--no-inbound' && relays=true
# With relays (and 4 peers or more), in every run: peers 1 and 2 only dial
# out (--no-inbound: reached through a relay), peer 3 relays (--relay).
roles=false
$relays && [ "$peers" -ge 4 ] && roles=true
deck_kinds=""
for k in $kinds; do
  case $k in
  kill | stop | cut | loss) deck_kinds="$deck_kinds $k" ;;
  relay) if $roles; then deck_kinds="$deck_kinds relay"
    elif $relays; then say "relay fault skipped: it needs 4 peers or more"
    else say "relay fault skipped: this build has no relays"; fi ;;
  *) die "unknown fault kind '$k' (kill stop cut loss relay)" ;;
  esac
done
[ -n "$deck_kinds" ] || die "no fault kinds to draw from (FAULTS='$kinds')"

# ---- clean-up: every process we started, then the test network ----------
net=rcx$$
export TESTNET_NAME=$net TESTNET_OWNER=$$
# The processes of the run in progress: every one runs in a test host's
# namespace, and `testnet.sh down` kills whatever runs there too.
declare -a pid
boot_pid=""
cleanup() {
  trap - EXIT INT TERM
  local p
  for p in "${pid[@]}" "$boot_pid"; do
    [ -n "$p" ] && [ "$(cat "/proc/$p/comm" 2>/dev/null)" = rumor ] && kill -9 "$p" 2>/dev/null
  done
  wait 2>/dev/null
  "$testnet" down > /dev/null 2>&1
  if [ -z "${KEEP_CKPT:-}" ]; then rm -f "$out"/runs/*/*.safetensors*; fi
}
trap cleanup EXIT
trap 'echo "bench-chaos.sh: interrupted" >&2; exit 130' INT TERM
"$testnet" gc > /dev/null 2>&1
"$testnet" up "$((peers + 1))" > /dev/null || die "testnet.sh up $((peers + 1)) failed"
backend=$(cat "/run/rumor-testnet/$net/backend" 2>/dev/null || echo "?")
# The user-space switch stands for the network: it runs before the peers
# when the cores are busy, or a starved switch would stall every link at
# once (peers then declare healthy members failed), which no real network
# does.
if [ "$backend" = netsim ]; then
  renice -n -10 -p "$(cat "/run/rumor-testnet/$net/netsim.pid")" > /dev/null 2>&1 ||
    echo "bench-chaos.sh: could not raise the switch's priority" >&2
fi
boot_ns=$("$testnet" ns 1)
boot_addr=10.77.0.1:7470

# ---- clocks -----------------------------------------------------------
# now_ms: milliseconds since the epoch, into $now (no subshell).
now_ms() { local t=${EPOCHREALTIME//[.,]/}; now=$((t / 1000)); }
# Seconds of the day of log lines' "HH:MM:SS.mmm" stamps.
log_secs() { awk '{split($1, a, ":"); printf "%.3f\n", a[1] * 3600 + a[2] * 60 + a[3]}'; }
json_num() { sed -n "s/.*\"$1\":\([0-9.eE+-]*\).*/\1/p" "$2" 2>/dev/null | tail -1; }
# The training samples in a checkpoint's metadata (0 when there is none).
ckpt_samples() {
  local s
  s=$(head -c 8192 "$1" 2>/dev/null | tr -c '[:print:]' '\n' | sed -n 's/.*"rumor\.samples":"\([0-9]*\)".*/\1/p' | head -1)
  echo "${s:-0}"
}

# ---- jobs and schemes -------------------------------------------------
batch=$((128 / peers > 16 ? 128 / peers : 16))
# The MLP job's learning rate for SCHEME: the README's 0.05 is tuned for
# the cluster's batch of 128, which the every-step schemes train with. An
# outer scheme's member takes 50 steps alone on its own batch: there, 0.05
# at batch 16 diverges (one process alone does too: its loss climbs to
# chance within a few epochs), so the rate is scaled to the member's batch
# by the square-root rule, 0.05 * sqrt(batch / 128): 0.0177 at 8 peers.
# MLP_LR sets it for every scheme.
mlp_lr() {
  if [ -n "${MLP_LR:-}" ]; then echo "$MLP_LR"; return; fi
  case $1 in
  diloco | noloco) awk -v b="$batch" 'BEGIN {printf "%.3g\n", 0.05 * sqrt((b < 128 ? b : 128) / 128)}' ;;
  *) echo 0.05 ;;
  esac
}
# job_args JOB WORK SCHEME: the job's peer options; WORK: its epochs (mlp)
# or steps (gpt).
job_args() {
  case $1 in
  mlp) echo "--model mlp:784-512-256-10 --data $data --batch $batch --lr $(mlp_lr "$3") --no-eval --epochs $2" ;;
  gpt) echo "--model gpt:L2-H2-C64-T64-V256 --data $corpus --optimizer adamw --lr 3e-3 --warmup 20 --weight-decay 0.1
             --grad-clip 1.0 --batch 8 --no-eval --max-steps $2" ;;
  esac
}
job_batch() { if [ "$1" = mlp ]; then echo "$batch"; else echo 8; fi; }
scheme_args() {
  case $1 in
  gossip) echo "--sync gossip --max-local-steps 4" ;;
  allreduce) echo "--sync allreduce" ;;
  diloco) echo "--sync allreduce --outer nesterov" ;;
  noloco) echo "--sync gossip --outer nesterov" ;;
  *) die "unknown scheme '$1' (gossip allreduce diloco noloco)" ;;
  esac
}
target_pct() { case $1 in gossip | noloco) echo 95 ;; *) echo 85 ;; esac; }

# ---- one run ----------------------------------------------------------
# Per peer i (1..peers): pid[i] (empty once its last process ended), inc[i]
# (its process count - 1: restarts), busy[i] (under a fault: 0/1),
# killed[i] (1 once killed: not long-lived).
declare -a inc busy killed
# Pending ends of faults: at end_at[k] ms, run end_cmd[k] for peer end_peer[k].
declare -a end_at end_cmd end_peer

# start_peer I RESUME: starts peer I on host I+1 (RESUME 1: --resume).
start_peer() {
  local i=$1 resume=$2 h=$(($1 + 1)) role=""
  local ns
  ns=$("$testnet" ns "$h")
  if $roles; then
    case $i in 1 | 2) role="--no-inbound" ;; 3) role="--relay" ;; esac
  fi
  local listen="--listen 10.77.0.$h:7471" boot=$boot_addr
  # A peer behind a "NAT" listens nowhere; it names the relay peer (host 4)
  # first among the members it joins through, the bootstrap node second.
  [ "$role" = --no-inbound ] && listen="" boot=10.77.0.4:7471,$boot_addr
  local more="--wait-peers $peers"
  [ "$resume" = 1 ] && more="--resume $d/p$i.safetensors"
  # shellcheck disable=SC2086
  ip netns exec "$ns" "$rumor" peer --bootstrap "$boot" $listen --cluster-key "$d/cluster.key" \
    --identity "$d/id$i.key" --name "peer-$i" --threads 1 --shard "$((i - 1))/$peers" \
    --checkpoint "$d/p$i.safetensors" --checkpoint-every "$ckpt_every" --log-every 2 \
    $run_job_args $run_scheme_args $role $more ${PEER_ARGS:-} \
    > "$d/p$i.${inc[$i]}.out" 2> "$d/p$i.${inc[$i]}.log" &
  pid[$i]=$!
}

alive() { [ -r "/proc/$1/stat" ] && [ "$(sed 's/.*) //' "/proc/$1/stat" 2>/dev/null | cut -c1)" != Z ]; }
# training I: peer I's current process has taken its first step and not
# ended its training.
training() {
  local l=$d/p$1.${inc[$1]}.log
  grep -q "first step" "$l" 2>/dev/null && ! grep -q "training done" "$l" 2>/dev/null
}
event() { # T KIND PEER WHAT: one line of faults.csv and of the log
  echo "$run_id,$1,$2,$3,$4" >> "$out/faults.csv"
  printf '  t=%6.1f s  %-5s %-7s %s\n' "$1" "$2" "$([ "$3" = - ] && echo - || echo "peer-$3")" "$4" | tee -a "$d/faults.txt" >&2
}
t_rel() { now_ms; awk -v a="$now" -v b="$t_train" 'BEGIN {printf "%.1f", (a - b) / 1000}'; }
later() { end_at+=("$1"); end_cmd+=("$2"); end_peer+=("$3"); }

# A process ended: its exit status is a crash unless 0 (it finished, or
# left on our SIGTERM).
reap() { # I PID
  local rc
  wait "$2" 2>/dev/null
  rc=$?
  if [ "$rc" != 0 ]; then
    crashes=$((crashes + 1))
    event "$(t_rel)" crash "$1" "process ${inc[$1]} (pid $2) exited with status $rc: $(tail -n 1 "$d/p$1.${inc[$1]}.log" | cut -c1-200)"
  fi
}

# kill -9 peer I, then restart it with --resume (kinds kill and relay).
do_kill() { # KIND I
  local i=$2 p=${pid[$2]}
  killed[$i]=1
  kill -CONT "$p" 2>/dev/null
  kill -9 "$p" 2>/dev/null
  wait "$p" 2>/dev/null
  local rc=$?
  inc[$i]=$((inc[$i] + 1))
  restarts=$((restarts + 1))
  start_peer "$i" 1
  event "$(t_rel)" "$1" "$i" "kill -9 pid $p (exit status $rc); restarted with --resume as pid ${pid[$i]}"
}

# Draws the next kind from the deck (reshuffled when empty) into $kind.
deck=()
draw_kind() {
  if [ "${#deck[@]}" = 0 ]; then
    read -r -a deck <<< "$deck_kinds"
    local j k tmp
    for ((j = ${#deck[@]} - 1; j > 0; j--)); do
      k=$((RANDOM % (j + 1)))
      tmp=${deck[$j]} deck[$j]=${deck[$k]} deck[$k]=$tmp
    done
  fi
  kind=${deck[0]}
  deck=("${deck[@]:1}")
}

# One fault now: draws a kind and a victim; none when no peer can take it.
fault() {
  local i v start victim=""
  draw_kind
  start=$((RANDOM % peers))
  for ((v = 0; v < peers; v++)); do
    i=$(((start + v) % peers + 1))
    [ "$kind" = relay ] && [ "$i" != 3 ] && continue
    [ -n "${pid[$i]}" ] && [ "${busy[$i]}" = 0 ] && alive "${pid[$i]}" && training "$i" || continue
    # A restart needs a checkpoint to resume from.
    if [ "$kind" = kill ] || [ "$kind" = relay ]; then [ -s "$d/p$i.safetensors" ] || continue; fi
    victim=$i
    break
  done
  if [ -z "$victim" ]; then
    # Back on top of the deck: the next slot tries this kind again.
    deck=("$kind" ${deck[@]+"${deck[@]}"})
    event "$(t_rel)" "$kind" - "no peer could take it now"
    return
  fi
  i=$victim
  nfaults=$((nfaults + 1))
  eval "n_$kind=\$((n_$kind + 1))"
  now_ms
  case $kind in
  kill | relay) do_kill "$kind" "$i" ;;
  stop)
    kill -STOP "${pid[$i]}"
    busy[$i]=1
    later $((now + stop_s * 1000)) "kill -CONT ${pid[$i]}" "$i"
    # The process is seen stopped (state T) before the fault is logged.
    local st=""
    for _ in 1 2 3 4 5 6 7 8 9 10; do
      st=$(sed 's/.*) //' "/proc/${pid[$i]}/stat" 2>/dev/null | cut -c1)
      [ "$st" = T ] && break
      sleep 0.05
    done
    if [ "$st" = T ]; then st="(state T)"; else st="but it did not stop (state '$st')"; fi
    event "$(t_rel)" stop "$i" "SIGSTOP pid ${pid[$i]} for $stop_s s $st" ;;
  cut)
    "$testnet" cut $((i + 1)) > /dev/null
    busy[$i]=1
    later $((now + cut_s * 1000)) "$testnet heal $((i + 1))" "$i"
    event "$(t_rel)" cut "$i" "host $((i + 1)) cut off for $cut_s s" ;;
  loss)
    "$testnet" shape $((i + 1)) loss "$loss_pct" > /dev/null
    busy[$i]=1
    later $((now + loss_s * 1000)) "$testnet shape $((i + 1))" "$i"
    event "$(t_rel)" loss "$i" "$loss_pct % loss on host $((i + 1)) for $loss_s s" ;;
  esac
}

# Ends the faults whose time has come (all of them with ALL=1).
end_faults() {
  local k keep_at=() keep_cmd=() keep_peer=()
  now_ms
  for k in "${!end_at[@]}"; do
    if [ "${1:-0}" = 1 ] || [ "${end_at[$k]}" -le "$now" ]; then
      ${end_cmd[$k]} > /dev/null 2>&1
      busy[${end_peer[$k]}]=0
    else
      keep_at+=("${end_at[$k]}") keep_cmd+=("${end_cmd[$k]}") keep_peer+=("${end_peer[$k]}")
    fi
  done
  end_at=("${keep_at[@]}") end_cmd=("${keep_cmd[@]}") end_peer=("${keep_peer[@]}")
}

# RSS and descriptors of every process now running (samples.csv).
sample() {
  local i p t
  t=$(t_rel)
  # The host's load (1-minute average) beside: other work on the machine
  # moves the throughput figures.
  echo "$run_id,$t,load,0,0,$(cut -d' ' -f1 /proc/loadavg),0" >> "$out/samples.csv"
  for i in $(seq 1 "$peers") boot; do
    if [ "$i" = boot ]; then p=$boot_pid; else p=${pid[$i]}; fi
    [ -n "$p" ] && alive "$p" || continue
    [ "$i" != boot ] && ! training "$i" && continue
    echo "$run_id,$t,$i,$([ "$i" = boot ] && echo 0 || echo "${inc[$i]}"),$p,$(awk '/^VmRSS/ {print $2}' "/proc/$p/status" 2>/dev/null),$(ls "/proc/$p/fd" 2>/dev/null | wc -l)" >> "$out/samples.csv"
  done
}

# run JOB SCHEME MODE WORK: one run (MODE probe, free or chaos); WORK is the
# job's epochs (mlp) or steps (gpt). Leaves its files in $d.
run() {
  local job=$1 scheme=$2 mode=$3 work=$4 i
  run_id=$job-$scheme-$mode
  d=$out/runs/$run_id
  rm -rf "$d"
  mkdir -p "$d"
  run_job_args=$(job_args "$job" "$work" "$scheme")
  run_scheme_args=$(scheme_args "$scheme")
  crashes=0 restarts=0 nfaults=0 n_kill=0 n_stop=0 n_cut=0 n_loss=0 n_relay=0 timed_out=0
  end_at=() end_cmd=() end_peer=() deck=()
  RANDOM=$seed
  "$rumor" keygen --cluster -o "$d/cluster.key" > /dev/null 2>&1 || die "keygen failed"
  for i in $(seq 0 "$peers"); do "$rumor" keygen -o "$d/id$i.key" > /dev/null 2>&1; done
  ip netns exec "$boot_ns" "$rumor" bootstrap --listen "$boot_addr" --cluster-key "$d/cluster.key" \
    --identity "$d/id0.key" > "$d/boot.out" 2> "$d/boot.log" &
  boot_pid=$!
  for _ in $(seq 1 100); do grep -q '"listen"' "$d/boot.out" 2>/dev/null && break; sleep 0.1; done
  grep -q '"listen"' "$d/boot.out" || die "the bootstrap node did not start: $(tail -n 3 "$d/boot.log")"
  for i in $(seq 1 "$peers"); do
    inc[$i]=0 busy[$i]=0 killed[$i]=0
    start_peer "$i" 0
  done
  now_ms
  local t_start=$now next_fault=0 next_sample=0 running any
  t_train=$now
  # Training starts when every peer has taken its first step.
  local started=0
  while :; do
    now_ms
    running=0
    any=0
    for i in $(seq 1 "$peers"); do
      [ -n "${pid[$i]}" ] || continue
      if ! alive "${pid[$i]}"; then reap "$i" "${pid[$i]}"; pid[$i]=""; continue; fi
      running=$((running + 1))
      [ "$started" = 0 ] && ! grep -q "first step" "$d/p$i.0.log" 2>/dev/null && any=1
    done
    [ "$running" = 0 ] && break
    if [ "$started" = 0 ] && [ "$any" = 0 ]; then
      started=1 t_train=$now
      next_fault=$((now + every * 1000)) next_sample=$now
      echo "  $run_id: every peer training; $([ "$mode" = chaos ] && echo "a fault every $every s" || echo "no faults")" >&2
    fi
    if [ "$started" = 1 ]; then
      end_faults
      if [ "$mode" = chaos ] && [ "$now" -ge "$next_fault" ]; then
        fault
        next_fault=$((next_fault + every * 1000))
      fi
      if [ "$mode" != probe ] && [ "$now" -ge "$next_sample" ]; then
        sample
        next_sample=$((next_sample + sample_s * 1000))
      fi
    fi
    if [ "$((now - t_start))" -gt "$((run_timeout * 1000))" ] && [ "$timed_out" = 0 ]; then
      timed_out=1
      end_faults 1
      echo "  $run_id: still running after $run_timeout s: SIGTERM to the peers left" >&2
      for i in $(seq 1 "$peers"); do [ -n "${pid[$i]}" ] && kill -TERM "${pid[$i]}" 2>/dev/null; done
    fi
    sleep 0.25
  done
  end_faults 1
  # The switch's counters (netsim: frames lost and dropped by cuts, per host).
  "$testnet" status > "$d/net-status.txt" 2>&1
  "$testnet" heal all > /dev/null 2>&1
  "$testnet" shape all > /dev/null 2>&1
  kill -TERM "$boot_pid" 2>/dev/null
  wait "$boot_pid" 2>/dev/null
  local rc=$?
  if [ "$rc" != 0 ]; then
    crashes=$((crashes + 1))
    event "$(t_rel)" crash boot "the bootstrap node exited with status $rc"
  fi
}

# ---- what a run measured ---------------------------------------------
# Sets: samples, wall, sps, quality (mean), qworst, finished, resumed,
# fallbacks, lost, rss_growth, rss_node (whose), fd_growth and load (the
# host's mean load average), for run $run_id in $d.
summarize() {
  local job=$1 scheme=$2 mode=$3 i f metric t0 t1
  metric=test_accuracy
  [ "$job" = gpt ] && metric=val_loss
  samples=0 finished=0 resumed=0 fallbacks=0 lost=0
  local qs=""
  for i in $(seq 1 "$peers"); do
    samples=$((samples + $(ckpt_samples "$d/p$i.safetensors")))
    f=$d/p$i.${inc[$i]}.out
    q=$(json_num "$metric" "$f")
    [ -n "$q" ] && finished=$((finished + 1)) && qs="$qs $q"
  done
  # Every restart (process k >= 1 of a peer) must have resumed from the
  # last checkpoint its killed predecessor logged as saved (or a later one,
  # when the kill fell between a save's rename and its log line).
  local k from saved peer
  for f in "$d"/p*.[1-9]*.log; do
    [ -e "$f" ] || continue
    k=${f%.log}
    k=${k##*.}
    peer=$(basename "$f" | cut -d. -f1 | tr -d p)
    from=$(sed -n 's/.*resumed from .* at step \([0-9]*\).*/\1/p' "$f" | head -1)
    saved=$(sed -n 's/.*checkpoint saved to .* (step \([0-9]*\)).*/\1/p' "$d/p$peer.$((k - 1)).log" | tail -1)
    if [ -z "$from" ]; then
      lost=$((lost + 1))
      event "$(t_rel)" lost "$peer" "$(basename "$f"): did not resume: $(grep -m1 -E 'ERROR|rumor peer:' "$f" | cut -c1-200)"
    elif [ "$from" -lt "${saved:-0}" ]; then
      lost=$((lost + 1))
      event "$(t_rel)" lost "$peer" "$(basename "$f"): resumed at step $from, but step $saved had been saved"
    else
      resumed=$((resumed + 1))
    fi
    grep -q "resumed from .*\.prev at step" "$f" && fallbacks=$((fallbacks + 1))
  done
  t0=$(cat "$d"/p*.0.log | grep "first step" | log_secs | sort -n | head -1)
  t1=$(cat "$d"/p*.log | grep "training done" | log_secs | sort -n | tail -1)
  wall=$(awk -v a="${t0:-0}" -v b="${t1:-0}" 'BEGIN {w = b - a; if (w < -43200) w += 86400; printf "%.1f", w}')
  sps=$(awk -v s="$samples" -v w="$wall" 'BEGIN {printf "%.0f", (w > 0 ? s / w : 0)}')
  if [ "$job" = gpt ]; then
    read -r quality qworst <<< "$(echo "$qs" | awk '{s = 0; m = -1; for (i = 1; i <= NF; i++) {s += $i; if ($i > m) m = $i}
      if (NF) printf "%.4f %.4f", s / NF, m; else print "nan nan"}')"
  else
    read -r quality qworst <<< "$(echo "$qs" | awk '{s = 0; m = 2; for (i = 1; i <= NF; i++) {s += $i; if ($i < m) m = $i}
      if (NF) printf "%.4f %.4f", s / NF, m; else print "nan nan"}')"
  fi
  # Long-lived: the bootstrap node and the peers never killed. Growth from
  # the first sample after the warm-up to the last one.
  read -r rss_growth rss_node fd_growth load <<< "$(awk -F, -v r="$run_id" -v k=" ${killed_list:-}" -v w="$warmup" '
    $1 == r && $3 == "load" {ls += $6; ln++; next}
    $1 == r && $6 != "" && $2 >= w {
      key = $3; if (!(key in first)) {first[key] = $6; ffd[key] = $7} last[key] = $6; lfd[key] = $7 }
    END {g = -1e9; fg = -1e9; who = "-"
      for (key in first) { if (index(k, " " key " ")) continue
        x = 100 * (last[key] - first[key]) / first[key]; if (x > g) {g = x; who = key}
        y = lfd[key] - ffd[key]; if (y > fg) fg = y }
      if (who != "boot" && who != "-") who = "peer-" who
      if (g == -1e9) printf "nan - nan"; else printf "%.1f %s %+d", g, who, fg
      printf " %.1f\n", ln ? ls / ln : 0}' "$out/samples.csv")"
}

# ---- the benchmark ----------------------------------------------------
echo "run_id,t,kind,peer,what" > "$out/faults.csv"
echo "run_id,t,node,process,pid,rss_kb,fds" > "$out/samples.csv"
echo "job,scheme,run,peers,epochs_or_steps,wall_s,samples,samples_per_s,retained_pct,target_pct,metric,quality_mean,quality_worst,quality_delta,finished,faults,kill,stop,cut,loss,relay,restarts,resumed,resumed_from_prev,checkpoints_lost,crashes,rss_growth_pct,fd_growth,load_avg,timed_out,duration_s,fault_every_s,seed,date,cpus" \
  > "$out/bench-chaos.csv"
cpu=$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ *//')
# The CSV's last two columns: the day and the machine (its CPU flags that move crypto).
csv_machine="$(date -u +%F),$(nproc) x ${cpu//,/ }$(grep -qw avx512f /proc/cpuinfo && echo ' AVX-512')$(grep -qw vaes /proc/cpuinfo && echo ' VAES')"
say "bench-chaos.sh: $peers peers on test hosts ($backend backend), jobs: $jobs; schemes: $schemes;" \
  "DURATION $duration s, a fault every $every s (kinds:$deck_kinds; SEED $seed), RSS and fds from t=$warmup s;" \
  "$(nproc) CPUs: $cpu"

for job in $jobs; do
  case $job in
  mlp) ls "$data"/train-images-idx3-ubyte* > /dev/null 2>&1 || die "no Fashion-MNIST in $data" ;;
  gpt)
    if [ ! -s "$corpus" ]; then
      corpus=$out/kjv.txt
      [ -s "$corpus" ] || "$src/deploy/make-corpus.sh" "$corpus" > /dev/null || die "no corpus for the gpt job"
    fi ;;
  *) die "unknown job '$job' (mlp gpt)" ;;
  esac
  for scheme in $schemes; do
    scheme_args "$scheme" > /dev/null
    # Size the job: a probe run's cluster samples/s (measured as the runs'
    # are) sets the epochs or steps for DURATION seconds of training, and
    # the checkpoint interval for one about every CKPT_SECS seconds of a
    # peer's training. EPOCHS / STEPS and CKPT_EVERY, when given, win.
    if [ "$job" = mlp ]; then work=${EPOCHS:-}; probe_work=2; else work=${STEPS:-}; probe_work=500; fi
    ckpt_every=${CKPT_EVERY:-}
    if [ -z "$work" ] || [ -z "$ckpt_every" ]; then
      ckpt_every=1000000
      killed_list=""
      run "$job" "$scheme" probe "$probe_work"
      summarize "$job" "$scheme" probe
      rate=$sps
      [ "$finished" = "$peers" ] && [ "$rate" -gt 0 ] || die "the probe run of $job/$scheme did not finish: see $d"
      if [ -z "$work" ] && [ "$job" = mlp ]; then
        work=$(awk -v r="$rate" -v t="$duration" 'BEGIN {e = int(r * t / 60000 + 0.5); print (e < 1 ? 1 : e)}')
      elif [ -z "$work" ]; then
        work=$(awk -v r="$rate" -v t="$duration" -v p="$peers" 'BEGIN {s = int(r * t / (8 * p) + 0.5); print (s < 100 ? 100 : s)}')
      fi
      ckpt_every=${CKPT_EVERY:-$(awk -v r="$rate" -v p="$peers" -v b="$(job_batch "$job")" -v s="$ckpt_secs" \
        'BEGIN {n = int(r / p / b * s); print (n < 20 ? 20 : n)}')}
    fi
    unit=$([ "$job" = mlp ] && echo epochs || echo steps)
    say ""
    say "== $job, $scheme: $peers peers, $work $unit each ($( [ "$job" = mlp ] && echo "1/$peers of Fashion-MNIST, batch $batch, lr $(mlp_lr "$scheme")" || echo "1/$peers of the windows, batch 8")), checkpoint every $ckpt_every steps"
    declare -A R=()
    for mode in free chaos; do
      run "$job" "$scheme" "$mode" "$work"
      # Peers killed in this run are not long-lived (summarize's RSS filter).
      killed_list=""
      for i in $(seq 1 "$peers"); do [ "${killed[$i]}" = 1 ] && killed_list="$killed_list$i "; done
      summarize "$job" "$scheme" "$mode"
      for v in sps wall samples quality qworst finished lost crashes rss_growth rss_node fd_growth load resumed fallbacks \
        restarts timed_out nfaults n_kill n_stop n_cut n_loss n_relay; do
        R[$mode,$v]=${!v}
      done
    done
    # The table: fault-free beside chaos, with the targets.
    metric=$([ "$job" = mlp ] && echo test_accuracy || echo val_loss)
    tgt=$(target_pct "$scheme")
    retained=$(awk -v a="${R[chaos,sps]}" -v b="${R[free,sps]}" 'BEGIN {printf "%.1f", (b > 0 ? 100 * a / b : 0)}')
    if [ "$job" = mlp ]; then
      # Accuracy in points (hundredths); lower is worse.
      delta=$(awk -v a="${R[chaos,quality]}" -v b="${R[free,quality]}" 'BEGIN {printf "%+.2f points", 100 * (a - b)}')
      qmet=$(awk -v a="${R[chaos,quality]}" -v b="${R[free,quality]}" 'BEGIN {print (a == a && b == b && b - a <= 0.005)}')
      qtarget="within 0.5 point" worst=lowest
    else
      # Loss; higher is worse.
      delta=$(awk -v a="${R[chaos,quality]}" -v b="${R[free,quality]}" 'BEGIN {printf "%+.4f", a - b}')
      qmet=$(awk -v a="${R[chaos,quality]}" -v b="${R[free,quality]}" 'BEGIN {print (a == a && b == b && a - b <= 0.05)}')
      qtarget="within 0.05" worst=highest
    fi
    verdict() { if [ "$1" = 1 ]; then echo met; else echo MISSED; fi; }
    row() { say "$(printf '%-27s %-24s %-34s %-19s %s' "$@")"; }
    row measure fault-free chaos target verdict
    row "samples/s (cluster)" "${R[free,sps]}" "${R[chaos,sps]} ($retained %)" ">= $tgt % retained" \
      "$(verdict "$(awk -v r="$retained" -v t="$tgt" 'BEGIN {print (r >= t)}')")"
    row "wall s (first step to end)" "${R[free,wall]}" "${R[chaos,wall]}" "" ""
    row "$metric: mean ($worst)" "${R[free,quality]} (${R[free,qworst]})" "${R[chaos,quality]} (${R[chaos,qworst]})" \
      "$qtarget" "$(verdict "$qmet") ($delta)"
    row "peers finished" "${R[free,finished]}/$peers" "${R[chaos,finished]}/$peers" "" ""
    row "faults" "-" "${R[chaos,nfaults]}: kill ${R[chaos,n_kill]} stop ${R[chaos,n_stop]} cut ${R[chaos,n_cut]} loss ${R[chaos,n_loss]} relay ${R[chaos,n_relay]}" "" ""
    row "restarts resumed" "-" "${R[chaos,resumed]}/${R[chaos,restarts]} (${R[chaos,fallbacks]} from .prev)" "all" \
      "$(verdict "$([ "${R[chaos,resumed]}" = "${R[chaos,restarts]}" ] && echo 1)")"
    row "checkpoints lost" "${R[free,lost]}" "${R[chaos,lost]}" 0 "$(verdict "$([ "${R[chaos,lost]}" = 0 ] && echo 1)")"
    row "survivor crashes" "${R[free,crashes]}" "${R[chaos,crashes]}" 0 \
      "$(verdict "$([ "${R[chaos,crashes]}" = 0 ] && [ "${R[free,crashes]}" = 0 ] && echo 1)")"
    # A run that ended within the warm-up has no sample to judge by.
    rss_cell() { if [ "${R[$1,rss_growth]}" = nan ]; then echo "- (ended in the warm-up)"; else
      echo "max ${R[$1,rss_growth]} % (${R[$1,rss_node]})"; fi; }
    rss_verdict=$(verdict "$(awk -v a="${R[chaos,rss_growth]}" -v b="${R[free,rss_growth]}" \
      'BEGIN {print (a == a && a < 10 && b < 10)}')")
    [ "${R[chaos,rss_growth]}" = nan ] || [ "${R[free,rss_growth]}" = nan ] &&
      rss_verdict="not measured: training took less than the warm-up (WARMUP $warmup s)"
    row "RSS growth after warm-up" "$(rss_cell free)" "$(rss_cell chaos)" "< 10 % (flat)" "$rss_verdict"
    row "fd growth after warm-up" "max ${R[free,fd_growth]}" "max ${R[chaos,fd_growth]}" "(reported)" ""
    row "host load average (1 min)" "${R[free,load]}" "${R[chaos,load]}" "" ""
    [ "${R[chaos,timed_out]}" = 1 ] && say "  the chaos run hit RUN_TIMEOUT ($run_timeout s): the peers left were sent SIGTERM"
    for mode in free chaos; do
      ret=100.0 dq=0
      [ "$mode" = chaos ] && ret=$retained dq=${delta% points}
      echo "$job,$scheme,$mode,$peers,$work,${R[$mode,wall]},${R[$mode,samples]},${R[$mode,sps]},$ret,$tgt,$metric,${R[$mode,quality]},${R[$mode,qworst]},$dq,${R[$mode,finished]},${R[$mode,nfaults]},${R[$mode,n_kill]},${R[$mode,n_stop]},${R[$mode,n_cut]},${R[$mode,n_loss]},${R[$mode,n_relay]},${R[$mode,restarts]},${R[$mode,resumed]},${R[$mode,fallbacks]},${R[$mode,lost]},${R[$mode,crashes]},${R[$mode,rss_growth]},${R[$mode,fd_growth]},${R[$mode,load]},${R[$mode,timed_out]},$duration,$every,$seed,$csv_machine" \
        >> "$out/bench-chaos.csv"
    done
  done
done
say ""
say "files: $out/bench-chaos.csv (one row per run), $out/faults.csv (every fault), $out/samples.csv (RSS, fds), logs in $out/runs/"
