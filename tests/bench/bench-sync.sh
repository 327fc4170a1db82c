#!/bin/sh
# The data-parallel schemes head to head (issue #16, item 4): N workers, the
# same model (mlp:784-256-10), data (each worker 1/N of Fashion-MNIST),
# batch, SGD, schedule and total samples, under four conditions:
#
#   clean      every worker on 127.0.0.1
#   straggler  worker N's steps take twice as long (rumor --slowdown 2, the
#              anchors the same); every worker is held to the same share
#              of the host's CPUs (CPU_CAP, tests/bench/cpu-cap.sh: a
#              cgroup each), as on machines of their own, so the
#              straggler's idle time is not handed to the others
#   slow       every worker on its own test host (deploy/testnet.sh: network
#              namespaces), each host's traffic delayed 10 ms (20 ms RTT) and
#              limited to 200 Mbit/s
#   killed     worker N is SIGKILLed when worker 1 is half-way
#   stopped    worker N is SIGSTOPped when worker 1 is half-way, and
#              SIGCONTed STOP_S seconds later
#
# Schemes: gossip (rumor peer), gossip-mls (gossip with --max-local-steps 4),
# allreduce (rumor peer --sync allreduce), allreduce-swim (the same with
# --heartbeat-ms 0 on every node: failures found by SWIM's probes alone;
# killed and stopped only), ps0 / ps4 / psasp (two `rumor ps`
# servers, each holding half the parameters, with --staleness 0, 4, none;
# workers rumor peer --sync ps),
# ddp (PyTorch DDP, gloo all-reduce every step: tests/bench/ddp_fmnist.py on
# Debian's PyTorch) and hivemind (hivemind.Optimizer with local updates,
# tests/bench/hivemind_fmnist.py in a virtual environment that
# tests/bench/hivemind-venv.sh makes from PyPI; skipped with the reason when
# it cannot be made).
#
# For each run: the time from the first step until every worker still
# running has reached TARGET test accuracy (evaluations every ~1/EVALS of
# the run), the final accuracy (mean and lowest over the workers that
# finished), the wall time and how many workers finished. Times leave out
# the evaluations themselves (each worker's own, rank 0's for the anchors,
# whose others wait for it): a test-set pass of this model costs about as
# much as 100 training steps, so counting them would measure EVALS. Then the
# expectation, stated before measuring: gossip reaches the target at least
# 1.3 times sooner than all-reduce under the straggler and on slow links,
# and finishes where all-reduce cannot when a worker dies; all-reduce may win
# on a clean fast link. A CSV of every evaluation (for
# tests/bench/plot_sync.py, which draws accuracy against time, one line per
# scheme and one panel per condition) goes to $OUT (default
# bench-sync.csv).
#
# Recovery (issue 30, item 2), for the all-reduce schemes under killed and
# stopped: from the fault to the survivors' first round over the N − 1 of
# them ("out": the latest over the survivors, from their log lines "done
# over N members"), and for stopped from the SIGCONT to their first round
# over all N again ("back"), beside the same with SWIM-only verdicts
# (allreduce-swim) as a ratio. The promises: out within 2 s of a kill and
# 1.5 s of a stop, back within a round of the SIGCONT. A member stopped for
# long is behind and must first take a state ahead (pull and check it); so
# for stopped also: from the SIGCONT to the end of that catch-up (its log
# line "all-reduce: now at step", "caught up"), and from there to the
# first round over all N ("rejoin", in milliseconds, beside a step's).
#
#   tests/bench/bench-sync.sh [BUILD_DIR]
#
#   env: N (4), EPOCHS (2), BATCH (32), LR (0.05), TARGET (0.84),
#        CONDITIONS ("clean straggler slow killed stopped"), STOP_S (10),
#        SCHEMES ("gossip gossip-mls allreduce allreduce-swim ps0 ps4 psasp ddp hivemind"),
#        RUN_TIMEOUT (600 s a run), OUT (bench-sync.csv), VENV (the Hivemind
#        environment, default ~/.cache/rumor-bench/hivemind), CPU_CAP (the
#        straggler condition's per-worker share in percent of one CPU,
#        default 100 * CPUs / N; 0: no caps), EVALS (test-set evaluations
#        per run, 40: the time to target is known to about a 40th of a
#        run)
set -eu
src=$(cd "$(dirname "$0")/../.." && pwd)
build=${1:-$src/build}
rumor=$build/peer/rumor
py=/usr/bin/python3
n=${N:-4}
epochs=${EPOCHS:-2}
batch=${BATCH:-32}
lr=${LR:-0.05}
target=${TARGET:-0.84}
conditions=${CONDITIONS:-clean straggler slow killed stopped}
schemes=${SCHEMES:-gossip gossip-mls allreduce allreduce-swim ps0 ps4 psasp ddp hivemind}
stop_s=${STOP_S:-10}
run_timeout=${RUN_TIMEOUT:-600}
cpu_cap=${CPU_CAP:-$((100 * $(nproc) / ${N:-4}))}
if [ "$cpu_cap" -gt 0 ] && ! "$src/tests/bench/cpu-cap.sh" --check 2>/dev/null; then
  echo "bench-sync.sh: cannot cap CPU shares here ($("$src/tests/bench/cpu-cap.sh" --check 2>&1)):" \
    "the straggler condition runs uncapped" >&2
  cpu_cap=0
