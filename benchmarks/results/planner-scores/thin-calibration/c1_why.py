"""Mode auto at concurrency 1, started as `bench levels` starts it (a compile warm-up of 4
requests at concurrency 2, 6 tokens each), then three runs at concurrency 1 (4, 8 and 8 requests
of 48 tokens), with `thin.diff` applied: per engine, the share of steps on plain decoding, each
decision the thin-calibration rule widened (the step, the first arm of the widened group, the
bound's counts of the first three arms), and, for an engine on plain decoding on more than a fifth
of its steps, its first 40 decisions run-length encoded (mode / why: idle, free, held / bin) and
its bins' plays.

    git apply benchmarks/results/planner-scores/thin-calibration/thin.diff
    python benchmarks/results/planner-scores/thin-calibration/c1_why.py 6    # c1_why.txt
"""
import itertools
import sys
from pathlib import Path

import client.bench_levels as BL
from client.bench_compare import run_level
from client.prompts import load_prompts
from planner import bandit as BD
from planner import planner as PL

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from levels_engine import auto_engine  # noqa: E402

LOG, LOOKS = [], []


def instrument() -> None:
    bound_counts, decide, held, restriction = (BD.ContextualBandit._bound_counts, PL.Planner.decide,
                                               PL.Planner.decide_held, PL.Planner._restriction)

    def bound_counts_logged(self, b, cnt):
        out = bound_counts(self, b, cnt)
        if out is not cnt:
            LOOKS.append((len(LOG), [str(self.arms[i]) for i, (x, y) in enumerate(zip(cnt, out)) if x != y][:1],
                          [round(x, 2) for x in out[:3]]))
        return out

    def restriction_logged(self, ctx, s, now):
        r = restriction(self, ctx, s, now)
        self._why = "held-AR" if r is not None and len(r) == 1 else ("restricted" if r is not None and s.batch_size >= 2 else "free")
        return r

    def decide_logged(self, s):
        self._why = "idle" if s.batch_size == 0 else "?"
        d = decide(self, s)
        LOG.append((d.mode.value, self._why, str(self._ctx)))
        return d

    def held_logged(self, *a, **k):
        d = held(self, *a, **k)
        if d is not None:
            LOG.append((d.mode.value, "held", str(self._ctx)))
        return d

    BD.ContextualBandit._bound_counts = bound_counts_logged
    PL.Planner.decide, PL.Planner.decide_held, PL.Planner._restriction = decide_logged, held_logged, restriction_logged


def main() -> None:
    instrument()
    for trial in range(int(sys.argv[1])):
        engine, placement, args = auto_engine()
        try:
            BL.compile_warm_up(engine, placement, args)
            print("warm-up looks:", LOOKS[:10])
            LOOKS.clear()
            LOG.clear()
            rates = [run_level(engine, placement, load_prompts(args.prompts, n), concurrency=1, max_tokens=48,
                               temperature=0)["tokens_per_s"] for n in (4, 8, 8)]
            ar = sum(m == "ar" for m, _, _ in LOG) / len(LOG)
            print(f"trial {trial}: tok/s {' '.join(f'{x:.0f}' for x in rates)}; plain on {ar:.2f} of {len(LOG)} steps")
            print("   looks (step, group's first arm, counts):", LOOKS[:12], len(LOOKS))
            LOOKS.clear()
            if ar > 0.2:
                rle = [(k, len(list(g))) for k, g in itertools.groupby(LOG)]
                print("   " + " ".join(f"{m}/{w}/{c}x{n}" for (m, w, c), n in rle[:40]))
                b = engine.planner.bandit
                for ctx in b.contexts:
                    cs = b.context_stats(ctx)
                    print("   ", ctx, "plays", {str(k): v for k, v in cs.plays.items()},
                          "blocks", {str(k): v for k, v in cs.blocks_per_arm.items()})
                print("    offloads", getattr(engine.planner, "offloads", None), "mode switches", engine.planner.mode_switches)
            sys.stdout.flush()
        finally:
            engine.close()


if __name__ == "__main__":      # (a drafter worker re-imports this module: nothing runs there)
    main()
