#!/usr/bin/env python3
"""Low-communication training side by side (issue #29, item 5): N peers train
one small GPT (AdamW inner, the same tokens in every row) under every sync
scheme, on loopback and on slow test hosts, and the table says what each
scheme buys: final validation loss, bytes sent per peer per training token,
wall time, and on the slow links the time to reach all-reduce's final loss.

Rows (each condition):
  one-4x       one process at N times the batch (rumor train; no network)
  alone        one peer alone on its 1/N of the tokens (peer 0's data)
  allreduce    all-reduce of every step's gradient (--sync allreduce)
  gossip       gossip averaging every step (--sync gossip)
  diloco-H     DiLoCo, H inner steps a round (--sync allreduce --outer nesterov)
  diloco-50-i8, diloco-50-topk   ... with --outer-compress i8 or topk:0.03:2
  diloco-10-topk                 top-k at H=10: topk:0.006:2, --outer-momentum 0.9, --outer-lr 3
  diloco-H-overlap               ... with --outer-overlap
  diloco-50-overlapT             ... landing T steps after the boundary (--outer-overlap-steps)
  noloco-H     NoLoCo (--sync gossip --outer nesterov)

Targets (printed PASS or MISS beside the figures; loopback):
  recovery (alone - scheme) / (alone - allreduce) >= 0.7 for diloco-50 and
  noloco-50; bytes per token at least 45x below allreduce for diloco-50 and
  1000x for diloco-50-topk and diloco-10-topk, at most 0.02 above diloco-50's
  loss;
  slow links: the outer schemes reach allreduce's final loss at least 3x
  sooner than allreduce does (they may train past the token budget:
  SLOW_FACTOR times the steps).

Every peer starts from the same seed (--no-state-pull: nobody pulls a state
at the start, so the bytes are the scheme's and the membership's alone).
Run as root for the slow condition (deploy/testnet.sh: network namespaces;
skipped with the reason otherwise). Writes a CSV of every row and every
evaluation (OUT, default bench-lowcomm.csv) and prints a Markdown table.

  tests/bench/bench-lowcomm.sh [BUILD_DIR]
  env: N (4), MODEL (gpt:L2-H2-C64-T64-V256), BATCH (8), STEPS (1000),
       LR (3e-3), HS ("10 50 200"), CONDITIONS ("loopback slow"),
       SCHEDULE (cosine, or constant: the inner learning rate's), ROWS (all),
       OUTER_LR (rumor's default), OUTER_MOMENTUM (default),
       SLOW_DELAY_MS (25: each host's egress, so 50 ms RTT), SLOW_RATE_MBIT (50),
       SLOW_FACTOR (2), THREADS (1), RUN_TIMEOUT (3600 s), OUT, DATA (the KJV text),
       EVAL_WINDOWS (1024: the validation windows every row evaluates),
       SPLIT (strided: rumor's --shard; books: each peer on its contiguous 1/N),
       TOPK (topk:0.03:2: the diloco-50-topk row's --outer-compress),
       TOPK10 (topk:0.006:2: the diloco-10-topk row's),
       OVERLAP_STEPS (5: the diloco-50-overlapT row's --outer-overlap-steps)
"""
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import time