fi
out_csv=${OUT:-bench-sync.csv}
venv=${VENV:-$HOME/.cache/rumor-bench/hivemind}
data=/usr/share/datasets/fashion-mnist
model=mlp:784-256-10
hidden=256
[ -x "$rumor" ] || { echo "build first: $rumor is missing" >&2; exit 1; }
per_epoch=$(((60000 / n + batch - 1) / batch)) # batches per epoch, the last one short, as rumor counts
steps=$((per_epoch * epochs))
evals=${EVALS:-40}
eval_every=$((steps / evals))
half=$((steps / 2))
work=$(mktemp -d)
pids=""
net_up=false
# SIGKILLs process $1 and every descendant (an anchor's rank may have
# children of its own: Hivemind's p2pd and its DHT and averager processes,
# which outlive a rank killed alone).
kill_tree() {
  for c in $(pgrep -P "$1" 2>/dev/null); do kill_tree "$c"; done
  kill -9 "$1" 2>/dev/null || true
}

cleanup() {
  for p in $pids; do kill_tree "$p"; done
  wait 2>/dev/null || true
  if $net_up; then TESTNET_NAME=rbs "$src/deploy/testnet.sh" down >/dev/null 2>&1 || true; fi
  "$src/tests/bench/cpu-cap.sh" --remove
  if [ -n "${KEEP:-}" ]; then echo "bench-sync.sh: kept $work" >&2; else rm -rf "$work"; fi
}
trap cleanup EXIT INT TERM
echo "bench-sync.sh: $n workers, $model, batch $batch, $epochs epochs ($steps steps each), target $target;" \
  "$(nproc) CPUs ($(grep -q avx512f /proc/cpuinfo && echo AVX-512 || echo AVX2));" \
  "straggler: $([ "$cpu_cap" -gt 0 ] && echo "each worker capped at $cpu_cap% of a CPU" || echo "no CPU caps")" >&2
echo "condition,scheme,worker,t,accuracy" > "$out_csv"
: > "$work/table"
: > "$work/recovery"

now() { date +%s.%N; }
# Seconds of the day of a log line's "HH:MM:SS.mmm" stamp.
log_secs() { awk '{split($1, a, ":"); printf "%.3f\n", a[1] * 3600 + a[2] * 60 + a[3]}'; }
day_secs() { date +%H:%M:%S.%N | log_secs; }

