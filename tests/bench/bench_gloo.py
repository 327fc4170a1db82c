#!/usr/bin/python3
"""PyTorch gloo all_reduce of an fp32 buffer between 2 processes on loopback:
the reference for bench_net_exchange. Run with Debian's /usr/bin/python3
(python3-torch) and OMP_NUM_THREADS=1. Prints each round and
    bench_gloo: median_ms=... min_ms=... mb=... reps=...

usage: bench_gloo.py [--mb N] [--reps N]
"""
import argparse
import os
import socket
import statistics
import sys
import time


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker(rank, port, mb, reps):
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", rank=rank, world_size=2)
    t = torch.ones(mb * 1000 * 1000 // 4, dtype=torch.float32)
    times = []
    for r in range(-1, reps):  # round -1 warms up and is not counted
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(t)
        ms = (time.perf_counter() - t0) * 1e3
        if r >= 0:
            times.append(ms)
            if rank == 0:
                print("  round %d: %8.1f ms  (%.0f MB/s each way)" % (r, ms, mb / (ms / 1e3)), flush=True)
    dist.destroy_process_group()
    if rank == 0:
        s = sorted(times)
        print("bench_gloo: median_ms=%.1f min_ms=%.1f mb=%d reps=%d" % (s[len(s) // 2], s[0], mb, reps))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=100)
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args()
    port = free_port()
    print("gloo all_reduce: %d MB, 2 processes, OMP_NUM_THREADS=%s" % (a.mb, os.environ.get("OMP_NUM_THREADS", "?")))
    sys.stdout.flush()
    pid = os.fork()
    if pid == 0:
        try:
            worker(1, port, a.mb, a.reps)
        finally:
            os._exit(0)
    worker(0, port, a.mb, a.reps)
    _, status = os.waitpid(pid, 0)
    return 0 if status == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
