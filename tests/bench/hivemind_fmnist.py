"""Hivemind 1.1 (hivemind.Optimizer with local updates) on the job of
tests/bench/ddp_fmnist.py: the decentralized anchor of tests/bench/bench-sync.sh
(issue #16, item 4). N processes, each training the MLP (784-512-256-10 by
default, ReLU, PyTorch's default Linear initialisation from the same seed) on
its 1/N of Fashion-MNIST (the shards of ddp_fmnist.py) for EPOCHS passes at
batch B, SGD with momentum 0.9 and a cosine learning-rate schedule from LR to 0
over each worker's own steps, pixels normalised by the training set's mean and
standard deviation, as rumor does. Every worker steps on its own gradients
(use_local_updates=True); each time the workers together have processed
target_batch_size = AVERAGE_EVERY * N * B samples (a Hivemind "epoch", nominally
every AVERAGE_EVERY local steps of each worker), a round averages their
parameters (Hivemind's state averaging; momentum buffers stay local). Hivemind
1.1 starts that round in the background but makes the worker's next step wait
for it, so every round stalls training for its length (0.2 to 0.6 s on a
2-core machine's loopback, with --matchmaking-time 0.5 and 0.2 alike); and its
progress tracker,
which extrapolates the others' sample counts between DHT reports, ends epochs
more often than nominal when rounds are long next to steps. A group holding
every worker starts its all-reduce at once; a smaller one after
--matchmaking-time; a round that finds no group gives up after
--averaging-timeout.

Worker 0 starts the DHT (p2pd on HOST) and writes its multiaddrs to a file; the
others join through them (--initial-peers, or --peers-file that they wait for);
all wait until every worker has announced itself in the DHT before the first
step. Without --rank the script starts the N workers itself, one process each,
on 127.0.0.1.

Output as ddp_fmnist.py's: one JSON line per worker at the end
  {"rank":0,"test_accuracy":0.8977,"steps":4690,"seconds":61.2,"eval_seconds":0.0,"epoch":1172}
(epoch: the worker's Hivemind epoch at the end) and, with --eval-every N,
worker 0's test accuracy every N of its steps:
  {"rank":0,"eval":true,"step":400,"t":12.5,"test_accuracy":0.84}
(t: seconds since its first step, as the final line's seconds, less the
time of its earlier evaluations, whose total is eval_seconds). --slowdown X
makes worker --straggler's steps X times as long.

usage: hivemind_fmnist.py --data DIR [--world 4] [--epochs 10] [--batch 32]
                          [--lr 0.05] [--threads 1] [--seed 1] [--hidden 512,256]
                          [--eval-every N] [--slowdown X --straggler R]
                          [--average-every 8] [--matchmaking-time 0.5]
                          [--averaging-timeout 5] [--host 127.0.0.1]
                          [--rank R (--initial-peers MADDR[,..] | --peers-file F)]
                          [--run-id fmnist] [--log-dir DIR] [--max-steps N] [--verbose]
Runs in the environment of tests/bench/hivemind-venv.sh.
"""
import argparse
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


# The data as the DDP anchor reads and normalises it (same directory).
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ddp_fmnist import job_args, load  # noqa: E402


def evaluate(model, xt, yt):
    with torch.no_grad():
        return (model(xt).argmax(1) == yt).float().mean().item()


def emit(obj):
    print(json.dumps(obj, separators=(",", ":")), flush=True)


def initial_peers(args):
    if args.initial_peers:
        return [p for p in args.initial_peers.split(",") if p]
    deadline = time.time() + args.join_timeout
    while time.time() < deadline:
        if os.path.exists(args.peers_file):
            with open(args.peers_file) as f:
                peers = [line.strip() for line in f if line.strip()]
            if peers:
                return peers
        time.sleep(0.1)
    sys.exit(f"hivemind_fmnist.py: rank {args.rank}: no multiaddr in {args.peers_file} after {args.join_timeout} s")


def barrier(dht, key, rank, world, timeout):
    """Announces this worker under `key` and waits until all `world` workers have."""
    from hivemind.utils import get_dht_time
    deadline, found = time.time() + timeout, None
    while time.time() < deadline:
        dht.store(key, subkey=rank, value=True, expiration_time=get_dht_time() + 3600)
        found = dht.get(key, latest=True)
        if found is not None and len(found.value) >= world:
            return
        time.sleep(0.2)
    n = 0 if found is None else len(found.value)
    sys.exit(f"hivemind_fmnist.py: rank {rank}: only {n} of {world} workers joined within {timeout} s")