SRC = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BUILD = sys.argv[1] if len(sys.argv) > 1 else os.path.join(SRC, "build")
RUMOR = os.path.join(BUILD, "peer", "rumor")
TESTNET = os.path.join(SRC, "deploy", "testnet.sh")
ENV = os.environ
N = int(ENV.get("N", "4"))
MODEL = ENV.get("MODEL", "gpt:L2-H2-C64-T64-V256")
BATCH = int(ENV.get("BATCH", "8"))
STEPS = int(ENV.get("STEPS", "1000"))
LR = ENV.get("LR", "3e-3")
SCHEDULE = ENV.get("SCHEDULE", "cosine")
HS = [int(h) for h in ENV.get("HS", "10 50 200").split()]
CONDITIONS = ENV.get("CONDITIONS", "loopback slow").split()
THREADS = ENV.get("THREADS", "1")
RUN_TIMEOUT = float(ENV.get("RUN_TIMEOUT", "3600"))
SLOW_DELAY = ENV.get("SLOW_DELAY_MS", "25")
SLOW_RATE = ENV.get("SLOW_RATE_MBIT", "50")
SLOW_FACTOR = float(ENV.get("SLOW_FACTOR", "2"))
OUT = ENV.get("OUT", "bench-lowcomm.csv")
TOPK = ENV.get("TOPK", "topk:0.03:2")
TOPK10 = ENV.get("TOPK10", "topk:0.006:2")
OVERLAP_STEPS = int(ENV.get("OVERLAP_STEPS", "5"))
# Every row evaluates the same first EVAL_WINDOWS validation windows: rumor
# evaluates 20 batches unless told (--eval-batches), which would give the
# 4x-batch row four times the windows of the others.
EVAL_WINDOWS = int(ENV.get("EVAL_WINDOWS", "1024"))
DATA = ENV.get("DATA", "/usr/local/share/rumor/kjv.txt")
# How the peers' data is split: "strided" (rumor's --shard i/N: every N-th
# window of one permutation, so every peer sees the same distribution) or
# "books" (peer i on the i-th contiguous 1/N of the text's training part,
# its own books, as sites with their own data: not IID). Every row of a
# split evaluates the same validation windows (the text's last 10 %).
SPLIT = ENV.get("SPLIT", "strided")
CONTEXT = int(re.search(r"-T(\d+)", MODEL).group(1)) if re.search(r"-T(\d+)", MODEL) else 1024
TESTNET_NAME = "rlc"

COMMON = ["--model", MODEL, "--optimizer", "adamw", "--lr", LR, "--schedule", SCHEDULE,
          "--warmup", "20", "--weight-decay", "0.1", "--grad-clip", "1.0", "--seed", "1", "--threads", THREADS, "--log-every", "0"]


BOOKS_DIR = None  # SPLIT=books: the token shards' directory (made by write_books)


