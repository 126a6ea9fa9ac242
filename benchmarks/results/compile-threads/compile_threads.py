#!/usr/bin/env python3
"""Does the thread count the target's step is built with (compiled, its weights packed) matter
when it runs with another? Plain decoding in mode auto runs the target on the drafter's cores
too (two threads here) after an engine built on the target's share (one).

    .venv/bin/python benchmarks/results/compile-threads/compile_threads.py [--repeats 2] [--json PATH]

Each child process builds a plain-decoding engine (the bundled target, captured steps) with
`build` threads, then runs `run` threads: 16 prompts x 48 greedy tokens at concurrency 4, three
times, and reports the median forward of its batch-4 decode steps. A third build is one thread
with inductor's `cpp.dynamic_threads` (kernels that take the thread count in force when they
run). The builds alternate (1, 2, 1 dynamic, 1, ...) for each run thread count; nothing else
should be running.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def child(build: int, run: int, dynamic: bool) -> None:
    import os
    if dynamic:     # read when inductor's config is imported
        os.environ["TORCHINDUCTOR_CPP_DYNAMIC_THREADS"] = "1"
    sys.path.insert(0, str(ROOT))
    import torch
    from backend.engine.config import EngineConfig
    from backend.engine.engine import Engine
    from backend.sampling.params import SamplingParams
    from client.prompts import load_prompts

    torch.set_num_threads(build)
    engine = Engine(EngineConfig(target=str(ROOT / "models" / "tiny-target"), mode="ar", num_threads=build))
    torch.set_num_threads(run)
    prompts = load_prompts(None, 16)
    forwards = []

    def on_step(_outputs):
        st = engine.stats().last_step
        if st.num_prefill_tokens == 0 and st.batch_size == 4:
            forwards.append(st.t_forward_s)
    try:
        for _ in range(3):
            engine.generate(prompts, [SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
                                      for _ in prompts], max_concurrency=4, on_step=on_step)
    finally:
        engine.close()
    print(json.dumps({"build_threads": build, "dynamic_threads": dynamic, "run_threads": run, "steps": len(forwards),
                      "median_forward_ms": 1e3 * statistics.median(forwards)}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--json")
    ap.add_argument("--child", nargs=3, type=int, metavar=("BUILD", "RUN", "DYNAMIC"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child[0], args.child[1], bool(args.child[2]))
        return
    rows = []
    builds = ((1, 0), (2, 0), (1, 1))   # (threads, inductor's cpp.dynamic_threads)
    name = {(1, 0): "built with 1", (2, 0): "built with 2", (1, 1): "built with 1, dynamic threads"}
    for run in (2, 1):
        for _ in range(args.repeats):
            for build, dynamic in builds:
                out = subprocess.run([sys.executable, __file__, "--child", str(build), str(run), str(dynamic)],
                                     capture_output=True, text=True, check=True).stdout
                row = json.loads(out.strip().splitlines()[-1])
                rows.append(row)
                print(f"{name[build, dynamic]}, run with {run} threads: forward {row['median_forward_ms']:.3f} ms "
                      f"(median of {row['steps']} batch-4 steps)", flush=True)
    for run in (2, 1):
        med = {b: statistics.median(r["median_forward_ms"] for r in rows if r["run_threads"] == run
                                    and (r["build_threads"], int(r["dynamic_threads"])) == b) for b in builds}
        print(f"run with {run}: built with 1 / built with 2: {med[1, 0] / med[2, 0]:.3f}; "
              f"dynamic threads / built with {run}: {med[1, 1] / med[run, 0]:.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows}, indent=1))


if __name__ == "__main__":
    main()