def worker(args):
    import hivemind

    torch.set_num_threads(args.threads)
    xs, ys, xt, yt = load(args.data)
    g = torch.Generator().manual_seed(args.seed)
    shard = torch.randperm(len(xs), generator=g).chunk(args.world)[args.rank]
    torch.manual_seed(args.seed)  # the same initial model on every worker
    widths = [784] + [int(h) for h in args.hidden.split(",") if h] + [10]
    layers = []
    for i in range(len(widths) - 1):
        layers += [nn.Linear(widths[i], widths[i + 1])] + ([nn.ReLU()] if i < len(widths) - 2 else [])
    model = nn.Sequential(*layers)

    # Hivemind's p2pd and its clients talk over Unix sockets in /tmp that outlive processes killed or ended
    # by os._exit: this worker's go in a folder of its own, removed at the end (or by the launcher).
    sock_dir = args.sock_dir or tempfile.mkdtemp(prefix="hivemind-fmnist-")
    os.makedirs(sock_dir, exist_ok=True)
    hivemind.P2P._UNIX_SOCKET_PREFIX = f"/unix{os.path.abspath(sock_dir)}/"
    host_maddrs = [f"/ip4/{args.host}/tcp/0"]
    if args.rank == 0 and not args.initial_peers:
        dht = hivemind.DHT(host_maddrs=host_maddrs, start=True)
        if args.peers_file:
            tmp = args.peers_file + ".tmp"
            with open(tmp, "w") as f:
                f.write("".join(f"{m}\n" for m in dht.get_visible_maddrs()))
            os.rename(tmp, args.peers_file)
    else:
        dht = hivemind.DHT(host_maddrs=host_maddrs, initial_peers=initial_peers(args), start=True)

    sgd = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    opt = hivemind.Optimizer(
        dht=dht,
        run_id=args.run_id,
        target_batch_size=args.average_every * args.world * args.batch,
        batch_size_per_step=args.batch,
        optimizer=sgd,
        use_local_updates=True,
        matchmaking_time=args.matchmaking_time,
        averaging_timeout=args.averaging_timeout,
        # a full group (every worker) starts its all-reduce at once instead of waiting out matchmaking_time
        averager_opts=dict(target_group_size=args.world, request_timeout=min(3.0, args.matchmaking_time / 2)),
        # progress reports as often as the epochs are short; a worker that left is noticed within seconds
        tracker_opts=dict(min_refresh_period=min(0.5, args.matchmaking_time / 2), max_refresh_period=2.0,
                          default_refresh_period=min(1.0, args.matchmaking_time), metadata_expiration=10.0),
        verbose=args.verbose,
    )
    per_epoch = len(shard) // args.batch
    total = per_epoch * args.epochs
    barrier(dht, f"{args.run_id}_ready", args.rank, args.world, args.join_timeout)
    t0, eval_seconds = time.time(), 0.0
    step = 0
    for epoch in range(args.epochs):
        if args.max_steps and step >= args.max_steps:
            break
        order = shard[torch.randperm(len(shard), generator=g)]
        for i in range(per_epoch):
            if args.max_steps and step >= args.max_steps:
                break
            c0 = time.time()
            # ddp_fmnist.py's schedule: LambdaLR stepped after each step
            for group in sgd.param_groups:
                group["lr"] = args.lr * 0.5 * (1 + math.cos(math.pi * min(step, total) / total))
            idx = order[i * args.batch:(i + 1) * args.batch]
            loss = F.cross_entropy(model(xs[idx]), ys[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
            step += 1
            if args.verbose and step % 25 == 0:
                print(f"{time.strftime('%H:%M:%S')} rank {args.rank} step {step} epoch {opt.local_epoch}",
                      file=sys.stderr, flush=True)
            if args.rank == args.straggler and args.slowdown > 1:
                time.sleep((args.slowdown - 1) * (time.time() - c0))
            if args.eval_every and args.rank == 0 and step % args.eval_every == 0:
                e0 = time.time()
                acc = evaluate(model, xt, yt)
                emit({"rank": 0, "eval": True, "step": step, "t": round(e0 - t0 - eval_seconds, 3),
                      "test_accuracy": round(acc, 4)})
                eval_seconds += time.time() - e0
    seconds = time.time() - t0
    acc = evaluate(model, xt, yt)
    emit({"rank": args.rank, "test_accuracy": round(acc, 4), "steps": step, "seconds": round(seconds, 2),
          "eval_seconds": round(eval_seconds, 3), "epoch": opt.local_epoch})
    # Hivemind's shutdown may wait on a round in flight: bounded, then exit regardless. The pause lets
    # the tracker's goodbye (a DHT store it does not wait for) reach the others, who would otherwise
    # count this worker in and try to average with it until its record expires.
    done = threading.Thread(target=lambda: (opt.shutdown(), time.sleep(1.0), dht.shutdown()), daemon=True)
    done.start()
    done.join(args.averaging_timeout)
    shutil.rmtree(sock_dir, ignore_errors=True)


def launch(args):
    """Starts the N workers, one process each (worker 0 first), and waits for them all."""
    tmp = tempfile.mkdtemp(prefix="hivemind-fmnist-")
    peers_file = os.path.join(tmp, "peers")
    argv = sys.argv[1:]
    procs = []
    if args.log_dir:
        os.makedirs(args.log_dir, exist_ok=True)
    for rank in range(args.world):
        # Each worker leads a process group that holds its DHT, averager and p2pd processes too,
        # so that all of them go when the worker does.
        err = open(os.path.join(args.log_dir, f"w{rank}.log"), "w") if args.log_dir else None
        procs.append(subprocess.Popen([sys.executable, os.path.abspath(__file__)] + argv +
                                      ["--rank", str(rank), "--peers-file", peers_file, "--watch-parent",
                                       "--sock-dir", os.path.join(tmp, f"w{rank}")],
                                      stderr=err, start_new_session=True))
        if err:
            err.close()

    def cleanup():
        shutil.rmtree(tmp, ignore_errors=True)

    def kill_all(*_):
        for p in procs:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except OSError:
                pass
        cleanup()
        sys.exit(1)

    signal.signal(signal.SIGTERM, kill_all)
    signal.signal(signal.SIGINT, kill_all)
    rc = 0
    left = list(procs)
    while left:
        for p in list(left):
            code = p.poll()
            if code is None:
                continue
            left.remove(p)
            try:  # the worker's leftovers (a killed worker's DHT and averager processes, p2pd)
                os.killpg(p.pid, signal.SIGKILL)
            except OSError:
                pass
            if code != 0:
                print(f"hivemind_fmnist.py: worker {procs.index(p)} exited with {code}", file=sys.stderr, flush=True)
                rc = 1
        time.sleep(0.2)
    cleanup()
    return rc


def watch_parent():
    """Kills this worker's process group when the launcher is gone (e.g. SIGKILLed)."""
    parent = os.getppid()

    def watch():
        while os.getppid() == parent:
            time.sleep(0.5)
        os.killpg(os.getpgrp(), signal.SIGKILL)

    threading.Thread(target=watch, daemon=True).start()


def main():
    ap = argparse.ArgumentParser()
    job_args(ap)
    ap.add_argument("--host", default="127.0.0.1", help="the address p2pd listens on")
    ap.add_argument("--initial-peers", default="", help="worker 0's multiaddrs, comma-separated (ranks > 0)")
    ap.add_argument("--peers-file", default="", help="worker 0 writes its multiaddrs there, the others read them")
    ap.add_argument("--join-timeout", type=float, default=120.0)
    ap.add_argument("--average-every", type=int, default=8,
                    help="target_batch_size = this * world * batch: local steps per worker between averaging rounds")
    ap.add_argument("--matchmaking-time", type=float, default=0.5)
    ap.add_argument("--averaging-timeout", type=float, default=5.0)
    ap.add_argument("--run-id", default="fmnist")
    ap.add_argument("--log-dir", default="", help="each worker's stderr to DIR/wRANK.log instead of stderr")
    ap.add_argument("--max-steps", type=int, default=0, help="stop after this many steps (a quick try)")
    ap.add_argument("--verbose", action="store_true", help="Hivemind's progress and averaging log on stderr")
    ap.add_argument("--watch-parent", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--sock-dir", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rank < 0:
        sys.exit(launch(args))
    if args.rank > 0 and not (args.initial_peers or args.peers_file):
        sys.exit("hivemind_fmnist.py: --rank > 0 needs --initial-peers or --peers-file")
    if args.watch_parent:
        watch_parent()
    worker(args)
    sys.stdout.flush()
    os._exit(0)  # past a stuck shutdown of Hivemind's background processes


if __name__ == "__main__":
    main()