def write_books(work):
    """SPLIT=books: llm.c token shards (uint16 bytes) of the text: DIR/p<i>/
    holds the i-th contiguous 1/N of the training part and the validation
    part (the last 10 %, as rumor's --val-fraction cuts it); DIR/all/ every
    quarter and the validation part, for the one process at N times the
    batch."""
    global BOOKS_DIR
    text = open(DATA, "rb").read()
    cut = len(text) - int(round(len(text) * 0.1))
    BOOKS_DIR = os.path.join(work, "books")

    def shard(path, chunk):
        with open(path, "wb") as f:
            f.write(struct.pack("<256i", 20240520, 1, len(chunk), *([0] * 253)))
            f.write(struct.pack(f"<{len(chunk)}H", *chunk))

    for name in [f"p{i}" for i in range(N)] + ["all"]:
        os.makedirs(os.path.join(BOOKS_DIR, name), exist_ok=True)
        shard(os.path.join(BOOKS_DIR, name, "kjv_val_000.bin"), text[cut:])
    for i in range(N):
        chunk = text[i * cut // N:(i + 1) * cut // N]
        shard(os.path.join(BOOKS_DIR, f"p{i}", "kjv_train_000.bin"), chunk)
        shard(os.path.join(BOOKS_DIR, "all", f"kjv_train_{i:03d}.bin"), chunk)


def data_flags(i):
    """Peer i's data (i None: all of it)."""
    if SPLIT == "books":
        return ["--data", os.path.join(BOOKS_DIR, "all" if i is None else f"p{i}")]
    return ["--data", DATA] + ([] if i is None else ["--shard", f"{i}/{N}"])


def outer_flags(extra):
    flags = list(extra)
    if "OUTER_LR" in ENV:
        flags += ["--outer-lr", ENV["OUTER_LR"]]
    if "OUTER_MOMENTUM" in ENV:
        flags += ["--outer-momentum", ENV["OUTER_MOMENTUM"]]
    return flags


def rows():
    """(name, kind, flags): kind 'train' (one process) or 'peers'."""
    out = [("one-4x", "train", ["--batch", str(BATCH * N), *data_flags(None)]),
           ("alone", "train", ["--batch", str(BATCH), *data_flags(0)]),
           ("allreduce", "peers", ["--sync", "allreduce"]),
           ("gossip", "peers", ["--sync", "gossip"])]
    for h in HS:
        out.append((f"diloco-{h}", "peers", outer_flags(["--sync", "allreduce", "--outer", "nesterov",
                                                          "--local-steps", str(h)])))
    out += [("diloco-50-i8", "peers", outer_flags(["--sync", "allreduce", "--outer", "nesterov", "--local-steps",
                                                  "50", "--outer-compress", "i8"])),
            ("diloco-50-topk", "peers", outer_flags(["--sync", "allreduce", "--outer", "nesterov", "--local-steps",
                                                    "50", "--outer-compress", TOPK])),
            # The same bytes spread over five times the rounds, with the
            # settings measured best (docs/benchmarks.md): 0.6 % of each
            # chunk, the accumulator decaying by 0.9, outer lr 3.
            ("diloco-10-topk", "peers", ["--sync", "allreduce", "--outer", "nesterov", "--local-steps", "10",
                                         "--outer-compress", TOPK10, "--outer-momentum", "0.9", "--outer-lr", "3"]),
            ]
    for h in HS:
        out.append((f"diloco-{h}-overlap", "peers", outer_flags(["--sync", "allreduce", "--outer", "nesterov",
                                                                "--local-steps", str(h), "--outer-overlap"])))
    out.append((f"diloco-50-overlap{OVERLAP_STEPS}", "peers",
                outer_flags(["--sync", "allreduce", "--outer", "nesterov", "--local-steps", "50", "--outer-overlap",
                             "--outer-overlap-steps", str(OVERLAP_STEPS)])))
    for h in HS:
        out.append((f"noloco-{h}", "peers", outer_flags(["--outer", "nesterov", "--local-steps", str(h)])))
    wanted = ENV.get("ROWS")
    return [r for r in out if not wanted or r[0] in wanted.split()]


def testnet(*args, check=True):
    env = dict(ENV, TESTNET_NAME=TESTNET_NAME, TESTNET_OWNER=str(os.getpid()))
    return subprocess.run([TESTNET, *args], env=env, check=check, capture_output=True, text=True)


def host_prefix(cond, i):
    if cond != "slow":
        return []
    return ["env", f"TESTNET_NAME={TESTNET_NAME}", TESTNET, "exec", str(i)]


def addr(cond, i):
    return f"10.77.0.{i}" if cond == "slow" else "127.0.0.1"


def wait_for(path, needle, secs):
    end = time.time() + secs
    while time.time() < end:
        if os.path.exists(path) and needle in open(path, errors="replace").read():
            return True
        time.sleep(0.05)
    return False


LOG_TIME = re.compile(r"^(\d\d):(\d\d):(\d\d\.\d+) ")
EVAL = re.compile(r"step (\d+): train loss [0-9.naninf]+, val loss ([0-9.]+)")
ROUND_EVAL = re.compile(r"step (\d+): val loss ([0-9.]+) after outer round")


def log_secs(line):
    m = LOG_TIME.match(line)
    return int(m.group(1)) * 3600 + int(m.group(2)) * 60 + float(m.group(3)) if m else None


def read_log(path):
    """(first step time, training done time, [(t, val_loss)]) of a log, times in
    seconds of the day; evaluations after outer rounds where there are any,
    else the trainer's own."""
    first = done = None
    plain, after = [], []
    for line in open(path, errors="replace"):
        t = log_secs(line)
        if t is None:
            continue
        if first is None and "first step" in line:
            first = t
        if "training done after" in line:
            done = t
        m = ROUND_EVAL.search(line)
        if m:
            after.append((t, float(m.group(2))))
            continue
        m = EVAL.search(line)
        if m:
            plain.append((t, float(m.group(2))))
    return first, done, after or plain


def result_line(path):
    for line in reversed(open(path, errors="replace").read().splitlines()):
        if line.startswith("{") and '"val_loss"' in line:
            return json.loads(line)
    return None


def eval_flags(batch):
    if EVAL_WINDOWS % batch:
        sys.exit(f"bench-lowcomm: EVAL_WINDOWS={EVAL_WINDOWS} is not a multiple of the batch {batch}")
    return ["--eval-batches", str(EVAL_WINDOWS // batch)]


def run_train(work, name, flags, steps):
    d = os.path.join(work, name)
    os.makedirs(d, exist_ok=True)
    t0 = time.time()
    with open(os.path.join(d, "out"), "w") as out, open(os.path.join(d, "log"), "w") as log:
        subprocess.run([RUMOR, "train", *COMMON, "--max-steps", str(steps), "--eval-every", str(max(steps // 20, 1)),
                        *eval_flags(int(flags[flags.index("--batch") + 1])), *flags],
                       stdout=out, stderr=log, timeout=RUN_TIMEOUT, check=False)
    r = result_line(os.path.join(d, "out"))
    _, _, evals = read_log(os.path.join(d, "log"))
    return {"val_loss": r["val_loss"] if r else float("nan"), "bytes_per_token": 0.0, "wall_s": time.time() - t0,
            "finished": 1 if r else 0, "evals": [(t - evals[0][0] if evals else 0, v) for t, v in evals]}


def run_peers(work, cond, name, flags, steps):
    d = os.path.join(work, f"{cond}-{name}")
    os.makedirs(d, exist_ok=True)
    subprocess.run([RUMOR, "keygen", "--cluster", "-o", f"{d}/cluster.key"], capture_output=True, check=True)
    for i in range(N + 1):
        subprocess.run([RUMOR, "keygen", "-o", f"{d}/id{i}.key"], capture_output=True, check=True)
    procs = []
    try:
        boot = subprocess.Popen(host_prefix(cond, 1) + [RUMOR, "bootstrap", "--listen", f"{addr(cond, 1)}:0",
                                "--cluster-key", f"{d}/cluster.key", "--identity", f"{d}/id0.key"],
                                stdout=open(f"{d}/boot.out", "w"), stderr=open(f"{d}/boot.log", "w"))
        procs.append(boot)
        if not wait_for(f"{d}/boot.out", '"listen"', 30):
            raise RuntimeError(f"bootstrap did not start: {open(f'{d}/boot.log').read()}")
        baddr = re.search(r'"listen":"([^"]*)"', open(f"{d}/boot.out").read()).group(1)
        h = next((int(flags[k + 1]) for k in range(len(flags) - 1) if flags[k] == "--local-steps"), 0)
        every = h if h else max(steps // 20, 1)
        peers = []
        for i in range(1, N + 1):
            cmd = host_prefix(cond, i) + [RUMOR, "peer", *COMMON, "--bootstrap", baddr, "--listen",
                                          f"{addr(cond, i)}:0", "--cluster-key", f"{d}/cluster.key",
                                          "--identity", f"{d}/id{i}.key", *data_flags(i - 1), "--batch",
                                          str(BATCH), "--max-steps", str(steps), "--eval-every", str(every),
                                          *eval_flags(BATCH),
                                          "--wait-peers", str(N), "--no-state-pull", "--name", f"w{i}", *flags]
            p = subprocess.Popen(cmd, stdout=open(f"{d}/w{i}.out", "w"), stderr=open(f"{d}/w{i}.log", "w"))
            procs.append(p)
            peers.append(p)
        end = time.time() + RUN_TIMEOUT
        for p in peers:
            try:
                p.wait(timeout=max(end - time.time(), 1))
            except subprocess.TimeoutExpired:
                p.kill()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    losses, bpt, firsts, dones, evals, waits = [], [], [], [], [], []
    for i in range(1, N + 1):
        r = result_line(f"{d}/w{i}.out")
        first, done, ev = read_log(f"{d}/w{i}.log")
        if first is not None:
            firsts.append(first)
        if done is not None:
            dones.append(done)
        if r:
            losses.append(r["val_loss"])
            bpt.append(r.get("bytes_out", 0) / (r["steps"] * BATCH * CONTEXT))
            waits.append(r.get("outer_wait_s", 0.0))
        evals.append(ev)
    t0 = min(firsts) if firsts else 0
    # A scheme's loss curve: at each evaluation time, the mean of every
    # peer's latest evaluation.
    merged = sorted((t - t0, i, v) for i, ev in enumerate(evals) for t, v in ev)
    latest, curve = {}, []
    for t, i, v in merged:
        latest[i] = v
        if len(latest) == len(evals):
            curve.append((t, sum(latest.values()) / len(latest)))
    mean = lambda xs: sum(xs) / len(xs) if xs else float("nan")
    return {"val_loss": mean(losses), "bytes_per_token": mean(bpt), "outer_wait_s": mean(waits),
            "wall_s": (max(dones) - t0) if dones else float("nan"), "finished": len(losses), "evals": curve}


def time_to(curve, target):
    for t, v in curve:
        if v <= target:
            return t
    return float("nan")


def main():
    if not os.access(RUMOR, os.X_OK):
        sys.exit(f"build first: {RUMOR} is missing")
    if SPLIT not in ("strided", "books"):
        sys.exit(f"bench-lowcomm: SPLIT must be strided or books, not '{SPLIT}'")
    work = tempfile.mkdtemp(prefix="bench-lowcomm-")
    if SPLIT == "books":
        write_books(work)
    conds = list(CONDITIONS)
    if "slow" in conds:
        chk = testnet("check", check=False)
        if chk.returncode != 0:
            print(f"bench-lowcomm: slow condition skipped: {chk.stderr.strip()}", file=sys.stderr)
            conds.remove("slow")
    cpu = "AVX-512" if "avx512f" in open("/proc/cpuinfo").read() else "AVX2"
    print(f"bench-lowcomm: {N} peers, {MODEL}, batch {BATCH} x {CONTEXT} tokens, {STEPS} steps, AdamW lr {LR}; "
          f"{SCHEDULE} schedule, {SPLIT} split; {os.cpu_count()} CPUs ({cpu}); conditions {' '.join(conds)}",
          file=sys.stderr)
    results = {}
    csv = open(OUT, "w")
    csv.write("condition,row,val_loss,bytes_per_token,wall_s,finished,t,eval_loss\n")
    try:
        for cond in conds:
            if cond == "slow":
                testnet("up", str(N))
                testnet("shape", "all", "delay", SLOW_DELAY, "rate", SLOW_RATE)
            for name, kind, flags in rows():
                if kind == "train" and cond != conds[0]:
                    results[(cond, name)] = results[(conds[0], name)]  # no network: the same run
                    continue
                outer = "--outer" in flags
                steps = int(STEPS * SLOW_FACTOR) if cond == "slow" and outer else STEPS
                print(f"bench-lowcomm: {cond} {name} ...", file=sys.stderr, flush=True)
                r = run_train(work, name, flags, steps) if kind == "train" else run_peers(work, cond, name, flags,
                                                                                        steps)
                results[(cond, name)] = r
                csv.write(f"{cond},{name},{r['val_loss']:.5f},{r['bytes_per_token']:.4f},{r['wall_s']:.2f},"
                          f"{r['finished']},,\n")
                for t, v in r["evals"]:
                    csv.write(f"{cond},{name},,,,,{t:.3f},{v:.5f}\n")
                csv.flush()
                print(f"  val_loss {r['val_loss']:.4f}  bytes/token {r['bytes_per_token']:.2f}  wall "
                      f"{r['wall_s']:.1f} s  waited for outer rounds {r.get('outer_wait_s', 0.0):.1f} s  finished "
                      f"{r['finished']}", file=sys.stderr, flush=True)
            if cond == "slow":
                testnet("down", check=False)
    finally:
        if "slow" in conds:
            testnet("down", check=False)
        if ENV.get("KEEP"):
            print(f"bench-lowcomm: kept {work}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)
    report(results, conds)


def report(results, conds):
    for cond in conds:
        ar = results.get((cond, "allreduce"))
        alone = results.get((cond, "alone"))
        print(f"\n### {cond}\n")
        hdr = "| row | val loss | recovery | bytes/token/peer | vs allreduce | wall s |"
        if cond == "slow":
            hdr += " s to allreduce's loss | speed-up |"
        print(hdr)
        print("|" + "---|" * (hdr.count("|") - 1))
        for name, _, _ in rows():
            r = results.get((cond, name))
            if not r:
                continue
            rec = (alone["val_loss"] - r["val_loss"]) / (alone["val_loss"] - ar["val_loss"]) if ar and alone else float("nan")
            ratio = ar["bytes_per_token"] / r["bytes_per_token"] if ar and r["bytes_per_token"] > 0 else float("nan")
            line = (f"| {name} | {r['val_loss']:.4f} | {rec:.2f} | {r['bytes_per_token']:.2f} | "
                    f"{ratio:.0f}x | {r['wall_s']:.1f} |")
            if cond == "slow" and ar:
                t_ar = time_to(ar["evals"], ar["val_loss"] + 1e-9)
                t = time_to(r["evals"], ar["val_loss"] + 1e-9)
                line += f" {t:.1f} | {t_ar / t if t == t and t > 0 else float('nan'):.1f}x |"
            print(line)
        checks = []
        d50, n50 = results.get((cond, "diloco-50")), results.get((cond, "noloco-50"))
        if ar and alone:
            for name, r in (("diloco-50", d50), ("noloco-50", n50)):
                if r:
                    rec = (alone["val_loss"] - r["val_loss"]) / (alone["val_loss"] - ar["val_loss"])
                    checks.append((f"{name} recovers >= 0.7 of the alone-to-allreduce gap", rec >= 0.7, f"{rec:.2f}"))
            if d50 and d50["bytes_per_token"] > 0:
                x = ar["bytes_per_token"] / d50["bytes_per_token"]
                checks.append(("diloco-50 sends >= 45x fewer bytes per token than allreduce", x >= 45, f"{x:.0f}x"))
            for name in ("diloco-50-topk", "diloco-10-topk"):
                topk = results.get((cond, name))
                if not topk or topk["bytes_per_token"] <= 0:
                    continue
                x = ar["bytes_per_token"] / topk["bytes_per_token"]
                checks.append((f"{name} sends >= 1000x fewer", x >= 1000, f"{x:.0f}x"))
                if d50:
                    extra = topk["val_loss"] - d50["val_loss"]
                    checks.append((f"{name} at most 0.02 above diloco-50", extra <= 0.02, f"{extra:+.4f}"))
        if cond == "slow" and ar:
            t_ar = time_to(ar["evals"], ar["val_loss"] + 1e-9)
            for name in ("diloco-50", "noloco-50", "diloco-50-overlap"):
                r = results.get((cond, name))
                if r:
                    t = time_to(r["evals"], ar["val_loss"] + 1e-9)
                    ok = t == t and t_ar / t >= 3
                    checks.append((f"{name} reaches allreduce's loss >= 3x sooner", ok,
                                   f"{t_ar:.1f} s vs {t:.1f} s" if t == t else "never"))
        for what, ok, fig in checks:
            print(f"{'PASS' if ok else 'MISS'}  {what}: {fig}")


if __name__ == "__main__":
    main()
