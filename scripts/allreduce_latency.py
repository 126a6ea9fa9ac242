#!/usr/bin/env python3
"""What one all-reduce costs between two processes on this host (gloo over loopback): the floor
of a tensor-parallel step, which runs two per layer. Hidden-size float32 tensors, back to back,
with the two processes pinned to one core each and not pinned.

    .venv/bin/python scripts/allreduce_latency.py [--numel 256] [--iters 500] [--out FILE]
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, port: int, pin: bool, numel: int, iters: int, out) -> None:
    if pin:
        os.sched_setaffinity(0, [sorted(os.sched_getaffinity(0))[rank]])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    x = torch.ones(numel)
    for _ in range(50):
        dist.all_reduce(x)
    t0 = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(x)
    if rank == 0:
        out.put((time.perf_counter() - t0) / iters)
    dist.destroy_process_group()


def measure(pin: bool, numel: int, iters: int) -> float:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, pin, numel, iters, out)) for r in range(2)]
    for p in procs:
        p.start()
    seconds = out.get(timeout=300)
    for p in procs:
        p.join()
    return seconds


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--numel", type=int, default=256, help="elements per all-reduce (the tiny target's hidden size)")
    ap.add_argument("--iters", type=int, default=500)
    ap.add_argument("--out", default="benchmarks/results/allreduce-latency.json")
    args = ap.parse_args()
    if len(os.sched_getaffinity(0)) < 2:
        print("needs two cores", file=sys.stderr)
        return 2
    rows = {f"pinned={pin}": 1e6 * measure(pin, args.numel, args.iters) for pin in (True, False)}
    for k, us in rows.items():
        print(f"gloo all-reduce of {args.numel} floats, two processes, {k}: {us:.0f} us")
    report = {"command": "scripts/allreduce_latency.py " + " ".join(sys.argv[1:]), "numel": args.numel,
              "iters": args.iters, "microseconds": rows, "torch": torch.__version__}
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