# The host (1..n) a node runs on under condition $1; "" on loopback.
host() { if [ "$1" = slow ]; then echo "$src/deploy/testnet.sh exec $2"; fi; }
# ... and, for worker $2, its CPU share under the straggler condition.
wrap() {
  if [ "$1" = straggler ] && [ "$cpu_cap" -gt 0 ]; then echo "$src/tests/bench/cpu-cap.sh $cpu_cap w$2"
  else host "$1" "$2"; fi
}
addr() { if [ "$1" = slow ]; then echo "10.77.0.$2"; else echo 127.0.0.1; fi; }

# Waits for every PID in $1, SIGKILLing those still running after
# RUN_TIMEOUT seconds.
wait_all() {
  # shellcheck disable=SC2016,SC2086
  (trap 'kill $s 2>/dev/null; exit 0' TERM; sleep "$run_timeout" & s=$!; wait $s; kill -9 $1 2>/dev/null) &
  watchdog=$!
  for p in $1; do wait "$p" 2>/dev/null || true; done
  kill "$watchdog" 2>/dev/null || true
}

# killed: SIGKILLs $2 once file $1 shows a step at or past half the run;
# stopped: SIGSTOPs it then, and SIGCONTs it STOP_S seconds later. The
# times (seconds of the day, as log lines stamp them) go to $3/fault_at and
# $3/cont_at.
killer() {
  while :; do
    s=$(sed -n 's/.*step \([0-9]*\): train loss.*/\1/p' "$1" 2>/dev/null | tail -1)
    [ -n "$s" ] && [ "$s" -ge "$half" ] && break
    kill -0 "$2" 2>/dev/null || return 0
    sleep 0.05
  done
  if [ "$4" = stopped ]; then
    day_secs > "$3/fault_at"
    kill -STOP "$2" 2>/dev/null || true
    sleep "$stop_s"
    day_secs > "$3/cont_at"
    kill -CONT "$2" 2>/dev/null || true
  else
    day_secs > "$3/fault_at"
    kill -9 "$2" 2>/dev/null || true
  fi
}

# Starts the n rumor workers of the job (condition $1, files in $2: keys
# idI.key and the cluster key; stdout wI.out, log wI.log), each listening on
# its host when $3 is true, with the options after $3; worker n straggles or
# is killed as the condition says; waits for them all.
run_workers() {
  cond=$1 d=$2 listen=$3
  shift 3
  run_pids=""
  for i in $(seq 1 "$n"); do
    own=""
    [ "$cond" = straggler ] && [ "$i" -eq "$n" ] && own="--slowdown 2"
    $listen && own="$own --listen $(addr "$cond" "$i"):0"
    # shellcheck disable=SC2086
    $(wrap "$cond" "$i") "$rumor" peer --cluster-key "$d/cluster.key" --identity "$d/id$i.key" \
      --shard "$((i - 1))/$n" --model "$model" --epochs "$epochs" --batch "$batch" --lr "$lr" --threads 1 \
      --eval-every "$eval_every" --log-every 0 --name "w$i" $own "$@" > "$d/w$i.out" 2> "$d/w$i.log" &
    run_pids="$run_pids $!"
    pids="$pids $!"
  done
  case $cond in killed | stopped) killer "$d/w1.log" "$!" "$d" "$cond" & ;; esac
  wait_all "$run_pids"
}

