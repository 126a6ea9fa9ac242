#!/usr/bin/env python3
"""Tensor parallelism against one device: decode throughput of the target at TP 1 and TP N, in
process, at each concurrency, interleaved (TP 1, TP N, TP 1, ... for every repetition) so that a
noisy moment of the host hits both.

    .venv/bin/python scripts/tp_throughput.py [--tensor-parallel-size 2] [--concurrency "1 32"]
        [--num-prompts 32] [--max-tokens 64] [--reps 3] [--device cpu] [--compile off]
        [--out benchmarks/results/tp.json]

Both engines run plain decoding (mode ar, greedy, ignore_eos) over the bundled held-out prompts,
op by op (`--compile off`: a tensor-parallel target is never compiled, so the single-device one is
not either unless asked). On the CPU the thread count is set before every run: all of this
process's cores for TP 1, the per-rank share for TP N (as the engine sets it). Writes the runs,
their medians and the command to `--out`; greedy outputs of the two are checked equal.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from backend.engine.config import EngineConfig  # noqa: E402
from backend.engine.engine import Engine  # noqa: E402
from backend.sampling.params import SamplingParams  # noqa: E402
from client.prompts import load_prompts  # noqa: E402


def run_once(engine: Engine, prompts: list[str], params: SamplingParams, concurrency: int) -> dict:
    t0 = time.perf_counter()
    done = engine.generate(prompts, params, max_concurrency=concurrency)
    seconds = time.perf_counter() - t0
    tokens = sum(len(c.output_ids) for c in done)
    return {"seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds,
            "outputs": [c.output_ids for c in done]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default=str(ROOT / "models" / "tiny-target"))
    p.add_argument("--tensor-parallel-size", type=int, default=2)
    p.add_argument("--concurrency", default="1 32")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--device", default="cpu")
    p.add_argument("--tensor-parallel-devices", default=None,
                   help="CUDA: comma-separated devices of the ranks (e.g. cuda:0,cuda:0 for two ranks on one GPU)")
    p.add_argument("--compile", default="off", choices=("off", "auto", "on"))
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"),
                   help="auto: bfloat16 on CUDA, float32 on CPU (greedy equality across TP sizes is "
                        "expected in float32; in 16-bit types the reduction order may flip a near tie)")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "tp.json"))
    args = p.parse_args()

    sizes = (1, args.tensor_parallel_size)
    concurrencies = [int(c) for c in args.concurrency.split()]
    prompts = [x[:400] for x in load_prompts(n=args.num_prompts)]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    cores = len(os.sched_getaffinity(0))
    base = dict(target=args.target, mode="ar", device=args.device, compile=args.compile,
                kv_cache_bytes=64 << 20, dtype=args.dtype)
    engines, threads = {}, {}
    for size in sizes:
        extra = {"tensor_parallel_size": size}
        if size > 1 and args.tensor_parallel_devices:
            extra["tensor_parallel_devices"] = args.tensor_parallel_devices.split(",")
        engines[size] = Engine(EngineConfig(**base, **extra))
        threads[size] = torch.get_num_threads() if size > 1 else cores
    runs = []
    outputs = {}
    try:
        for size in sizes:                     # warm-up: kernels, first-use allocations
            torch.set_num_threads(threads[size]) if args.device == "cpu" else None
            run_once(engines[size], prompts[:2], SamplingParams(max_tokens=4, temperature=0.0), 2)
        for rep in range(args.reps):
            for c in concurrencies:
                for size in sizes:
                    if args.device == "cpu":
                        torch.set_num_threads(threads[size])
                    r = run_once(engines[size], prompts[:max(c, 4)],
                                 params, c)
                    outputs.setdefault((size, c), r.pop("outputs"))
                    runs.append({"tensor_parallel_size": size, "concurrency": c, "rep": rep, **r})
                    print(f"tp {size} concurrency {c} rep {rep}: {r['tokens_per_s']:.1f} tokens/s", flush=True)
    finally:
        for e in engines.values():
            e.close()
    equal = all(outputs[(sizes[0], c)] == outputs[(sizes[1], c)] for c in concurrencies)
    summary = []
    for c in concurrencies:
        row = {"concurrency": c}
        for size in sizes:
            row[f"tp{size}_tokens_per_s"] = statistics.median(
                r["tokens_per_s"] for r in runs if r["tensor_parallel_size"] == size and r["concurrency"] == c)
        row["ratio"] = row[f"tp{sizes[1]}_tokens_per_s"] / row[f"tp{sizes[0]}_tokens_per_s"]
        summary.append(row)
        print(f"concurrency {c}: TP {sizes[1]} / TP 1 = {row['ratio']:.2f}")
    result = {"command": " ".join([Path(sys.argv[0]).as_posix()] + sys.argv[1:]),
              "host": {"cpus": cores, "machine": platform.machine(), "torch": torch.__version__,
                       "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None},
              "threads": {str(k): v for k, v in threads.items()}, "greedy_outputs_equal": equal,
              "summary": summary, "runs": runs}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}; greedy outputs equal: {equal}")
    return 0 if equal else 1


if __name__ == "__main__":
    sys.exit(main())
