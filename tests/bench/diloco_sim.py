#!/usr/bin/env python3
"""A PyTorch reference for rumor's outer schemes (issue #29): DiLoCo written the
way OpenDiLoCo and the DiLoCo paper's pseudo-code write it, with PyTorch's own
optimizers, on the model, data and schedule of tests/bench/bench-lowcomm.sh.

N replicas of the GPT of tests/scripts/gpt_torch.py, each with its own
torch.optim.AdamW (weight decay on matrices only, gradient clipping 1.0 per
replica, rumor's schedule: linear warm-up, then cosine to zero or constant)
and its own 1/N of the windows (--shards strided as rumor's --shard, or
contiguous: bench-lowcomm.sh's SPLIT=books). Every H inner steps the
pseudo-gradients (anchor - replica) are averaged and
torch.optim.SGD(nesterov=True) steps the anchor; the replicas restart from
it. A run ends with a round (as rumor's does). --noloco pairs the replicas
at random each round with rumor's NoLoCo rule; --overlap delayed is rumor's
--outer-overlap, --overlap eager the eager updates of Kale et al. 2025.
--every and --replicas 1 give the rows without an outer optimizer:

  --replicas 1 --batch 32      one process at 4x the batch (= all-reduce)
  --replicas 1 --batch 8       one peer alone (on its quarter: --alone)
  --replicas 4 --every 1       plain averaging after every step

What it is for: telling whether a loss gap of rumor's DiLoCo against all-reduce
is rumor's or the method's on this setup. Prints one JSON line per run with
the validation loss (the mean of the replicas') on the first
--val-windows held-out windows (the last 10 % of the text, as rumor's split).

Runs on PyTorch 2.x (the virtual environment tests/bench/bench-gpt.sh makes,
~/.cache/rumor/bench-venv) or Debian's 1.13. Figures: docs/benchmarks.md,
"Recovery at equal tokens, by protocol".

  python diloco_sim.py --replicas 4 --batch 8 --H 50 --outer-lr 1.0 --outer-momentum 0.5
  python diloco_sim.py --replicas 1 --batch 32
  python diloco_sim.py --replicas 1 --batch 8 --alone
"""
import argparse
import copy
import json
import os
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "scripts"))
from gpt_torch import GPT, lr_at, windows  # noqa: E402


def parse():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--replicas", type=int, default=4)
    ap.add_argument("--batch", type=int, default=8, help="windows per replica per step")
    ap.add_argument("--alone", action="store_true", help="--replicas 1 on a quarter of the windows")
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--schedule", choices=["cosine", "constant"], default="cosine")
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--grad-clip", type=float, default=1.0)
    ap.add_argument("--config", default="2 2 64 64 256", help="layers heads width context vocabulary")
    ap.add_argument("--H", type=int, default=50, help="inner steps a round")
    ap.add_argument("--every", type=int, default=0, help="plain averaging every N steps instead of an outer step")
    ap.add_argument("--outer-lr", type=float, default=1.0)
    ap.add_argument("--outer-momentum", type=float, default=0.5)
    ap.add_argument("--outer", choices=["nesterov", "sgd"], default="nesterov")
    ap.add_argument("--noloco", action="store_true",
                    help="NoLoCo instead of DiLoCo: random disjoint pairs each round, g_i = anchor_i - (phi_i + phi_j)/2 "
                    "(rumor's rule, peer/sync/sync.h), each replica with its own anchor and momentum")
    ap.add_argument("--overlap", choices=["none", "delayed", "eager"], default="none",
                    help="one-round-delayed outer steps: rumor's --outer-overlap (delayed) or eager updates")
    ap.add_argument("--shards", choices=["strided", "contiguous"], default="strided",
                    help="each replica's windows: rumor's --shard (strided over a permutation, IID) or a contiguous "
                    "1/N of the text (each on its own books)")
    ap.add_argument("--overlap-steps", type=int, default=0,
                    help="--overlap delayed: land a round this many inner steps after its boundary (0: at the next "
                    "boundary, H)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--val-windows", type=int, default=512)
    ap.add_argument("--data", default="/usr/local/share/rumor/kjv.txt")
    ap.add_argument("--threads", type=int, default=1)
    return ap.parse_args()