# One rumor run: condition $1, scheme $2, extra peer flags in $3.
run_rumor() {
  cond=$1 scheme=$2 extra=$3 d=$work/$1-$2
  mkdir -p "$d"
  "$rumor" keygen --cluster -o "$d/cluster.key" >/dev/null 2>&1
  for i in $(seq 0 "$n"); do "$rumor" keygen -o "$d/id$i.key" >/dev/null 2>&1; done
  h1=$(host "$cond" 1)
  boot_extra=""
  case $extra in *--heartbeat-ms*) boot_extra="--heartbeat-ms 0" ;; esac
  # shellcheck disable=SC2086
  $h1 "$rumor" bootstrap --listen "$(addr "$cond" 1):0" --cluster-key "$d/cluster.key" --identity "$d/id0.key" \
    $boot_extra > "$d/boot.out" 2> "$d/boot.log" &
  boot_pid=$!
  pids="$pids $boot_pid"
  for _ in $(seq 1 100); do grep -q '"listen"' "$d/boot.out" 2>/dev/null && break; sleep 0.1; done
  boot=$(sed -n 's/.*"listen":"\([^"]*\)".*/\1/p' "$d/boot.out")
  # shellcheck disable=SC2086
  run_workers "$cond" "$d" true --bootstrap "$boot" --wait-peers "$n" $extra
  kill "$boot_pid" 2>/dev/null || true
  collect "$cond" "$scheme" "$d"
  case $cond in killed | stopped) recovery "$cond" "$scheme" "$d" ;; esac
}

# Seconds from time $3 (seconds of the day) to the first line of log $1 at
# or after it that holds $2, or nothing.
first_after() {
  grep -F "$2" "$1" 2>/dev/null | log_secs | awk -v t0="$3" '{
    d = $1 - t0; if (d < -43200) d += 86400; if (d >= 0) {printf "%.3f\n", d; exit}}'
}

# The latest over the survivors (workers 1 .. n-1) of first_after, or "-"
# when one never logged it.
survivors_after() {
  worst=0
  for i in $(seq 1 $((n - 1))); do
    t=$(first_after "$1/w$i.log" "$2" "$3")
    [ -n "$t" ] || { echo -; return 0; }
    worst=$(echo "$worst $t" | awk '{print ($2 > $1) ? $2 : $1}')
  done
  echo "$worst"
}

# The recovery row of an all-reduce run under killed or stopped (header).
recovery() {
  cond=$1 scheme=$2 d=$3
  case $scheme in allreduce*) ;; *) return 0 ;; esac
  [ -s "$d/fault_at" ] || { printf '%-10s %-15s no fault (the run ended first)\n' "$cond" "$scheme" >> "$work/recovery"; return 0; }
  out=$(survivors_after "$d" "done over $((n - 1)) members" "$(cat "$d/fault_at")")
  back=- caught=- rejoin=-
  if [ "$cond" = stopped ] && [ -s "$d/cont_at" ]; then
    back=$(survivors_after "$d" "done over $n members" "$(cat "$d/cont_at")")
    caught=$(first_after "$d/w$n.log" "all-reduce: now at step" "$(cat "$d/cont_at")")
    [ -n "$caught" ] || caught=-
    [ "$back" != - ] && [ "$caught" != - ] && rejoin=$(awk -v b="$back" -v c="$caught" 'BEGIN {printf "%.1f", 1000 * (b - c)}')
  fi
  # A step's mean time over the run, from the survivors' samples a second.
  step_ms=$(for i in $(seq 1 $((n - 1))); do sed -n 's/.*"samples_per_s":\([0-9.]*\).*/\1/p' "$d/w$i.out"; done |
    awk -v b="$batch" '$1 > 0 {s += 1000 * b / $1; k++} END {if (k) printf "%.1f", s / k; else print "-"}')
  printf '%-10s %-15s %9s %9s %9s %9s %9s\n' "$cond" "$scheme" "$out" "$back" "$step_ms" "$caught" "$rejoin" \
    >> "$work/recovery"
  echo "  $cond $scheme: out of the survivors' rounds after $out s, back after $back s (caught up after $caught s," \
    "then $rejoin ms); a step takes $step_ms ms" >&2
}

