import sys, argparse, time, statistics, collections
import os; R = os.environ.get("ROOT", "/work/main"); sys.path.insert(0, R); sys.path.insert(0, R + "/scripts")
def main():
    import trace_levels as tl
    from client.bench_compare import build_engines, _apply
    from client.bench_levels import add_levels_parser
    from backend.sampling.params import SamplingParams
    from client.prompts import load_prompts
    levels = argparse.ArgumentParser(); add_levels_parser(levels.add_subparsers())
    engines = build_engines(levels.parse_args(["levels"]), ["auto"])
    engine, placement = engines["auto"]
    tl.run(engine, placement, 1)
    ctl = engine.adaptive; pl = ctl.planner
    acc = collections.defaultdict(list)
    def wrap(obj, name, label):
        f = getattr(obj, name)
        def w(*a, **k):
            t0 = time.perf_counter()
            try: return f(*a, **k)
            finally: acc[label].append(time.perf_counter() - t0)
        setattr(obj, name, w)
    wrap(ctl, "plan", "ctl.plan"); wrap(ctl, "observe", "ctl.observe")
    wrap(ctl, "_snapshot", "plan/_snapshot"); wrap(pl, "decide", "plan/decide")
    wrap(pl.bandit, "select", "plan/decide/select"); wrap(pl, "_restriction", "plan/decide/_restriction")
    wrap(pl.bins, "context", "plan/decide/bins.context")
    wrap(ctl, "_lend_cores", "plan/_lend_cores"); wrap(pl, "wants_offload", "plan/wants_offload")
    wrap(ctl.signals, "snapshot", "plan/_snapshot/signals.snapshot")
    wrap(ctl, "_observe_serving", "obs/_observe_serving"); wrap(ctl, "_observe_lending", "obs/_observe_lending")
    wrap(pl, "observe", "obs/planner.observe"); wrap(pl.bandit, "update", "obs/planner.observe/update")
    wrap(pl._loss, "measure", "obs/planner.observe/loss.measure")
    wrap(pl.bandit, "count_play", "obs/count_play")
    _apply(placement)
    prompts = load_prompts(None, 16)
    engine.generate(prompts, [SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True) for _ in prompts], max_concurrency=1)
    engine.close()
    for k in sorted(acc):
        v = acc[k]; print(f"{k:45s} n={len(v):5d} median {1e6*statistics.median(v):6.1f} us  mean {1e6*statistics.mean(v):6.1f}")
if __name__ == "__main__":
    main()
