"""Mode auto at one concurrency in process, started as `bench levels` starts it (a compile
warm-up of 4 requests at concurrency 2, 6 tokens each, then one run at the level), then three
runs of 2 x LEVEL requests of 48 tokens: for each run its tokens/s (whole and at full load), and,
per bin, mode and what the planner did with the step (update: scored to the arm; count: played,
not scored, e.g. a switch's step; skip: prompts only), the steps' wall time and tokens, ms a
token raw and as scored, and the bandit's mean of the scored losses (rescaled to the bin's
reference batch). Every step that was counted but not scored, or took over 20 ms, is listed.

    python benchmarks/results/planner-scores/c4-step-costs/step_costs.py 4 3    # step-costs-c4.txt
"""
import collections
import sys
import time
from pathlib import Path

import client.bench_levels as BL
from client.bench_compare import run_level
from client.prompts import load_prompts
from planner import bandit as BD
from planner import contexts as CX
from planner import planner as PL

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from levels_engine import auto_engine  # noqa: E402

STEPS, cur = [], {}


def instrument() -> None:
    observe, measure, update, count_play = (PL.Planner.observe, CX.StepLoss.measure,
                                            BD.ContextualBandit.update, BD.ContextualBandit.count_play)

    def observe_logged(self, issued, o):
        cur.clear()
        cur.update(issued=issued, o=o, ctx=self._ctx, what="skip")
        observe(self, issued, o)
        STEPS.append(dict(cur))

    def measure_logged(self, *a, **k):
        cur["cost"] = c = measure(self, *a, **k)
        return c

    def update_logged(self, ctx, arm, loss, weight=1.0):
        cur.update(what="update", loss=loss, weight=weight)
        return update(self, ctx, arm, loss, weight)

    def count_logged(self, ctx, arm):
        if cur.get("what") != "update":
            cur["what"] = "count"
        return count_play(self, ctx, arm)

    PL.Planner.observe, CX.StepLoss.measure = observe_logged, measure_logged
    BD.ContextualBandit.update, BD.ContextualBandit.count_play = update_logged, count_logged


def report(res: dict, seconds: float) -> None:
    tokens = sum(x["o"].tokens_committed for x in STEPS)
    print(f"  {res['tokens_per_s']:.0f} tok/s whole, {res['tokens_per_s_at_full_load']:.0f} at full load "
          f"({res['full_load_token_share']:.2f} of the tokens); {seconds:.2f} s, steps' walls "
          f"{sum(x['o'].step_wall_s for x in STEPS):.2f} s, {tokens} tokens")
    for x in STEPS:
        o = x["o"]
        if x["what"] == "count" or o.step_wall_s > 0.02:
            print(f"    {x['what']:6} {str(x['ctx']):5} issued {x['issued']} ran {o.ran} wall {o.step_wall_s * 1e3:.1f} ms, "
                  f"forward {o.forward_s * 1e3:.1f}, catch-up {o.drafter_rebuild_s * 1e3:.1f}, prompt tokens "
                  f"{o.prefill_tokens}, cores {o.forward_cores}, trying {o.trying_cores}, tokens {o.tokens_committed}, "
                  f"batch {o.batch_size}")
    agg = collections.defaultdict(collections.Counter)
    for x in STEPS:
        o = x["o"]
        a = agg[(str(x["ctx"]), (o.ran or x["issued"]).mode.value if o.decoded else "prompts", x["what"])]
        a["steps"] += 1
        a["wall"] += o.step_wall_s
        a["tok"] += o.tokens_committed
        if x.get("cost") is not None:
            a["wall_scored"] += x["cost"].wall_s
            a["tok_scored"] += x["cost"].tokens
            if x["what"] == "update":
                a["loss_w"] += x["loss"] * x["weight"]
                a["w"] += x["weight"]
    for (ctx, mode, what), a in sorted(agg.items()):
        line = (f"  {ctx:5} {mode:8} {what:6} steps {a['steps']:4} wall {a['wall']:.3f} s tokens {a['tok']:4}: "
                f"{a['wall'] / max(a['tok'], 1) * 1e3:.2f} ms a token raw")
        if a["tok_scored"]:
            line += f", {a['wall_scored'] / a['tok_scored'] * 1e3:.2f} as scored"
        if a["w"]:
            line += f", bandit mean {a['loss_w'] / a['w'] * 1e3:.2f}"
        print(line)


def main() -> None:
    instrument()
    level, trials = int(sys.argv[1]), int(sys.argv[2])
    for trial in range(trials):
        engine, placement, args = auto_engine()
        try:
            BL.compile_warm_up(engine, placement, args)
            run_level(engine, placement, load_prompts(args.prompts, max(4, level)), concurrency=level, max_tokens=48,
                      temperature=0)
            for r in range(3):
                STEPS.clear()
                t0 = time.perf_counter()
                res = run_level(engine, placement, load_prompts(args.prompts, 2 * level), concurrency=level,
                                max_tokens=48, temperature=0)
                print(f"engine {trial} run {r}:")
                report(res, time.perf_counter() - t0)
                sys.stdout.flush()
        finally:
            engine.close()


if __name__ == "__main__":      # (a drafter worker re-imports this module: nothing runs there)
    main()
