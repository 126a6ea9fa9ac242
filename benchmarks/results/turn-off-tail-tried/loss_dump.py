"""`bench levels` in process with every step auto's planner observes written down: the arm that
ran, its bin, the step's wall and committed tokens, the prompts it fed, the loss measured and the
loss the bandit was given (or that it was only played), then the bandit's measured means and the
switch costs' summary at the end. Run from a checkout, with PYTHONPATH naming it (the script's
own folder comes first on sys.path, so the checkout must be named to be the code that runs):

    cd CHECKOUT && PYTHONPATH=$PWD python $REPO/benchmarks/results/turn-off-tail-tried/loss_dump.py 4,16 DUMP.json \
        --configs auto,ar-2dev,psd --repeats 2 --json LEVELS.json

The first argument is `bench levels --concurrency`; the rest go to `bench levels`."""
import json
import sys

import client.bench_levels as BL
from client import cli
from planner.arms import arm_str

LEVEL = sys.argv[1]
OUT = sys.argv[2]
log = []
state = {"phase": "warm", "calls": 0}
_build = BL.build_engines


def hook(planner):
    bandit = planner.bandit
    ru, rc, ro, rm = bandit.update, bandit.count_play, planner.observe, planner._loss.measure
    cur = {}

    def update(ctx, arm, loss, weight=1.0):
        ru(ctx, arm, loss, weight); cur.update(how="scored", loss=loss, w=weight)

    def count(ctx, arm):
        cur.setdefault("how", "played"); rc(ctx, arm)

    def measure(ctx, running, **k):
        c = rm(ctx, running, **k)
        cur.update(ctx=str(ctx), running=running, wall_in=k["step_wall_s"], tok=k["tokens_committed"],
                   prefill_tokens=k["prefill_tokens"], wall=c.wall_s, loss_m=c.loss, settling=k.get("settling"))
        return c

    def observe(issued, o):
        cur.clear()
        ro(issued, o)
        ran = o.ran if o.ran is not None else issued
        rec = dict(cur, phase=state["phase"], issued=arm_str(issued.arm), ran=arm_str(ran.arm),
                   committed=o.tokens_committed, batch=o.batch_size, decoded=o.decoded,
                   trying=o.trying_cores, rebuild=o.drafter_rebuild_s)
        log.append(rec)
    planner._loss.measure = measure
    bandit.update, bandit.count_play, planner.observe = update, count, observe


def build(args, names):
    engines = _build(args, names)
    hook(engines["auto"][0].planner)
    state["engines"] = engines
    return engines


_run_level = BL.run_level


def run_level(engine, placement, prompts, **kw):
    auto = state.get("engines", {}).get("auto")
    if auto is not None and engine is auto[0]:
        state["calls"] += 1
        state["phase"] = f"c{kw.get('concurrency')}-run{state['calls']}"
        log.append({"mark": state["phase"]})
    return _run_level(engine, placement, prompts, **kw)


if __name__ == "__main__":
    BL.build_engines, BL.run_level = build, run_level
    cli.main(["bench", "levels", "--paths", "in-process", "--concurrency", str(LEVEL),
              "--json", "bench-levels.json"] + sys.argv[3:])
    planner = state["engines"]["auto"][0].planner
    bandit = planner.bandit
    means = {str(ctx): {arm_str(a): (m, n) for a, (m, n) in bandit.context_stats(ctx).means.items()}
             for ctx in bandit.contexts}
    import planner as P
    json.dump({"log": log, "means": means, "code": P.__file__,
               "switch": planner.stats()["switch_cost"]}, open(OUT, "w"))
    print("code:", P.__file__)