# The evaluations (training seconds since the first worker's first step,
# accuracy) of the rumor workers' logs in $3 into the CSV, and the run's
# row. Every time is less the time the worker itself spent evaluating
# until then ("evaluated in X s" on each evaluation line), so the figures
# do not depend on EVALS; wall: from that first step to the end of the
# last worker's training, the same way.
collect() {
  cond=$1 scheme=$2 d=$3
  t0=$(for i in $(seq 1 "$n"); do grep -m1 "first step" "$d/w$i.log"; done | log_secs | sort -n | head -1)
  walls=""
  for i in $(seq 1 "$n"); do
    grep -E "step [0-9]+: train loss .* test accuracy|epoch .* done at step .* test accuracy" "$d/w$i.log" |
      awk -v t0="$t0" -v c="$cond" -v s="$scheme" -v w="$i" '{
        split($1, a, ":"); t = a[1] * 3600 + a[2] * 60 + a[3] - t0; if (t < -43200) t += 86400
        for (k = 1; k <= NF; k++) {
          if ($k == "accuracy") acc = $(k + 1)
          if ($k == "(evaluated" && $(k + 1) == "in") spent += $(k + 2)
        }
        sub(/,$/, "", acc); printf "%s,%s,%d,%.3f,%s\n", c, s, w, t - spent, acc }' >> "$out_csv"
    spent=$(sed -n 's/.*(evaluated in \([0-9.]*\) s).*/\1/p' "$d/w$i.log" | awk '{s += $1} END {print s + 0}')
    # The end of training (the final evaluation after it is not counted, as
    # for the anchors), or the last line of a worker that did not get there.
    last=$(grep "training done after" "$d/w$i.log" | tail -1)
    [ -n "$last" ] || last=$(tail -1 "$d/w$i.log")
    walls="$walls $(echo "$last" | log_secs | awk -v t0="$t0" -v e="$spent" '{
      t = $1 - t0; if (t < -43200) t += 86400; print t - e }')"
  done
  finished=0 accs="" done_list=""
  for i in $(seq 1 "$n"); do
    a=$(sed -n 's/.*"test_accuracy":\([0-9.]*\).*/\1/p' "$d/w$i.out")
    [ -n "$a" ] && finished=$((finished + 1)) && accs="$accs $a" && done_list="$done_list $i"
  done
  report "$cond" "$scheme" "$finished" "$accs" "$(echo "$walls" | tr ' ' '\n' | sort -n | tail -1)" "$done_list"
}

