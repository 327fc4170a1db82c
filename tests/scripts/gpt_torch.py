#!/usr/bin/env python3
"""A GPT-2 in plain PyTorch, the reference rumor's GPT is checked against.

Written from GPT-2's architecture (token and position embeddings, pre-LayerNorm
blocks of causal self-attention and a 4C GELU-tanh MLP, a final LayerNorm, the
head tied to the token embedding), with Hugging Face's names and Conv1D
(in, out) weight layout, so it loads a rumor checkpoint directory
(config.json + model.safetensors) without the transformers package. Runs on
Debian's PyTorch 1.13 and on PyTorch 2.x.

  gpt_torch.py logits DIR TOKENS OUT
      TOKENS: little-endian int32 tokens, one sequence of at most n_positions.
      Writes the logits (positions x vocabulary, little-endian float32) to OUT.
  gpt_torch.py hub-style SRC DST [--dtype BF16] [--odd-header]
      Rewrites a checkpoint directory the way GPT-2's files on the Hugging
      Face hub are laid out (no "transformer." prefix, attn.bias buffers,
      lm_head.weight stored), to test readers of such directories.
  gpt_torch.py train --config JSON --data FILE --steps N ... (see --help)
      Trains a fresh model the way `rumor train` does (benchmarks).
"""
import argparse
import json
import math
import os
import struct
import sys
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F


def read_safetensors(path):
    """The tensors of a safetensors file as numpy arrays (F32, F16, BF16)."""
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        a, b = info["data_offsets"]
        raw = data[a:b]
        if info["dtype"] == "F32":
            arr = np.frombuffer(raw, dtype="<f4")
        elif info["dtype"] == "F16":
            arr = np.frombuffer(raw, dtype="<f2").astype(np.float32)
        elif info["dtype"] == "BF16":
            u = np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16
            arr = u.view(np.float32)
        else:
            raise ValueError(f"{path}: {name} has dtype {info['dtype']}")
        out[name] = arr.reshape(info["shape"]).copy()
    return out


