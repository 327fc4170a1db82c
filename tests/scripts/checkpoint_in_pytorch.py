#!/usr/bin/python3
"""A rumor checkpoint loads into PyTorch: parse the safetensors file with an
independent reader (the format's spec: 8-byte length, JSON header, raw data),
build torch.nn.Linear layers from layers.<i>.weight/bias, evaluate the
Fashion-MNIST test set with the checkpoint's normalisation, and compare with
`rumor eval` on the same file. Exit 77 (skip) without torch or the data."""
import gzip, json, struct, subprocess, sys, tempfile, os

rumor, data = sys.argv[1], sys.argv[2]
try:
    import numpy as np
    import torch
except ImportError as e:
    print(f"SKIP: {e}")
    sys.exit(77)
if not os.path.exists(f"{data}/t10k-images-idx3-ubyte.gz"):
    print(f"SKIP: no Fashion-MNIST in {data}")
    sys.exit(77)

def run(*args):
    r = subprocess.run([rumor, *args], capture_output=True, text=True, timeout=300)
    if r.returncode != 0:
        sys.exit(f"rumor {' '.join(args)} failed: {r.stderr}")
    return json.loads(r.stdout.strip().splitlines()[-1])

with tempfile.TemporaryDirectory() as d:
    ck = f"{d}/m.safetensors"
    run("train", "--model", "mlp:784-64-32-10:gelu", "--max-steps", "150", "--no-eval", "--log-every", "0",
        "--checkpoint", ck, "--data", data)
    want = run("eval", "--checkpoint", ck, "--data", data)

    raw = open(ck, "rb").read()
    (hlen,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + hlen])
    meta = header.pop("__metadata__")
    body = raw[8 + hlen:]
    def tensor(name):
        t = header[name]
        assert t["dtype"] == "F32", t
        b, e = t["data_offsets"]
        return torch.from_numpy(np.frombuffer(body[b:e], dtype="<f4").reshape(t["shape"]).copy())

    widths = [int(w) for w in meta["rumor.model"].split(":")[1].split("-")]
    layers = []
    for i in range(len(widths) - 1):
        lin = torch.nn.Linear(widths[i], widths[i + 1])
        lin.load_state_dict({"weight": tensor(f"layers.{i}.weight"), "bias": tensor(f"layers.{i}.bias")})
        layers.append(lin)
        if i < len(widths) - 2:
            layers.append(torch.nn.GELU())
    model = torch.nn.Sequential(*layers)

    def idx(path):
        b = gzip.open(path).read()
        n = struct.unpack(">I", b[4:8])[0]
        return np.frombuffer(b, dtype=np.uint8, offset=16 if b[3] == 3 else 8), n
    pixels, n = idx(f"{data}/t10k-images-idx3-ubyte.gz")
    labels, _ = idx(f"{data}/t10k-labels-idx1-ubyte.gz")
    mean, std = float(meta["rumor.norm_mean"]), float(meta["rumor.norm_std"])
    x = torch.from_numpy(((pixels.reshape(n, 784).astype(np.float64) / 255.0 - mean) / std).astype(np.float32))
    with torch.no_grad():
        acc = (model(x).argmax(1).numpy() == labels).mean()
    print(f"pytorch accuracy {acc:.4f}, rumor eval {want['accuracy']:.4f}")
    if abs(acc - want["accuracy"]) > 2e-4:  # at most 2 of 10000 argmax ties may flip
        sys.exit("PyTorch and rumor disagree on the checkpoint")
