#!/usr/bin/env python3
"""`bench levels`' engines in process at one concurrency, in turns: plain decoding on both cores
(ar-2dev), mode auto with the diff applied (auto) and the same with the bandit's common_cost off
(auto-off), after the compile warm-up and one warm-up run each; per run the tokens/s at full load,
the shifts detected and the speculative steps played, then auto / ar-2dev by median and quartiles.

    git apply benchmarks/results/planner-scores/common-cost/common_cost.diff
    python benchmarks/results/planner-scores/common-cost/ab_c16.py 16 30 OUT.json
"""
import collections
import json
import statistics
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[4]), str(Path(__file__).resolve().parents[1])]


def main():
    level, reps, out_json = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    import client.bench_levels as BL
    from client.bench_compare import build_engines, run_level
    from client.prompts import load_prompts
    from levels_engine import levels_args
    args = levels_args()
    built = build_engines(args, ["ar-2dev", "auto"])
    built["auto-off"] = build_engines(args, ["auto"])["auto"]
    built["auto-off"][0].planner.bandit._common_cost = None
    names = ["ar-2dev", "auto", "auto-off"]
    for engine, placement in built.values():
        BL.compile_warm_up(engine, placement, args)
    prompts = load_prompts(args.prompts, max(8, int(args.requests_per_level * level)))
    warm = load_prompts(args.prompts, BL.warmup_requests(args, level))
    for engine, placement in built.values():
        run_level(engine, placement, warm, concurrency=level, max_tokens=48, temperature=0.0)
    res = collections.defaultdict(list)
    for rep in range(reps):
        for n in names[rep % 3:] + names[:rep % 3]:
            engine, placement = built[n]
            bandit = engine.planner.bandit if engine.planner else None
            shifts, counts = (bandit.shifts, dict(bandit.arm_counts())) if bandit else (0, {})
            r = run_level(engine, placement, prompts, concurrency=level, max_tokens=48, temperature=0.0)
            run = {"tok_s": r["tokens_per_s_at_full_load"], "shifts": 0, "spec": 0}
            if bandit:
                run["shifts"] = bandit.shifts - shifts
                run["spec"] = sum(v - counts.get(a, 0) for a, v in bandit.arm_counts().items() if a[1] > 0)
            res[n].append(run)
        print(f"rep {rep}: " + " ".join(f"{n} {res[n][-1]['tok_s']:.0f}" for n in names), flush=True)
    for n in ("auto", "auto-off"):
        rs = [a["tok_s"] / b["tok_s"] for a, b in zip(res[n], res["ar-2dev"])]
        print(f"{n} / ar-2dev: median {statistics.median(rs):.3f}")
    Path(out_json).write_text(json.dumps(res, indent=1))
    for engine, _ in built.values():
        engine.close()


if __name__ == "__main__":
    main()