def main():
    a = parse()
    torch.manual_seed(a.seed)
    torch.set_num_threads(a.threads)
    L, Hh, C, T, V = map(int, a.config.split())
    base = GPT({"n_layer": L, "n_head": Hh, "n_embd": C, "n_positions": T, "vocab_size": V})
    base.init_gpt2(a.seed)
    data = np.frombuffer(open(a.data, "rb").read(), dtype=np.uint8).astype(np.int64)
    cut = len(data) - int(round(len(data) * 0.1))
    train, val = windows(data[:cut], T), windows(data[cut:], T)
    n = a.replicas
    parts = 4 if a.alone else n
    if a.shards == "strided":  # as rumor's --shard i/N: every N-th window of one permutation
        perm = np.random.default_rng(a.seed).permutation(len(train))
        shards = [train[perm[i::parts]] for i in range(n)]
    else:  # contiguous quarters of the text: each replica on its own books (not IID)
        shards = [train[i * len(train) // parts:(i + 1) * len(train) // parts] for i in range(n)]
    rngs = [np.random.default_rng(a.seed * 100 + i) for i in range(n)]
    models = [copy.deepcopy(base) for _ in range(n)]
    opts = []
    for m in models:
        ps = list(m.hf_params().values())
        groups = [{"params": [p for p in ps if p.dim() >= 2], "weight_decay": a.weight_decay},
                  {"params": [p for p in ps if p.dim() < 2], "weight_decay": 0.0}]
        opts.append(torch.optim.AdamW(groups, lr=a.lr, betas=(0.9, 0.999), eps=1e-8))
    # One anchor and outer optimizer per replica: identical but with eager
    # updates, where each replica steps on its own mix of outer gradients.
    anchors = [[p.detach().clone() for p in base.hf_params().values()] for _ in range(n)]
    outers = [torch.optim.SGD(anc, lr=a.outer_lr, momentum=a.outer_momentum,
                              nesterov=a.outer == "nesterov" and a.outer_momentum > 0) for anc in anchors]
    anchor, outer = anchors[0], outers[0]
    params = [list(m.hf_params().values()) for m in models]
    t0, rounds = time.time(), 0
    landed_marker = [None]  # --overlap-steps: the flight already landed mid-round
    flight = None  # overlap: (each replica's pseudo-gradient, their mean, each one's parameters) sent last boundary

    def pseudo(i):
        return [anchors[i][k] - params[i][k] for k in range(len(anchor))]

    def outer_step(i, g):
        with torch.no_grad():
            for k, p in enumerate(anchors[i]):
                p.grad = g[k].clone()
        outers[i].step()

    def mean_of(vs):
        return [sum(v[k] for v in vs) / n for k in range(len(vs[0]))]

    def set_params(i, vals):
        with torch.no_grad():
            for k, p in enumerate(params[i]):
                p.copy_(vals[k])

    def land_early():
        """--overlap delayed: the round in flight lands (at the next boundary,
        or --overlap-steps after its own); each replica keeps its progress
        since its boundary."""
        with torch.no_grad():
            outer_step(0, flight[1])
            for i in range(1, n):
                for k in range(len(anchor)):
                    anchors[i][k].copy_(anchor[k])
            for i in range(n):
                set_params(i, [params[i][k] - flight[2][i][k] + anchor[k] for k in range(len(anchor))])
        landed_marker[0] = flight

    def overlap_boundary(last):
        """--overlap: round r's mean lands at boundary r + 1. delayed (rumor's
        --outer-overlap): the anchor steps on it and each replica keeps its
        progress since; eager (Kale et al. 2025): each replica steps its own
        anchor at once on mean_{r-1} - own_{r-1}/n + own_r/n and restarts from
        it. A run ends with a synchronous round (eager: the replicas' mean)."""
        nonlocal flight
        with torch.no_grad():
            deltas = [pseudo(i) for i in range(n)]
            if a.overlap == "delayed":
                if flight and flight is not landed_marker[0]:
                    land_early()
                    deltas = [pseudo(i) for i in range(n)]
                if last:
                    outer_step(0, mean_of(deltas))
                    for i in range(n):
                        set_params(i, anchor)
                    flight = None
                else:
                    flight = (deltas, mean_of(deltas), [[p.clone() for p in params[i]] for i in range(n)])
                for i in range(1, n):
                    for k in range(len(anchor)):
                        anchors[i][k].copy_(anchor[k])
                return
            mean = mean_of(deltas)
            for i in range(n):
                own = [d / n for d in deltas[i]]
                g = own if not flight else [flight[1][k] - flight[0][i][k] / n + own[k] for k in range(len(own))]
                if last:
                    g = mean if not flight else [flight[1][k] - flight[0][i][k] / n + mean[k] for k in range(len(own))]
                outer_step(i, g)
                set_params(i, anchors[i])
            flight = (deltas, mean)
            if last:
                final = mean_of([anchors[i] for i in range(n)])
                for i in range(n):
                    set_params(i, final)

    def outer_round():
        with torch.no_grad():
            for k, p in enumerate(anchor):
                p.grad = sum(p - params[i][k] for i in range(n)) / n
        outer.step()
        with torch.no_grad():
            for i in range(n):
                for k, p in enumerate(anchor):
                    params[i][k].copy_(p)

    pair_rng = np.random.default_rng(a.seed + 7)

    def noloco_round():
        order = pair_rng.permutation(n)
        partner = {}
        for k in range(0, n - 1, 2):
            partner[order[k]], partner[order[k + 1]] = order[k + 1], order[k]
        with torch.no_grad():
            phi = [[p.clone() for p in params[i]] for i in range(n)]
            for i in range(n):
                j = partner.get(i, i)  # an odd one out: its own update, g = anchor - phi
                outer_step(i, [anchors[i][k] - (phi[i][k] + phi[j][k]) / 2 for k in range(len(anchor))])
                set_params(i, anchors[i])

    def average():
        with torch.no_grad():
            for k in range(len(anchor)):
                mean = sum(params[i][k] for i in range(n)) / n
                for i in range(n):
                    params[i][k].copy_(mean)

    for step in range(a.steps):
        lr = lr_at(step, a.steps, a.lr, a.warmup) if a.schedule == "cosine" or step < a.warmup else a.lr
        for i in range(n):
            for g in opts[i].param_groups:
                g["lr"] = lr
            bt = torch.from_numpy(shards[i][rngs[i].integers(0, len(shards[i]), a.batch)])
            loss = F.cross_entropy(models[i](bt[:, :-1]).reshape(-1, V), bt[:, 1:].reshape(-1))
            opts[i].zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params[i], a.grad_clip)
            opts[i].step()
        if (n > 1 and a.overlap == "delayed" and a.overlap_steps and flight and flight is not landed_marker[0]
                and (step + 1) % a.H == a.overlap_steps % a.H and step + 1 < a.steps):
            land_early()
        if n > 1 and a.every and (step + 1) % a.every == 0:
            average()
        elif n > 1 and not a.every and ((step + 1) % a.H == 0 or step + 1 == a.steps):
            if a.noloco:
                noloco_round()
            elif a.overlap == "none":
                outer_round()
            else:
                overlap_boundary(step + 1 == a.steps)
            rounds += 1
    if n > 1 and a.every:
        average()
    with torch.no_grad():
        w = torch.from_numpy(val[:a.val_windows])
        # The mean of the replicas' losses (identical but for NoLoCo), as bench-lowcomm.sh reports.
        vl = sum(F.cross_entropy(m(w[:, :-1]).reshape(-1, V), w[:, 1:].reshape(-1)).item() for m in models) / n
    row = {"replicas": n, "batch": a.batch, "alone": a.alone, "steps": a.steps, "lr": a.lr, "schedule": a.schedule,
           "config": a.config, "shards": a.shards, "val_loss": round(vl, 4), "seconds": round(time.time() - t0, 1)}
    if n > 1:
        row.update({"every": a.every} if a.every else {"H": a.H, "outer": a.outer, "outer_lr": a.outer_lr,
                                                         "outer_momentum": a.outer_momentum, "rounds": rounds,
                                                         "overlap": a.overlap, "noloco": a.noloco})
    print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
