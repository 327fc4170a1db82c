#!/usr/bin/env python3
"""Why 4 gossiping AdamW peers trail one process on their pooled batch.

A simulation in plain PyTorch (Debian's 1.13 will do), with the GPT of
tests/scripts/gpt_torch.py: N replicas, each with its own AdamW state and its
own quarter of the windows, take a step on their own batch and are then
averaged exactly (the limit of perfect gossip), against one process at N
times the batch. The second moment AdamW divides by can be each replica's own
(what rumor peer does), the mean gradient's (an oracle: it needs every
replica's gradient), or an estimate from the replica's own gradient noise
(--vmode noise: v - (1 - 1/N)·s, s the variance of the gradient around its
momentum, at least v/N). Instead of the exact mean, --gossip P averages
random disjoint pairs (each with probability P per tick), by the snapshots'
difference as rumor peer does, --delay D ticks after the snapshots, and
--speeds makes the replicas uneven (the fastest finishes first and averages
on). Prints the validation loss of the replicas' mean on 160 held-out
windows.

  adamw_averaging_sim.py --mode single --batch 8
  adamw_averaging_sim.py --mode average --batch 8 --replicas 4 --vmode own
  adamw_averaging_sim.py --mode average --gossip 1 --delay 1 --speeds 0.87,0.78,0.92,1

The learning rate follows rumor's schedule (warm-up 30, cosine), weight decay
0.1 on matrices, gradient clip 1.0 per replica, as tests/bench/bench-gpt.sh.
"""
import argparse
import json
import os
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "scripts"))
from gpt_torch import GPT, lr_at, windows  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", choices=["single", "average"], default="single")
    ap.add_argument("--replicas", type=int, default=4)
    ap.add_argument("--batch", type=int, default=8, help="the pooled batch (each replica: batch / replicas)")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--config", default="2 4 128 64 256", help="layers heads width context vocabulary")
    ap.add_argument("--vmode", choices=["own", "mean", "noise"], default="own")
    ap.add_argument("--every", type=int, default=1, help="average every N steps")
    ap.add_argument("--grad-clip", type=float, default=1.0)
    ap.add_argument("--gossip", type=float, default=0.0,
                    help="instead of the exact mean: random disjoint pairs, each averaging with this probability")
    ap.add_argument("--speeds", default="", help="each replica's steps per tick, comma-separated, at most 1 "
                    "(uneven workers: the fastest finishes first and averages on); default all 1")
    ap.add_argument("--delay", type=int, default=0, help="ticks between an exchange's snapshots and their "
                    "application (rumor: about 1, the transfer overlaps the next step)")
    ap.add_argument("--alpha", type=float, default=0.5, help="the averaging weight of an exchange")
    ap.add_argument("--noise-n", type=float, default=0.0, help="N in the noise estimate (default: --replicas)")
    ap.add_argument("--data", default="/usr/local/share/rumor/kjv.txt")
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    torch.manual_seed(1)
    torch.set_num_threads(a.threads)
    L, H, C, T, V = map(int, a.config.split())
    model = GPT({"n_layer": L, "n_head": H, "n_embd": C, "n_positions": T, "vocab_size": V})
    model.init_gpt2(1)
    ps = list(model.hf_params().values())
    decay = torch.cat([torch.full((p.numel(),), 1.0 if p.dim() >= 2 else 0.0) for p in ps])

    def flat(ts):
        return torch.cat([t.reshape(-1) for t in ts])

    def load(vec):
        o = 0
        with torch.no_grad():
            for p in ps:
                p.copy_(vec[o:o + p.numel()].view_as(p))
                o += p.numel()

    data = np.frombuffer(open(a.data, "rb").read(), dtype=np.uint8).astype(np.int64)
    cut = len(data) - int(round(len(data) * 0.1))
    train, val = windows(data[:cut], T), windows(data[cut:], T)
    n = 1 if a.mode == "single" else a.replicas
    b = a.batch // n
    shards = [train[i * len(train) // n:(i + 1) * len(train) // n] for i in range(n)]
    rngs = [np.random.default_rng(1 + i) for i in range(n)]
    theta = [flat([p.detach() for p in ps]).clone() for _ in range(n)]
    m, v, s = ([torch.zeros_like(theta[0]) for _ in range(n)] for _ in range(3))
    b1, b2, eps, wd = 0.9, 0.999, 1e-8, 0.1
    gossip_rng = np.random.default_rng(99)
    nn = a.noise_n if a.noise_n > 0 else n

    def grad(i):
        load(theta[i])
        bt = torch.from_numpy(shards[i][rngs[i].integers(0, len(shards[i]), b)])
        logits = model(bt[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, V), bt[:, 1:].reshape(-1))
        for p in ps:
            p.grad = None
        loss.backward()
        g = flat([p.grad for p in ps])
        norm = g.norm()
        return g * (a.grad_clip / norm) if 0 < a.grad_clip < norm else g

    t0 = time.time()
    speeds = [float(x) for x in a.speeds.split(",")] if a.speeds else [1.0] * n
    if len(speeds) != n or min(speeds) <= 0 or max(speeds) > 1 or (a.vmode == "mean" and min(speeds) < 1):
        sys.exit("--speeds: %d values in (0, 1] (all 1 with --vmode mean)" % n)
    done, credit, tick = [0] * n, [0.0] * n, 0
    pending, busy = [], set()  # exchanges under way: (tick to apply, i, j, θ_j − θ_i at the snapshot)

    def apply_due(pending, tick):  # x + α·(x'_s − x_s) on both sides; returns those still under way
        for due, i, j, d in pending:
            if due <= tick:
                theta[i].add_(d, alpha=a.alpha)
                theta[j].add_(d, alpha=-a.alpha)
                busy.difference_update((i, j))
        return [p for p in pending if p[0] > tick]

    def adamw_step(i, g, gmean):  # replica i's step number done[i], on its gradient g
        step = done[i]
        lr = lr_at(step, a.steps, a.lr, 30)
        if a.vmode == "noise" and step > 0:  # the gradient's spread around the (bias-corrected) momentum
            d = g - m[i] / (1 - b1 ** step)
            s[i].mul_(b2).addcmul_(d, d, value=(1 - b2) / (1 + (1 - b1) / (1 + b1)))
        m[i].mul_(b1).add_(g, alpha=1 - b1)
        g2 = gmean if gmean is not None else g
        v[i].mul_(b2).addcmul_(g2, g2, value=1 - b2)
        bc1, bc2 = 1 - b1 ** (step + 1), 1 - b2 ** (step + 1)
        theta[i].mul_(1 - lr * wd * decay)
        u = v[i] / bc2
        if a.vmode == "noise":
            u = torch.maximum(u - (1 - 1 / nn) * s[i] / bc2, u / nn)
        theta[i].addcdiv_(m[i] / bc1, u.sqrt().add_(eps), value=-lr)
        done[i] += 1

    while min(done) < a.steps:  # a tick: each replica steps when its speed has added up to a step
        tick += 1
        active = []
        for i in range(n):
            credit[i] += speeds[i]
            if done[i] < a.steps and credit[i] >= 1:
                credit[i] -= 1
                active.append(i)
        gs = {i: grad(i) for i in active}
        gmean = sum(gs.values()) / n if a.vmode == "mean" else None
        for i in active:
            adamw_step(i, gs[i], gmean)
        if n > 1 and a.gossip > 0:  # finished replicas average on, as rumor peer --finish-wait-ms
            pending = apply_due(pending, tick)
            free = [i for i in gossip_rng.permutation(n) if i not in busy]
            for k in range(0, len(free) - 1, 2):
                if gossip_rng.random() < a.gossip:
                    i, j = free[k], free[k + 1]
                    pending.append((tick + a.delay, i, j, theta[j] - theta[i]))  # the snapshots' difference
                    busy.update((i, j))
            pending = apply_due(pending, tick)  # --delay 0: at once
        elif n > 1 and tick % a.every == 0:
            mean = sum(theta) / n
            for i in range(n):
                theta[i].copy_(mean)
    load(sum(theta) / n)
    with torch.no_grad():
        w = torch.from_numpy(val[:160])
        vl = F.cross_entropy(model(w[:, :-1]).reshape(-1, V), w[:, 1:].reshape(-1)).item()
    print(json.dumps({"mode": a.mode, "replicas": n, "batch": a.batch, "vmode": a.vmode, "lr": a.lr, "every": a.every,
                      "gossip": a.gossip, "delay": a.delay, "alpha": a.alpha, "speeds": a.speeds, "config": a.config,
                      "val_loss": round(vl, 4), "seconds": round(time.time() - t0, 1)}))


if __name__ == "__main__":
    main()
