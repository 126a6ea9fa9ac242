import sys, argparse, time, statistics, collections, os
from pathlib import Path
# ROOT: the checkout whose code is timed (default: this one)
R = os.environ.get("ROOT", str(Path(__file__).resolve().parents[3])); sys.path.insert(0, R); sys.path.insert(0, R + "/scripts")
C = int(os.environ.get("C", "1"))
def main():
    import trace_levels as tl
    from client.bench_compare import build_engines, _apply
    from client.bench_levels import add_levels_parser
    from backend.sampling.params import SamplingParams
    from client.prompts import load_prompts
    levels = argparse.ArgumentParser(); add_levels_parser(levels.add_subparsers())
    engines = build_engines(levels.parse_args(["levels"]), ["auto"])
    engine, placement = engines["auto"]
    tl.run(engine, placement, C)
    ctl = engine.adaptive; pl = ctl.planner
    acc = collections.defaultdict(list)
    def wrap(obj, name, label):
        f = getattr(obj, name)
        def w(*a, **k):
            t0 = time.perf_counter()
            try: return f(*a, **k)
            finally: acc[label].append(time.perf_counter() - t0)
        setattr(obj, name, w)
    wrap(ctl, "plan", "A ctl.plan"); wrap(ctl, "observe", "B ctl.observe")
    wrap(ctl, "_snapshot", "A1 _snapshot"); wrap(pl, "decide", "A2 decide")
    wrap(ctl.signals, "snapshot", "A1a signals.snapshot")
    wrap(ctl.drafter, "lag_tokens", "A1b lag_tokens")
    wrap(ctl.kv, "usage", "A1c kv.usage")
    if ctl.memory is not None:
        wrap(ctl.memory, "growth_if_offloaded", "A1d growth"); wrap(ctl.memory, "usage_at_base", "A1e at_base")
    wrap(pl.bandit, "select", "A2b select"); wrap(pl, "_restriction", "A2a _restriction")
    wrap(pl._pruner, "allowed", "A2a1 pruner.allowed"); wrap(pl._memory, "hold", "A2a2 memory.hold")
    wrap(pl.bins, "context", "A2c bins.context"); wrap(pl._timeline, "note", "A2d timeline")
    wrap(ctl, "_lend_cores", "A3 _lend_cores"); wrap(pl, "wants_offload", "A4 wants_offload")
    wrap(ctl, "_any_decoding", "A5 any_decoding")
    wrap(ctl.placement, "lend_drafter_cores", "A3a placement.lend"); wrap(ctl.lending, "lend", "A3b lending.lend")
    wrap(ctl, "_observe_serving", "B1 _observe_serving"); wrap(ctl, "_observe_lending", "B2 _observe_lending")
    wrap(pl, "observe", "B3 planner.observe"); wrap(pl.bandit, "update", "B3a update")
    wrap(pl._loss, "measure", "B3b loss.measure")
    wrap(pl._memory, "observe_ar", "B3c memory.observe_ar"); wrap(pl._switch.turn_off, "observe", "B3d turn_off.observe")
    wrap(pl._switch, "observe_off", "B3e observe_off"); wrap(pl._acceptance, "expected_tokens", "B3f expected_tokens")
    wrap(pl._ngram_matches, "observe", "B3g ngram")
    _apply(placement)
    prompts = load_prompts(None, int(os.environ.get("N", 16*C)))
    engine.generate(prompts, [SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True) for _ in prompts], max_concurrency=C)
    engine.close()
    for k in sorted(acc):
        v = acc[k]; print(f"{k:30s} n={len(v):5d} median {1e6*statistics.median(v):6.1f} us")
if __name__ == "__main__":
    main()