class Block(nn.Module):
    def __init__(self, c, heads):
        super().__init__()
        self.heads = heads
        self.ln_1 = nn.LayerNorm(c, eps=1e-5)
        self.c_attn_w = nn.Parameter(torch.zeros(c, 3 * c))
        self.c_attn_b = nn.Parameter(torch.zeros(3 * c))
        self.c_proj_w = nn.Parameter(torch.zeros(c, c))
        self.c_proj_b = nn.Parameter(torch.zeros(c))
        self.ln_2 = nn.LayerNorm(c, eps=1e-5)
        self.c_fc_w = nn.Parameter(torch.zeros(c, 4 * c))
        self.c_fc_b = nn.Parameter(torch.zeros(4 * c))
        self.mproj_w = nn.Parameter(torch.zeros(4 * c, c))
        self.mproj_b = nn.Parameter(torch.zeros(c))

    def attention(self, x):
        b, t, c = x.shape
        h = self.heads
        qkv = x @ self.c_attn_w + self.c_attn_b
        q, k, v = qkv.split(c, dim=2)
        q = q.view(b, t, h, c // h).transpose(1, 2)
        k = k.view(b, t, h, c // h).transpose(1, 2)
        v = v.view(b, t, h, c // h).transpose(1, 2)
        if hasattr(F, "scaled_dot_product_attention"):
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:  # PyTorch 1.x
            att = (q @ k.transpose(-2, -1)) / math.sqrt(c // h)
            mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
            att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
            y = att @ v
        y = y.transpose(1, 2).reshape(b, t, c)
        return y @ self.c_proj_w + self.c_proj_b

    def forward(self, x):
        x = x + self.attention(self.ln_1(x))
        hdn = F.gelu(self.ln_2(x) @ self.c_fc_w + self.c_fc_b, approximate="tanh")
        return x + hdn @ self.mproj_w + self.mproj_b


class GPT(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        c, self.ctx = cfg["n_embd"], cfg["n_positions"]
        self.wte = nn.Parameter(torch.zeros(cfg["vocab_size"], c))
        self.wpe = nn.Parameter(torch.zeros(self.ctx, c))
        self.h = nn.ModuleList([Block(c, cfg["n_head"]) for _ in range(cfg["n_layer"])])
        self.ln_f = nn.LayerNorm(c, eps=1e-5)

    def forward(self, idx):
        t = idx.shape[1]
        x = self.wte[idx] + self.wpe[:t]
        for blk in self.h:
            x = blk(x)
        return self.ln_f(x) @ self.wte.t()

    # Hugging Face names (with "transformer." or without) → parameters.
    def hf_params(self):
        out = {"wte.weight": self.wte, "wpe.weight": self.wpe,
               "ln_f.weight": self.ln_f.weight, "ln_f.bias": self.ln_f.bias}
        for i, b in enumerate(self.h):
            p = f"h.{i}."
            out.update({p + "ln_1.weight": b.ln_1.weight, p + "ln_1.bias": b.ln_1.bias,
                        p + "attn.c_attn.weight": b.c_attn_w, p + "attn.c_attn.bias": b.c_attn_b,
                        p + "attn.c_proj.weight": b.c_proj_w, p + "attn.c_proj.bias": b.c_proj_b,
                        p + "ln_2.weight": b.ln_2.weight, p + "ln_2.bias": b.ln_2.bias,
                        p + "mlp.c_fc.weight": b.c_fc_w, p + "mlp.c_fc.bias": b.c_fc_b,
                        p + "mlp.c_proj.weight": b.mproj_w, p + "mlp.c_proj.bias": b.mproj_b})
        return out

    def load_dir(self, d):
        tensors = read_safetensors(os.path.join(d, "model.safetensors"))
        params = self.hf_params()
        seen = set()
        for name, arr in tensors.items():
            key = name[len("transformer."):] if name.startswith("transformer.") else name
            if key not in params:
                if key.endswith((".attn.bias", ".attn.masked_bias")) or key == "lm_head.weight":
                    continue
                raise KeyError(f"{d}: unexpected tensor {name}")
            with torch.no_grad():
                params[key].copy_(torch.from_numpy(arr))
            seen.add(key)
        missing = set(params) - seen
        if missing:
            raise KeyError(f"{d}: missing {sorted(missing)[:3]}")

    def init_gpt2(self, seed):
        """GPT-2's initialisation (Hugging Face's _init_weights)."""
        g = torch.Generator().manual_seed(seed)
        proj = 0.02 / math.sqrt(2 * len(self.h))
        with torch.no_grad():
            for name, p in self.hf_params().items():
                if name.endswith(("ln_1.weight", "ln_2.weight", "ln_f.weight")):
                    p.fill_(1.0)
                elif p.dim() == 1:
                    p.zero_()
                else:
                    std = proj if name.endswith("c_proj.weight") else 0.02
                    p.copy_(torch.randn(p.shape, generator=g) * std)


def write_safetensors(path, tensors, dtype="F32", odd_header=False):
    """Writes numpy arrays (float32) as a safetensors file, names sorted:
    as F32, or as BF16 (each value's upper 16 bits). odd_header pads the
    header to an odd length, so that the data that follows is unaligned (the
    format allows any length; writers usually pad to 8)."""
    header, blobs, off = {"__metadata__": {"format": "pt"}}, [], 0
    for name in sorted(tensors):
        raw = np.ascontiguousarray(tensors[name], dtype="<f4")
        if dtype == "BF16":
            raw = (raw.view("<u4") >> 16).astype("<u2")
        raw = raw.tobytes()
        header[name] = {"dtype": dtype, "shape": list(tensors[name].shape), "data_offsets": [off, off + len(raw)]}
        blobs.append(raw)
        off += len(raw)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    if odd_header:
        text += b" "
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for raw in blobs:
            f.write(raw)


def cmd_hub_style(args):
    """Rewrites a checkpoint directory as the GPT-2 files on the Hugging Face
    hub are: names without "transformer.", each block's causal-mask buffer
    attn.bias (1, 1, T, T) and the tied lm_head.weight stored too."""
    with open(os.path.join(args.src, "config.json")) as f:
        cfg = json.load(f)
    tensors = read_safetensors(os.path.join(args.src, "model.safetensors"))
    out = {}
    for name, arr in tensors.items():
        out[name[len("transformer."):] if name.startswith("transformer.") else name] = arr
    t = cfg["n_positions"]
    for i in range(cfg["n_layer"]):
        out[f"h.{i}.attn.bias"] = np.tril(np.ones((t, t), dtype=np.float32)).reshape(1, 1, t, t)
    out["lm_head.weight"] = out["wte.weight"]
    os.makedirs(args.dst, exist_ok=True)
    write_safetensors(os.path.join(args.dst, "model.safetensors"), out, args.dtype, args.odd_header)
    with open(os.path.join(args.dst, "config.json"), "w") as f:
        json.dump(cfg, f)


def cmd_logits(args):
    with open(os.path.join(args.dir, "config.json")) as f:
        cfg = json.load(f)
    model = GPT(cfg)
    model.load_dir(args.dir)
    toks = np.fromfile(args.tokens, dtype="<i4")
    with torch.no_grad():
        logits = model(torch.from_numpy(toks.astype(np.int64))[None, :])[0]
    logits.numpy().astype("<f4").tofile(args.out)


def windows(tokens, t):
    n = (len(tokens) - 1) // t
    return np.stack([tokens[i * t:i * t + t + 1] for i in range(n)])


def lr_at(step, total, peak, warmup):
    """rumor's schedule: linear warm-up, then cosine to zero."""
    if warmup > 0 and step < warmup:
        return peak * (step + 1) / warmup
    frac = (step - warmup) / max(1, total - warmup)
    return peak * 0.5 * (1 + math.cos(math.pi * min(1.0, frac)))


def cmd_train(args):
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    dev = torch.device(args.device)
    if dev.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = args.tf32
        torch.backends.cudnn.allow_tf32 = args.tf32
    cfg = json.loads(args.config)
    model = GPT(cfg)
    model.init_gpt2(args.seed)
    model.to(dev)
    data = np.frombuffer(open(args.data, "rb").read(), dtype=np.uint8).astype(np.int64)
    cut = len(data) - int(round(len(data) * args.val_fraction))
    train, val = windows(data[:cut], cfg["n_positions"]), windows(data[cut:], cfg["n_positions"])
    decay = [p for n, p in model.hf_params().items() if p.dim() >= 2]
    rest = [p for n, p in model.hf_params().items() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": rest, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.999), eps=1e-8)  # rumor's AdamW
    rng = np.random.default_rng(args.seed)
    order = rng.permutation(len(train))
    t0, pos = time.time(), 0
    for step in range(args.steps):
        if pos + args.batch > len(order):
            order, pos = rng.permutation(len(train)), 0
        batch = torch.from_numpy(train[order[pos:pos + args.batch]]).to(dev)
        pos += args.batch
        for g in opt.param_groups:
            g["lr"] = lr_at(step, args.steps, args.lr, args.warmup)
        logits = model(batch[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if args.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        opt.step()
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    secs = time.time() - t0
    with torch.no_grad():
        n = min(len(val), args.eval_windows)
        v = torch.from_numpy(val[:n]).to(dev)
        logits = model(v[:, :-1])
        vloss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), v[:, 1:].reshape(-1)).item()
    print(json.dumps({"val_loss": vloss, "steps": args.steps, "seconds": secs,
                      "tokens_per_s": args.steps * args.batch * cfg["n_positions"] / secs}))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    lg = sub.add_parser("logits")
    lg.add_argument("dir")
    lg.add_argument("tokens")
    lg.add_argument("out")
    hs = sub.add_parser("hub-style")
    hs.add_argument("src")
    hs.add_argument("dst")
    hs.add_argument("--dtype", choices=["F32", "BF16"], default="F32")
    hs.add_argument("--odd-header", action="store_true", help="an odd header length: unaligned data")
    tr = sub.add_parser("train")
    tr.add_argument("--config", required=True, help="GPT2Config fields as JSON")
    tr.add_argument("--data", required=True, help="a text file (byte tokens)")
    tr.add_argument("--steps", type=int, required=True)
    tr.add_argument("--batch", type=int, default=8)
    tr.add_argument("--lr", type=float, default=1e-3)
    tr.add_argument("--warmup", type=int, default=0)
    tr.add_argument("--weight-decay", type=float, default=0.0)
    tr.add_argument("--grad-clip", type=float, default=0.0)
    tr.add_argument("--val-fraction", type=float, default=0.1)
    tr.add_argument("--eval-windows", type=int, default=160)
    tr.add_argument("--threads", type=int, default=1)
    tr.add_argument("--seed", type=int, default=1)
    tr.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (FP32, TF32 off, as rumor's cuBLAS)")
    tr.add_argument("--tf32", action="store_true", help="on a GPU, matrix products in TF32 (as rumor --tf32)")
    args = ap.parse_args()
    {"logits": cmd_logits, "hub-style": cmd_hub_style, "train": cmd_train}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
