"""PyTorch DDP (gloo all-reduce every step) on the job of deploy/local-cluster.sh:
N processes on one machine, each training the MLP (784-512-256-10, ReLU,
PyTorch's default Linear initialisation) on its 1/N of Fashion-MNIST for
EPOCHS passes at batch B, SGD with momentum 0.9 and a cosine learning-rate
schedule from LR to 0 over all steps, pixels normalised by the training set's
mean and standard deviation, as rumor does. The reference of
tests/bench/bench-ddp.sh (issue #15: rumor's 4 gossiping peers against DDP).

Prints one JSON line per rank at the end:
  {"rank":0,"test_accuracy":0.8977,"steps":4690,"seconds":61.2,"eval_seconds":0.0}
and, with --eval-every N, rank 0's test accuracy every N steps:
  {"rank":0,"eval":true,"step":400,"t":12.5,"test_accuracy":0.84}
(t: seconds since the first step, less the time of rank 0's earlier
evaluations, whose total is eval_seconds; seconds counts them). tests/bench/bench-sync.sh also uses it as
the all-reduce anchor: --hidden sets the layers, --slowdown X makes rank
--straggler's steps X times as long, and --rank R --master HOST:PORT runs
one rank alone (the others elsewhere, e.g. in test hosts' namespaces).

usage: ddp_fmnist.py --data DIR [--world 4] [--epochs 10] [--batch 32]
                     [--lr 0.05] [--threads 1] [--seed 1] [--hidden 512,256]
                     [--eval-every N] [--slowdown X --straggler R]
                     [--rank R --master HOST:PORT]
"""
import argparse
import gzip
import json
import math
import os
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F


def read_idx(path):
    for p in (path, path + ".gz"):
        if os.path.exists(p):
            with (gzip.open(p, "rb") if p.endswith(".gz") else open(p, "rb")) as f:
                data = f.read()
            break
    else:
        sys.exit(f"ddp_fmnist.py: {path}[.gz] not found")
    ndim = data[3]
    dims = [int.from_bytes(data[4 + 4 * i:8 + 4 * i], "big") for i in range(ndim)]
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim).reshape(dims)


def load(data_dir):
    xs = read_idx(os.path.join(data_dir, "train-images-idx3-ubyte")).reshape(-1, 784)
    ys = read_idx(os.path.join(data_dir, "train-labels-idx1-ubyte"))
    xt = read_idx(os.path.join(data_dir, "t10k-images-idx3-ubyte")).reshape(-1, 784)
    yt = read_idx(os.path.join(data_dir, "t10k-labels-idx1-ubyte"))
    x = xs.astype(np.float64) / 255.0
    mean, std = x.mean(), x.std()
    norm = lambda a: torch.from_numpy(((a.astype(np.float32) / 255.0 - mean) / std).astype(np.float32))
    return norm(xs), torch.from_numpy(ys.astype(np.int64)), norm(xt), torch.from_numpy(yt.astype(np.int64))


def evaluate(model, xt, yt):
    with torch.no_grad():
        return (model(xt).argmax(1) == yt).float().mean().item()


def worker(rank, args, master):
    torch.set_num_threads(args.threads)
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = master.rsplit(":", 1)
    dist.init_process_group("gloo", rank=rank, world_size=args.world)
    xs, ys, xt, yt = load(args.data)
    g = torch.Generator().manual_seed(args.seed)
    shard = torch.randperm(len(xs), generator=g).chunk(args.world)[rank]
    torch.manual_seed(args.seed)  # the same initial model on every rank (DDP also broadcasts rank 0's)
    widths = [784] + [int(h) for h in args.hidden.split(",") if h] + [10]
    layers = []
    for i in range(len(widths) - 1):
        layers += [nn.Linear(widths[i], widths[i + 1])] + ([nn.ReLU()] if i < len(widths) - 2 else [])
    model = nn.Sequential(*layers)
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=args.lr, momentum=0.9)
    per_epoch = len(shard) // args.batch
    total = per_epoch * args.epochs
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 * (1 + math.cos(math.pi * min(s, total) / total)))
    dist.barrier()
    t0, eval_seconds = time.time(), 0.0
    step = 0
    for epoch in range(args.epochs):
        order = shard[torch.randperm(len(shard), generator=g)]
        for i in range(per_epoch):
            idx = order[i * args.batch:(i + 1) * args.batch]
            c0 = time.time()
            loss = F.cross_entropy(ddp(xs[idx]), ys[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            step += 1
            if rank == args.straggler and args.slowdown > 1:
                time.sleep((args.slowdown - 1) * (time.time() - c0))
            if args.eval_every and rank == 0 and step % args.eval_every == 0:
                e0 = time.time()
                acc = evaluate(model, xt, yt)
                print(json.dumps({"rank": 0, "eval": True, "step": step, "t": round(e0 - t0 - eval_seconds, 3),
                                  "test_accuracy": round(acc, 4)}, separators=(",", ":")),
                      flush=True)
                eval_seconds += time.time() - e0
    seconds = time.time() - t0
    acc = evaluate(model, xt, yt)
    print(json.dumps({"rank": rank, "test_accuracy": round(acc, 4), "steps": step, "seconds": round(seconds, 2),
                      "eval_seconds": round(eval_seconds, 3)}, separators=(",", ":")),
          flush=True)
    dist.destroy_process_group()


def job_args(ap):
    """The job's options, shared with the other anchors (hivemind_fmnist.py)."""
    ap.add_argument("--data", required=True)
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--hidden", default="512,256")
    ap.add_argument("--eval-every", type=int, default=0)
    ap.add_argument("--slowdown", type=float, default=1.0)
    ap.add_argument("--straggler", type=int, default=-1)
    ap.add_argument("--rank", type=int, default=-1)


def main():
    ap = argparse.ArgumentParser()
    job_args(ap)
    ap.add_argument("--master", default="")
    args = ap.parse_args()
    if args.rank >= 0:
        if not args.master:
            sys.exit("ddp_fmnist.py: --rank needs --master HOST:PORT")
        worker(args.rank, args, args.master)
        return
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(worker, args=(args, "127.0.0.1:%d" % port), nprocs=args.world, join=True)


if __name__ == "__main__":
    main()
