"""Mode auto at concurrency 1 in process, started as `bench levels` starts it (a compile warm-up
of 4 requests at concurrency 2, 6 tokens each), then three runs at concurrency 1 (4, 8 and 8
requests of 48 tokens): the steps auto gave each mode in the last two runs, their tokens/s, and
what its bandit held in the bin of batch 1 (each mode's best mean, ms a token, and evidence).

    python benchmarks/results/group-calibration/c1_trials.py TRIALS    # one engine a trial

For an A/B, run it alternately from a worktree of each commit with PYTHONPATH set to it.
"""
import sys
from collections import Counter
from pathlib import Path

import client.bench_levels as BL
from client.bench_compare import run_level
from client.prompts import load_prompts
from planner.arms import arm_str

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from levels_engine import auto_engine  # noqa: E402


def bin_1(engine) -> str:
    b = engine.planner.bandit
    for ctx in b.contexts:
        if str(ctx) == "b1":
            means, cnt, _, _ = b._estimates(ctx, b._bin(ctx))
            best = {}
            for a, m, c in zip(b.arms, means, cnt):
                mode = arm_str(a).split(":")[0]
                if mode not in best or m < best[mode][1]:
                    best[mode] = (arm_str(a), m, c)
            return "  ".join(f"{mode} best {a} {m * 1e3:.2f} ms (n {c:.1f})" for mode, (a, m, c) in best.items())
    return "no b1 bin"


def main() -> None:
    warmup_tokens = int(sys.argv[2]) if len(sys.argv) > 2 else 6
    for trial in range(int(sys.argv[1])):
        engine, placement, args = auto_engine()
        try:
            run_level(engine, placement, load_prompts(args.prompts, 4), concurrency=2, max_tokens=warmup_tokens,
                      temperature=0)     # bench levels' compile warm-up, its length a setting here
            after_warmup = bin_1(engine)
            def run(n: int) -> float:
                return run_level(engine, placement, load_prompts(args.prompts, n), concurrency=1, max_tokens=48,
                                 temperature=0)["tokens_per_s"]
            rates = [run(4)]
            before = BL._arm_counts(engine)
            rates += [run(8), run(8)]
            modes = Counter()
            for arm, k in BL._steps_since(before, BL._arm_counts(engine)).items():
                modes[arm.split(":")[0]] += k
            total = sum(modes.values())
            shares = " ".join(f"{m} {k / total:.2f}" for m, k in modes.most_common())
            print(f"trial {trial} (warm-up {warmup_tokens} tokens): tok/s {' '.join(f'{x:.0f}' for x in rates)} | "
                  f"last two runs' steps: {shares}\n  b1 after the warm-up: {after_warmup}\n  b1 at the end: {bin_1(engine)}",
                  flush=True)
        finally:
            engine.close()


if __name__ == "__main__":      # (a drafter worker re-imports this module: nothing runs there)
    main()
