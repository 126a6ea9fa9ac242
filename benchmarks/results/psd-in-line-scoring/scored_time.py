"""`bench levels` in process at one concurrency (every configuration, two repeats), recording
for auto's measured runs, in the batch-size bin of the level (the steps at full load), how its
planner used each step: scored to an arm (`Bandit.update`),
counted as played only (a switch's cost: turn-off, PSD fill, or a prompt it could not price),
or no arm at all (a step that fed only prompts). Prints each class's share of auto's step time
and its milliseconds a committed token, and per arm the bandit's scored mean beside the time
its steps took.

    python scored_time.py [concurrency [bench levels options ...]]

Then, per batch-size bin its bandit has, the steps played per arm, each arm's mean (ms a
token, with its evidence) and its prior.
"""
import collections
import sys

import client.bench_levels as BL
from client import cli
from planner import LoadSignals
from planner.arms import arm_str

LEVEL = int(sys.argv[1]) if len(sys.argv) > 1 else 4
captured = {}
# (how the planner used a step, its arm) -> steps, seconds, tokens, scored loss x weight, weight
rows = collections.defaultdict(lambda: [0, 0.0, 0.0, 0.0, 0.0])
why_played = collections.Counter()    # (trying cores, fed prompts, prompts unpriced) -> steps
state = {"on": False, "action": None}
_build, _record = BL.build_engines, BL._run_record


def hook(planner):
    bandit = planner.bandit
    real_update, real_count, real_observe = bandit.update, bandit.count_play, planner.observe

    def update(ctx, arm, loss, weight=1.0):
        real_update(ctx, arm, loss, weight)
        state["action"] = ("scored", arm_str(arm), loss * weight, weight, ctx)

    def count(ctx, arm):        # (update calls it too: there the step was scored)
        if state["action"] is None:
            state["action"] = ("played", arm_str(arm), 0.0, 0.0, ctx)
        real_count(ctx, arm)

    def observe(issued, o):
        state["action"] = None
        real_observe(issued, o)
        if not state["on"]:
            return
        ran = o.ran if o.ran is not None else issued
        ctx = state["action"][4] if state["action"] else planner.bins.context(LoadSignals(batch_size=o.batch_size))
        if ctx != planner.bins.context(LoadSignals(batch_size=LEVEL)):
            return
        if state["action"] and state["action"][0] == "played":
            why_played[(o.trying_cores, o.prefill_tokens > 0, state.get("unpriced"))] += 1
        how, arm, lw, w = (state["action"] or ("no arm", arm_str(ran.arm) if o.decoded else "prompts only", 0.0, 0.0))[:4]
        r = rows[(how, arm)]
        for i, v in enumerate((1, o.step_wall_s, o.tokens_committed, lw, w)):
            r[i] += v
    real_measure = planner._loss.measure

    def measure(*a, **k):
        cost = real_measure(*a, **k)
        state["unpriced"] = cost.prefill_unpriced
        return cost
    planner._loss.measure = measure
    bandit.update, bandit.count_play, planner.observe = update, count, observe


def build(args, names):
    engines = _build(args, names)
    captured.update(engines)
    hook(engines["auto"][0].planner)
    return engines


def record(path, name, level, rep, tok):
    run = _record(path, name, level, rep, tok)
    if name == "auto":
        state["on"] = False
    return run


_run_level = BL.run_level


def run_level(engine, placement, prompts, **kw):
    auto = captured.get("auto")
    mine = auto is not None and engine is auto[0] and kw.get("concurrency") == LEVEL
    if mine:
        state["calls"] = state.get("calls", 0) + 1
    state["on"] = mine and state["calls"] > 1        # the level's first run is its warm-up
    return _run_level(engine, placement, prompts, **kw)


if __name__ == "__main__":      # (a drafter worker re-imports this module: nothing runs there)
    BL.build_engines, BL._run_record, BL.run_level = build, record, run_level
    cli.main(["bench", "levels", "--paths", "in-process", "--concurrency", str(LEVEL), "--repeats", "2",
              "--json", "/tmp/scored_time.json"] + sys.argv[2:])
    print("played, by (trying cores, fed prompts, unpriced):", why_played or None)
    total = sum(r[1] for r in rows.values())
    tokens = sum(r[2] for r in rows.values())
    print(f"auto at concurrency {LEVEL}, measured runs, bin {captured['auto'][0].planner.bins.context(LoadSignals(batch_size=LEVEL))}: {total:.2f} s of steps, {tokens:.0f} tokens, "
          f"{1e3 * total / tokens:.3f} ms a token")
    for k in sorted(rows):
        n, s, t, lw, w = rows[k]
        scored = f"  scored mean {1e3 * lw / w:.3f}" if w else ""
        print(f"  {k[0]:7s} {k[1]:13s} steps {n:5d}  {100 * s / total:5.1f} % of the time  "
              f"{1e3 * s / max(t, 1):7.3f} ms a token{scored}")
    bandit = captured["auto"][0].planner.bandit
    for ctx in bandit.contexts:
        cs = bandit.context_stats(ctx)
        plays = {arm_str(a): n for a, n in cs.plays.items() if n}
        prior = bandit._read_prior(ctx, bandit._bin(ctx))
        print(f" bin {ctx}: steps {cs.steps}, plays {plays}")
        print("   mean (ms a token, evidence) / prior:", {
            arm_str(a): (round(m * 1e3, 3), round(n, 1), round(p * 1e3, 3))
            for (a, (m, n)), p in zip(cs.means.items(), prior) if arm_str(a) in plays or a == bandit.arms[0]})
    lending = captured["auto"][0].adaptive.lending
    if lending is not None:
        print(" core lending (per batch bin: seconds a token lent / not lent, steps):", lending.summary())