# One parameter-server run: condition $1, scheme $2, --staleness $3; two
# servers (on hosts 1 and 2 under slow links), each holding half the
# parameters.
run_ps() {
  cond=$1 scheme=$2 stale=$3 d=$work/$1-$2
  mkdir -p "$d"
  "$rumor" keygen --cluster -o "$d/cluster.key" >/dev/null 2>&1
  servers="" srv_pids=""
  for s in 1 2; do
    "$rumor" keygen -o "$d/s$s.key" >/dev/null 2>&1
    # shellcheck disable=SC2086
    $(host "$cond" "$s") "$rumor" ps --listen "$(addr "$cond" "$s"):0" --cluster-key "$d/cluster.key" \
      --identity "$d/s$s.key" --model "$model" --lr "$lr" --epochs "$epochs" --range "$((s - 1))/2" \
      --staleness "$stale" --workers "$n" --checkpoint "$d/s$s.safetensors" --checkpoint-every 1000000 \
      > "$d/s$s.out" 2> "$d/s$s.log" &
    srv_pids="$srv_pids $!"
    pids="$pids $!"
    for _ in $(seq 1 100); do grep -q '"listen"' "$d/s$s.out" 2>/dev/null && break; sleep 0.1; done
    servers="$servers${servers:+,}$(sed -n 's/.*"listen":"\([^"]*\)".*/\1/p' "$d/s$s.out")"
  done
  for i in $(seq 1 "$n"); do "$rumor" keygen -o "$d/id$i.key" >/dev/null 2>&1; done
  run_workers "$cond" "$d" false --sync ps --servers "$servers"
  for p in $srv_pids; do kill "$p" 2>/dev/null || true; done
  collect "$cond" "$scheme" "$d"
}

# One DDP run (condition $1).
run_ddp() {
  cond=$1 d=$work/$1-ddp
  mkdir -p "$d"
  strag=""
  [ "$cond" = straggler ] && strag="--straggler $((n - 1)) --slowdown 2"
  common="--data $data --world $n --epochs $epochs --batch $batch --lr $lr --hidden $hidden --eval-every $eval_every"
  run_pids=""
  if [ "$cond" = slow ] || { [ "$cond" = straggler ] && [ "$cpu_cap" -gt 0 ]; }; then
    # One process per rank: on its test host, or in its CPU share.
    # gloo finds its address from the host name (127.0.0.1 on a test host):
    # name the interface.
    ifname=lo master=127.0.0.1:$((29500 + $$ % 1000))
    [ "$cond" = slow ] && ifname=eth0 master=10.77.0.1:29500
    for i in $(seq 1 "$n"); do
      # shellcheck disable=SC2086
      $(wrap "$cond" "$i") env GLOO_SOCKET_IFNAME=$ifname "$py" "$src/tests/bench/ddp_fmnist.py" $common $strag \
        --rank "$((i - 1))" --master "$master" > "$d/r$i.out" 2> "$d/r$i.err" &
      run_pids="$run_pids $!"
      pids="$pids $!"
    done
  else
    # shellcheck disable=SC2086
    "$py" "$src/tests/bench/ddp_fmnist.py" $common $strag > "$d/r1.out" 2> "$d/r1.err" &
    run_pids=$!
    pids="$pids $!"
    if [ "$cond" = killed ]; then
      # The last rank's process: mp.spawn's children, in start order.
      sleep 1
      victim=""
      while [ -z "$victim" ] && kill -0 "$run_pids" 2>/dev/null; do
        victim=$(pgrep -P "$run_pids" -f spawn_main 2>/dev/null | sort -n | tail -1 || true)
        sleep 0.2
      done
      (while :; do
        s=$(sed -n 's/.*"step":\([0-9]*\).*/\1/p' "$d/r1.out" 2>/dev/null | tail -1)
        [ -n "$s" ] && [ "$s" -ge "$half" ] && break
        kill -0 "$run_pids" 2>/dev/null || exit 0
        sleep 0.2
      done; kill_tree "$victim") &
    fi
  fi
  t0=$(now)
  wait_all "$run_pids"
  t1=$(now)
  cat "$d"/r*.out > "$d/all.out"
  anchor_rows "$cond" ddp "$d/all.out" "$(echo "$t1 $t0" | awk '{print $1 - $2}')"
}

# An anchor's JSON lines in $3 (ddp_fmnist.py's format): rank 0's
# evaluations into the CSV, and the run's row; $4: the wall time when no
# rank finished.
anchor_rows() {
  grep '"eval":true' "$3" | sed -n 's/.*"t":\([0-9.]*\),"test_accuracy":\([0-9.]*\).*/\1 \2/p' |
    awk -v c="$1" -v s="$2" '{printf "%s,%s,1,%s,%s\n", c, s, $1, $2}' >> "$out_csv"
  accs=$(grep -v '"eval"' "$3" | sed -n 's/.*"test_accuracy":\([0-9.]*\).*/\1/p' | tr '\n' ' ')
  secs=$(grep -v '"eval"' "$3" | sed -n 's/.*"seconds":\([0-9.]*\).*/\1/p' | sort -n | tail -1)
  # Rank 0's evaluations held up the run; its "t" already leaves them out.
  spent=$(sed -n 's/.*"eval_seconds":\([0-9.]*\).*/\1/p' "$3" | sort -n | tail -1)
  [ -n "$secs" ] && secs=$(echo "$secs ${spent:-0}" | awk '{printf "%.2f", $1 - $2}')
  report "$1" "$2" "$(echo "$accs" | wc -w)" "$accs" "${secs:-$4}"
}

run_hivemind() {
  cond=$1 d=$work/$1-hivemind
  mkdir -p "$d"
  if [ ! -f "$src/tests/bench/hivemind_fmnist.py" ] || ! "$src/tests/bench/hivemind-venv.sh" "$venv" > "$d/venv.log" 2>&1
  then
    why=$(tail -1 "$d/venv.log" 2>/dev/null || echo "tests/bench/hivemind_fmnist.py is missing")
    printf '%-10s %-14s skipped: %s\n' "$cond" hivemind "$why" >> "$work/table"
    return 0
  fi
  common="--data $data --world $n --epochs $epochs --batch $batch --lr $lr --hidden $hidden --eval-every $eval_every"
  strag=""
  [ "$cond" = straggler ] && strag="--straggler $((n - 1)) --slowdown 2"
  if [ "$cond" = slow ] || [ "$cond" = killed ] || { [ "$cond" = straggler ] && [ "$cpu_cap" -gt 0 ]; }; then
    # One process per rank (on its test host under slow links, in its CPU
    # share under the straggler): worker 0
    # writes its multiaddrs to a file the others read; a killed rank does
    # not end the others' run, as the launcher would.
    run_pids=""
    for i in $(seq 1 "$n"); do
      # shellcheck disable=SC2086
      $(wrap "$cond" "$i") "$venv/bin/python" "$src/tests/bench/hivemind_fmnist.py" $common $strag --rank "$((i - 1))" \
        --host "$(addr "$cond" "$i")" --peers-file "$d/peers" > "$d/r$i.out" 2> "$d/r$i.err" &
      run_pids="$run_pids $!"
      pids="$pids $!"
    done
    if [ "$cond" = killed ]; then
      victim=$!
      (while :; do
        s=$(sed -n 's/.*"step":\([0-9]*\).*/\1/p' "$d/r1.out" 2>/dev/null | tail -1)
        [ -n "$s" ] && [ "$s" -ge "$half" ] && break
        kill -0 "$victim" 2>/dev/null || exit 0
        sleep 0.2
      done; kill_tree "$victim") &
    fi
    wait_all "$run_pids"
    cat "$d"/r*.out > "$d/all.out"
  else
    # shellcheck disable=SC2086
    "$venv/bin/python" "$src/tests/bench/hivemind_fmnist.py" $common $strag > "$d/all.out" 2> "$d/err" &
    p=$!
    pids="$pids $p"
    wait_all "$p"
  fi
  anchor_rows "$cond" hivemind "$d/all.out" nan
}

# A table row: condition, scheme, workers finished, their accuracies, wall
# s, and (rumor) the finished workers' numbers. Time to target: when every
# finished worker had reached it ("-" when one never did); the anchors
# report worker 1's evaluations only.
report() {
  tt=$(awk -F, -v c="$1" -v s="$2" -v target="$target" -v fin="${6:- 1}" '
    BEGIN {nf = split(fin, f, " "); for (i = 1; i <= nf; i++) need[f[i]] = 1}
    $1 == c && $2 == s && $5 >= target && !($3 in first) {first[$3] = $4}
    END {m = -1; for (w in need) {if (!(w in first)) {print "-"; exit} if (first[w] > m) m = first[w]}
      if (m < 0) print "-"; else printf "%.1f", m}' "$out_csv")
  stats=$(echo "$4" | awk '{lo = 2; s = 0; for (i = 1; i <= NF; i++) {s += $i; if ($i < lo) lo = $i}
    if (NF) printf "%.4f %.4f", s / NF, lo; else print "- -"}')
  # shellcheck disable=SC2086
  printf '%-10s %-14s %9s %9s %9s %9.1f %6s\n' "$1" "$2" "$tt" $stats "$5" "$3/$n" >> "$work/table"
  echo "  $1 $2: time to $target ${tt} s, accuracy $stats, $5 s, $3/$n finished" >&2
}

for cond in $conditions; do
  if [ "$cond" = slow ]; then
    if ! "$src/deploy/testnet.sh" check 2>"$work/why"; then
      printf '%-10s %-14s skipped: %s\n' slow all "$(cat "$work/why")" >> "$work/table"
      continue
    fi
    TESTNET_NAME=rbs TESTNET_OWNER=$$ "$src/deploy/testnet.sh" up "$n" >/dev/null
    net_up=true
    export TESTNET_NAME=rbs
    "$src/deploy/testnet.sh" shape all delay 10 rate 200 >/dev/null
  fi
  for scheme in $schemes; do
    case $scheme in
    gossip) run_rumor "$cond" gossip "" ;;
    gossip-mls) run_rumor "$cond" gossip-mls "--max-local-steps 4" ;;
    allreduce) run_rumor "$cond" allreduce "--sync allreduce" ;;
    allreduce-swim)
      case $cond in
      killed | stopped) run_rumor "$cond" allreduce-swim "--sync allreduce --heartbeat-ms 0" ;;
      *) printf '%-10s %-14s skipped: the same as allreduce without a failure\n' "$cond" allreduce-swim >> "$work/table" ;;
      esac
      ;;
    ps0) run_ps "$cond" ps0 0 ;;
    ps4) run_ps "$cond" ps4 4 ;;
    psasp) run_ps "$cond" psasp none ;;
    ddp) run_ddp "$cond" ;;
    hivemind) run_hivemind "$cond" ;;
    *) echo "bench-sync.sh: unknown scheme $scheme" >&2; exit 2 ;;
    esac
  done
  if [ "$cond" = slow ]; then
    "$src/deploy/testnet.sh" down >/dev/null 2>&1 || true
    net_up=false
    unset TESTNET_NAME
  fi
