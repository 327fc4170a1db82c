#!/usr/bin/python3
"""PyTorch's version of bench_train_step: the same MLP (Linear + ReLU),
batch, thread count and SGD-momentum step, on random data. Prints one JSON
line with samples/s."""
import argparse, json, os, sys, time

ap = argparse.ArgumentParser()
ap.add_argument("--model", default="mlp:784-512-256-10")
ap.add_argument("--batch", type=int, default=128)
ap.add_argument("--threads", type=int, default=1)
ap.add_argument("--steps", type=int, default=200)
ap.add_argument("--warmup", type=int, default=20)
ap.add_argument("--device", default="cpu")
a = ap.parse_args()

import torch  # imported after argparse so --help works without torch

torch.set_num_threads(a.threads)
widths = [int(w) for w in a.model.split(":")[1].split("-")]
layers = []
for i in range(len(widths) - 1):
    layers.append(torch.nn.Linear(widths[i], widths[i + 1]))
    if i < len(widths) - 2:
        layers.append(torch.nn.ReLU())
dev = torch.device(a.device)
model = torch.nn.Sequential(*layers).to(dev)
opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
loss_fn = torch.nn.CrossEntropyLoss()
x = torch.randn(a.batch, widths[0], pin_memory=(dev.type == "cuda"))
y = torch.randint(0, widths[-1], (a.batch,), pin_memory=(dev.type == "cuda"))

def step():
    xb = x.to(dev, non_blocking=True)
    yb = y.to(dev, non_blocking=True)
    opt.zero_grad(set_to_none=True)
    loss = loss_fn(model(xb), yb)
    loss.backward()
    opt.step()
    return loss.item()

for _ in range(a.warmup):
    step()
t0 = time.perf_counter()
for _ in range(a.steps):
    l = step()
dt = time.perf_counter() - t0
blas = "unknown"
try:
    with open("/proc/self/maps") as f:
        libs = {ln.split()[-1] for ln in f if "blas" in ln.lower()}
    blas = ",".join(sorted(os.path.basename(p) + "@" + os.path.basename(os.path.dirname(p)) for p in libs)) or "none"
except OSError:
    pass
print(json.dumps({"impl": "pytorch", "version": torch.__version__, "blas": blas, "model": a.model,
                  "device": a.device, "batch": a.batch, "threads": a.threads,
                  "ms_per_step": dt / a.steps * 1e3, "samples_per_s": a.steps * a.batch / dt,
                  "loss": round(l, 4)}))
