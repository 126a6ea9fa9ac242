"""What mode auto's bandit scores an arm against what a run of that arm costs, in process.

One auto engine, built as `bench levels` builds it, runs each arm forced in turn
(tests/helpers/arms.py: the planner still decides and learns every step, the arm is scripted)
on the same prompts at one concurrency, 48 tokens a request. For each run it prints the run's
milliseconds a generated token (all of it: prompts, drain, the loop), the bandit's score of the
steps scored to the arm (their wall time less the prefill's share and any catch-up, over their
tokens as scored), the share of the run's time in the steps that decoded, the wall time taken
off the scored steps for their prompts, and, in the bin of that batch, the arm's measured mean
against its prior (both in the bin's loss units).

    python benchmarks/results/planner-scores/forced_arms.py CONCURRENCY ARMS REQUESTS ROUNDS
    # e.g. 4 ar,sd:3,psd:4 32 3
"""
import sys
import time
from collections import defaultdict

import client.bench_levels as BL
from client.bench_compare import run_level
from client.prompts import load_prompts
from planner.arms import arm_str
from planner.signals import LoadSignals

sys.path.insert(0, "tests")
from helpers.arms import force_arms  # noqa: E402
from levels_engine import auto_engine  # noqa: E402


def main() -> None:
    concurrency, arms, requests, rounds = int(sys.argv[1]), sys.argv[2].split(","), int(sys.argv[3]), int(sys.argv[4])
    engine, placement, args = auto_engine()
    planner, bandit = engine.planner, engine.planner.bandit
    names = [arm_str(a) for a in bandit.arms]
    steps = []          # each decoding step the planner measured: its inputs and cost

    measure = planner._loss.measure

    def measured(ctx, running, **kw):
        cost = measure(ctx, running, **kw)
        steps.append(dict(kw, cost=cost, ctx=ctx, scored=False))
        return cost
    update = bandit.update

    def scored(ctx, arm, loss, weight=1.0):
        if steps:
            steps[-1]["scored"] = True
        return update(ctx, arm, loss, weight)
    planner._loss.measure, bandit.update = measured, scored
    main_bin = planner.bins.context(LoadSignals(batch_size=concurrency))
    try:
        BL.compile_warm_up(engine, placement, args)
        prompts = load_prompts(args.prompts, requests)
        for r in range(rounds):
            for arm in arms:
                mode, gamma = arm.split(":") if ":" in arm else (arm, "0")
                force_arms(engine, [(mode, int(gamma))], hold=10 ** 6)
                steps.clear()
                t0 = time.perf_counter()
                out = run_level(engine, placement, prompts, concurrency=concurrency, max_tokens=48, temperature=0)
                wall = time.perf_counter() - t0
                mine = [s for s in steps if s["scored"]]
                raw = sum(s["step_wall_s"] for s in mine)
                score = sum(s["cost"].wall_s for s in mine) / max(sum(s["cost"].tokens for s in mine), 1)
                decoding = sum(s["step_wall_s"] for s in steps)
                by_bin = defaultdict(lambda: [0.0, 0.0])
                for s in mine:
                    by_bin[s["ctx"]][0] += s["cost"].loss * s["cost"].weight
                    by_bin[s["ctx"]][1] += s["cost"].weight
                line = (f"[{r}] {arm:<6} run {1e3 / out['tokens_per_s']:.3f} ms/token ({out['tokens_per_s']:.0f} tok/s, "
                        f"{wall:.2f} s) | scored {len(mine)} of {len(steps)} decoding steps, score "
                        f"{1e3 * score:.3f} ms/token | decoding steps {decoding / wall:.2f} of the run | "
                        f"prompts' share taken off the scored steps {1 - sum(s['cost'].wall_s for s in mine) / max(raw, 1e-9):.2f}")
                lw, w = by_bin.get(main_bin, (0.0, 0.0))
                if w > 0:
                    prior = bandit._read_prior(main_bin, bandit._bin(main_bin))[names.index(arm)]
                    line += f" | {main_bin}: mean {1e3 * lw / w:.3f}, prior {1e3 * prior:.3f}, ratio {lw / w / prior:.2f}"
                print(line, flush=True)
    finally:
        engine.close()


if __name__ == "__main__":      # (a drafter worker re-imports this module: nothing runs there)
    main()