done

printf '\n%-10s %-14s %9s %9s %9s %9s %6s\n' condition scheme "to $target" "acc mean" "acc min" "wall s" "done"
cat "$work/table"
# The expectation: gossip / all-reduce time to target.
awk -v target="$target" '
  $2 == "gossip" && $3 != "-" {g[$1] = $3} $2 == "allreduce" && $3 != "-" {a[$1] = $3}
  $2 == "allreduce" {ad[$1] = $7} $2 == "gossip" {gd[$1] = $7}
  END {
    printf "\n"
    for (c in g) if (c in a) printf "%-10s all-reduce / gossip time to %s: %.2f%s\n", c, target, a[c] / g[c],
      (c == "straggler" || c == "slow") ? (a[c] / g[c] >= 1.3 ? " (expected >= 1.3: met)" : " (expected >= 1.3: NOT met)") : ""
    if ("killed" in gd) printf "killed     gossip finished %s workers, all-reduce %s\n", gd["killed"], ad["killed"]
  }' "$work/table"
if [ -s "$work/recovery" ]; then
  printf '\nrecovery: killed: from the SIGKILL to the survivors'"'"' first round without worker %d; stopped: from the\n' "$n"
  printf 'SIGSTOP to the same ("out"), and from the SIGCONT (%s s later) to their first round over all %d ("back")\n' \
    "$stop_s" "$n"
  printf '(stopped: "caught up", from the SIGCONT to the end of its catch-up; "rejoin", from there to "back")\n'
  printf '%-10s %-15s %9s %9s %9s %9s %9s\n' condition scheme "out s" "back s" "step ms" "caught s" "rejoin ms"
  cat "$work/recovery"
  # SWIM-only / heartbeat, per condition and figure.
  awk '$2 == "allreduce" {o[$1] = $3; b[$1] = $4} $2 == "allreduce-swim" {so[$1] = $3; sb[$1] = $4}
    END {for (c in o) if (c in so) {
      r = (o[c] > 0 && so[c] != "-") ? sprintf("%.1f", so[c] / o[c]) : "-"
      printf "%-10s out: %s s with the heartbeat, %s s with SWIM alone (%s times as long)", c, o[c], so[c], r
      if (c == "stopped") printf "; back: %s s and %s s", b[c], sb[c]
      printf "\n"}}' "$work/recovery"
fi
echo "evaluations: $out_csv (plot: $py tests/bench/plot_sync.py $out_csv docs/bench-sync.svg)"
