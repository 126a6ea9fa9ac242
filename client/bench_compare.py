"""`nightdraft bench compare`: AR, SD and batch-parallel SD side by side, in one process run.

Every configuration is loaded once; then, at each concurrency, each configuration runs the same
prompts in turn (the order rotates between repeats), so the machine's noise falls on all of them
alike. Rows say which comparison they are:

  ar-1dev  plain decoding, the target on one core (the device the target has in SD/PSD)
  ar-2dev  plain decoding given both cores (two threads): what the drafter's device buys AR
  sd       sequential SD, drafter in its worker on its own core (MineDraft's baseline)
  psd      batch-parallel SD, same two devices as sd
  sd-ahead   sd, the worker drafting the next round while the target verifies (draft-ahead)
  psd-ahead  psd, its in-line fallback (a sub-batch with nothing drafted) drafting ahead too
  ngram    SD with n-gram (prompt lookup) drafts: no drafter, the target on one core (as ar-1dev)
  ngram-auto  mode auto over the n-gram proposer: the planner picks plain decoding or a gamma
  ngram-auto-cold  the same, the planner started without its calibrated cost model
  auto     mode auto with the drafter in its worker on its own core (what `mode: auto` serves):
           the planner picks plain decoding, SD or PSD and gamma, per step
  auto-both  mode auto holding the drafter model (in its worker) and an n-gram proposer: the
             planner picks plain decoding, drafter SD / PSD or n-gram SD, and gamma, per step

Next to each measured throughput stands the cost model's prediction from a calibration of the
same forwards (planner/cost_model.py).
"""
from __future__ import annotations


import json
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from backend.mode import Mode
from planner.cost_model import CostProfile, alpha_for_tokens_per_call, predict, psd_speedup_bound
from client.bench_offline import add_engine_args, executor_args
from client.prompts import load_prompts
from client.plotting import pyplot

CONFIGS = ("ar-1dev", "ar-2dev", "sd", "psd")
AHEAD_CONFIGS = ("sd-ahead", "psd-ahead")
AUTO_CONFIGS = ("auto", "auto-both")
NGRAM_CONFIGS = ("ngram", "ngram-auto", "ngram-auto-cold")


def add_compare_parser(bench_sub) -> None:
    p = bench_sub.add_parser("compare", help="AR vs SD vs PSD, interleaved, at several concurrencies")
    add_engine_args(p)
    p.add_argument("--gamma", type=int, default=4)
    p.add_argument("--concurrency", default="1,4,16,32,64", help="comma-separated levels")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--requests-per-level", type=float, default=2.0,
                   help="requests per run = this x concurrency (at least 8)")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--prompts", default=None, help='a prompts file, or a bundled set: "heldout" (default), "edit", "prose"')
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--json", default="bench-compare.json")
    p.add_argument("--plot", default=None, help="PNG path (default: next to --json)")
    p.set_defaults(func=run_compare_cli)


@dataclass
class Placement:
    cores: list[int]
    threads: int


def _placements() -> tuple[Placement, Placement]:
    cores = sorted(os.sched_getaffinity(0))
    one = Placement(cores[:-1] or cores, max(1, len(cores) - 1))
    return one, Placement(cores, len(cores))


def _apply(p: Placement) -> None:
    os.sched_setaffinity(0, p.cores)
    torch.set_num_threads(p.threads)


def planner_variant(name: str, bases: tuple[str, ...] = ("auto",)) -> dict | None:
    """The settings of a configuration named ``BASE@KEY=VALUE+KEY=VALUE`` (the configuration
    BASE, one of `bases`, with those planner or engine settings, e.g.
    ``auto@plain_settle_steps=3+prune=false``: `split_variant`; each VALUE is read as JSON, else
    taken as a string), None for any other name. The settings are checked where the engine's
    config is: an unknown key or a wrong type fails before anything loads."""
    base, at, spec = name.partition("@")
    if base not in bases or not at:
        return None
    pairs = [item.split("=", 1) for item in spec.split("+")]
    if not spec or any(len(p) != 2 or not p[0] for p in pairs):
        raise ValueError(f"config {name!r}: expected {base}@KEY=VALUE[+KEY=VALUE...]")
    settings = {}
    for key, text in pairs:
        try:
            settings[key] = json.loads(text)
        except ValueError:
            settings[key] = text
    return settings


def check_variants(names, config_of, bases: tuple[str, ...] = ("auto",)) -> None:
    """Every variant among `names` (`planner_variant` with `bases`) checked before anything
    loads: `config_of(name)` is its engine configuration, built as `EngineConfig` here, so an
    unknown key or a wrong type fails now, naming the configuration, not after the first runs."""
    from backend.engine.config import EngineConfig
    for n in names:
        if planner_variant(n, bases) is not None:
            try:
                EngineConfig(**config_of(n))
            except (TypeError, ValueError) as e:
                raise ValueError(f"config {n!r}: {e}") from None


def split_variant(settings: dict) -> tuple[dict, dict]:
    """A variant's settings as (the engine's keys, the planner's): a key that names one of the
    engine's settings (``auto@lend_drafter_cores=false``) is the engine's, any other the
    planner's (no setting has a name in both)."""
    from dataclasses import fields

    from backend.engine.config import EngineConfig

    engine_fields = {f.name for f in fields(EngineConfig)} - {"planner", "mode"}
    engine = {k: v for k, v in settings.items() if k in engine_fields}
    return engine, {k: v for k, v in settings.items() if k not in engine}


def engine_config(name: str, args) -> tuple[dict, Placement]:
    """One configuration's engine keys (also a server's engine.json) and its target's placement."""
    variant = planner_variant(name)
    if variant is not None:
        cfg, placement = engine_config("auto", args)
        engine_keys, planner_keys = split_variant(variant)
        return cfg | engine_keys | {"planner": planner_keys}, placement
    one, both = _placements()
    cfg = dict(target=args.target, device=args.device, dtype=args.dtype,
               kv_cache_bytes=args.kv_cache_mb << 20, max_num_seqs=128, seed=0, **executor_args(args))
    drafter = dict(drafter=args.drafter, gamma=args.gamma, drafter_device="cpu")
    if name == "ar-1dev":
        return cfg | {"num_threads": one.threads}, one
    if name == "ar-2dev":
        return cfg | {"num_threads": both.threads}, both
    if name in ("sd", "psd") + AHEAD_CONFIGS:
        return cfg | drafter | {"mode": name.removesuffix("-ahead"), "draft_ahead": name in AHEAD_CONFIGS,
                                "num_threads": one.threads}, one
    if name in AUTO_CONFIGS:
        proposer = {"proposer": "both"} if name == "auto-both" else {}
        return cfg | drafter | {"mode": "auto", "num_threads": one.threads} | proposer, one
    if name in NGRAM_CONFIGS:
        return cfg | {"proposer": "ngram", "mode": "sd" if name == "ngram" else "auto", "gamma": args.gamma,
                      "num_threads": one.threads,
                      "planner_cost_profile": "off" if name.endswith("-cold") else "calibrate"}, one
    raise ValueError(f"unknown config {name!r}; "
                     f"choose from {CONFIGS + AHEAD_CONFIGS + NGRAM_CONFIGS + AUTO_CONFIGS}")


def build_engines(args, names: list[str]) -> dict:
    from backend.engine.engine import Engine
    from backend.engine.config import EngineConfig

    _, both = _placements()
    engines = {}
    for name in names:
        cfg, placement = engine_config(name, args)
        print(f"loading {name} ...", file=sys.stderr)
        # An engine plans its worker's core from this thread's cores: all of them, not a
        # placement's the thread was last given, or its worker lands on the target's core.
        os.sched_setaffinity(0, both.cores)
        engines[name] = (Engine(EngineConfig(**cfg)), placement)
    return engines


def calibrate(engine, drafter_path: str, gamma: int, batches: list[int], placement: Placement,
              reps: int = 5) -> CostProfile:
    """The cost profile as mode auto's planner measures it (:mod:`backend.engine.calibration`),
    under the target's placement: target forwards of b x 1 and b x (gamma+1) tokens, and the
    drafter's proposals of one position and of gamma, split into the call's own cost and each
    position's (a proposal's call is paid once, not per position)."""
    from backend.engine.calibration import calibration_drafter, measure_cost_profile

    _apply(placement)
    cfg = engine.config
    drafter = calibration_drafter(drafter_path, cfg, engine.dtype, max_batch=max(batches),
                                  longest=gamma)
    return measure_cost_profile(engine.runner, drafter, batches=batches, token_counts=(1, gamma + 1),
                                device=cfg.device, dtype=engine.dtype, reps=reps, longest_proposal=gamma)


class FullLoad:
    """A closed loop's tokens and time while it runs at its full concurrency: from the start
    until fewer than `concurrency` requests are left to finish (the drain). Requests that
    speculation lets finish at different steps leave a drain of smaller and smaller batches
    at the end of a run, which a level held for hours never runs; plain decoding in lockstep
    has none (its last requests finish in one step). perf_analyzer's windows, through the
    server, are measured at full load too."""

    def __init__(self, requests: int, concurrency: int):
        self._last_at_load = requests - min(concurrency, requests)   # finished requests before the drain
        self.finished = 0
        self.tokens = 0
        self.until: float | None = None     # when the drain began (None: not yet)

    def observe(self, outputs, now: float) -> None:
        """One step's outputs, and the time it ended."""
        if self.until is not None:
            return
        self.tokens += sum(len(o.new_token_ids) for o in outputs)
        self.finished += sum(1 for o in outputs if o.finished)
        if self.finished > self._last_at_load:
            self.until = now

    def tokens_per_s(self, start: float) -> float:
        return self.tokens / (self.until - start) if self.until is not None and self.until > start else 0.0


def run_level(engine, placement: Placement, prompts: list[str], *, concurrency: int,
              max_tokens: int, temperature: float) -> dict:
    from backend.sampling.params import SamplingParams

    _apply(placement)
    params = [SamplingParams(max_tokens=max_tokens, temperature=temperature, ignore_eos=True,
                             seed=None if temperature == 0 else i) for i in range(len(prompts))]
    s0 = _snapshot(engine)
    sums = {"draft": 0.0, "verify": 0.0, "step": 0.0, "psd_draft": 0.0, "psd_verify": 0.0,
            "psd_step": 0.0, "steps": 0}

    full_load = FullLoad(len(prompts), concurrency)

    def on_step(outs):
        full_load.observe(outs, time.perf_counter())
        st = engine.stats().last_step
        sums["draft"] += st.t_draft_s
        sums["verify"] += st.t_verify_s
        sums["step"] += st.t_step_s
        sums["steps"] += 1
        if st.mode is Mode.PSD:
            sums["psd_draft"] += st.t_draft_s
            sums["psd_verify"] += st.t_verify_s
            sums["psd_step"] += st.t_step_s

    t0 = time.perf_counter()
    out = engine.generate(prompts, params, on_step=on_step, max_concurrency=concurrency)
    wall = time.perf_counter() - t0
    s1 = _snapshot(engine)
    tokens = sum(len(c.output_ids) for c in out)
    drafted = s1["drafted"] - s0["drafted"]
    calls = s1["calls"] - s0["calls"]
    return {
        "tokens_per_s": tokens / wall,
        "tokens_per_s_at_full_load": full_load.tokens_per_s(t0),
        "full_load_token_share": full_load.tokens / tokens if tokens else 0.0,
        "mean_latency_s": statistics.fmean(c.latency_s for c in out),
        "p99_latency_s": sorted(c.latency_s for c in out)[int(0.99 * (len(out) - 1))],
        "wall_s": wall,
        "output_tokens": tokens,
        "acceptance_rate": (s1["accepted"] - s0["accepted"]) / drafted if drafted else 0.0,
        "tokens_per_target_call": (s1["dtok"] - s0["dtok"]) / calls if calls else 0.0,
        "steps": sums["steps"],
        "mean_t_draft_s": sums["draft"] / max(sums["steps"], 1),
        "mean_t_verify_s": sums["verify"] / max(sums["steps"], 1),
        "overlap_efficiency": ((sums["psd_draft"] + sums["psd_verify"]) / sums["psd_step"]
                               if sums["psd_step"] else None),
        "psd_fallback_steps": s1["fallback"] - s0["fallback"],
        "psd_unbalanced_steps": s1["unbalanced"] - s0["unbalanced"],
        **_ahead_delta(s0["ahead"], s1["ahead"]),
    }


def _ahead_delta(a0: dict, a1: dict) -> dict:
    """Draft-ahead over one run: its hit rate, the hit rate by accepted length, seconds hidden."""
    if not a1:
        return {}
    rounds = a1["rounds"] - a0.get("rounds", 0)
    by = {}
    for k, row in a1["by_accepted"].items():
        before = a0.get("by_accepted", {}).get(k, {"rounds": 0, "hits": 0})
        n, h = row["rounds"] - before["rounds"], row["hits"] - before["hits"]
        if n:
            by[k] = {"rounds": n, "hit_rate": h / n}
    return {"ahead_hit_rate": (a1["hits"] - a0.get("hits", 0)) / rounds if rounds else None,
            "ahead_by_accepted": by, "ahead_hidden_s": a1["hidden_s"] - a0.get("hidden_s", 0.0)}


def _snapshot(engine) -> dict:
    s = engine.stats()
    return {"drafted": s.drafted_tokens, "accepted": s.accepted_tokens, "calls": s.target_calls,
            "dtok": s.decode_tokens, "fallback": s.psd_fallback_steps,
            "unbalanced": s.psd_unbalanced_steps, "ahead": s.draft_ahead}


def run_compare_cli(args) -> int:
    names = [n.strip() for n in args.configs.split(",") if n.strip()]
    levels = [int(c) for c in args.concurrency.split(",")]
    engines = build_engines(args, names)
    try:
        base = next(iter(engines.values()))[0]
        one, _ = _placements()
        print("calibrating the cost model ...", file=sys.stderr)
        profile = calibrate(base, args.drafter, args.gamma,
                            sorted({1, 2} | set(levels) | {max(1, c // 2) for c in levels}), one)
        results: dict = {n: {} for n in names}
        for level in levels:
            n_req = max(8, int(args.requests_per_level * level))
            prompts = load_prompts(args.prompts, n_req)
            for rep in range(args.repeats):
                order = names[rep % len(names):] + names[:rep % len(names)]
                for name in order:
                    engine, placement = engines[name]
                    print(f"  concurrency {level:>3}  {name:<8} ({n_req} requests) ...", file=sys.stderr)
                    r = run_level(engine, placement, prompts, concurrency=level,
                                  max_tokens=args.max_tokens, temperature=args.temperature)
                    results[name].setdefault(level, []).append(r)
        table = summarise(results, profile, args.gamma, levels)
    finally:
        for engine, _ in engines.values():
            engine.close()
    report = {"gamma": args.gamma, "max_tokens": args.max_tokens, "temperature": args.temperature,
              "target": args.target, "drafter": args.drafter, "cores": sorted(os.sched_getaffinity(0)),
              "torch": torch.__version__, "profile": profile.to_dict(), "rows": table}
    Path(args.json).write_text(json.dumps(report, indent=1))
    print(format_table(table))
    plot = args.plot or str(Path(args.json).with_suffix(".png"))
    draw(table, plot)
    print(f"wrote {args.json} and {plot}", file=sys.stderr)
    return 0


def summarise(results: dict, profile: CostProfile, gamma: int, levels: list[int]) -> list[dict]:
    rows = []
    for level in levels:
        # alpha for the prediction: the per-position acceptance at which the cost model's expected
        # tokens per call is what SD measured at this level (PSD's is the same pair); the share of
        # drafted tokens accepted is lower and would under-predict SD.
        calls = [r["tokens_per_target_call"] for n in ("sd", "psd") for r in results.get(n, {}).get(level, [])]
        alpha = alpha_for_tokens_per_call(statistics.fmean(calls), gamma) if calls else 0.0
        for name, per_level in results.items():
            runs = per_level.get(level, [])
            if not runs:
                continue
            mode = {"ar-1dev": "ar", "ar-2dev": "ar"}.get(name, name)
            row = {"config": name, "concurrency": level}
            for key in runs[0]:
                if key == "ahead_by_accepted":       # a breakdown, not a figure: the first run's
                    row[key] = runs[0][key]
                    continue
                vals = [r[key] for r in runs if r[key] is not None]
                row[key] = statistics.median(vals) if vals else None
            if name in ("ar-1dev", "sd", "psd"):   # what the profile measured (one device, the drafter)
                row["predicted_tokens_per_s"] = predict(mode, level, gamma, alpha, profile).tokens_per_s
            rows.append(row)
        by = {r["config"]: r for r in rows if r["concurrency"] == level}
        for ahead in AHEAD_CONFIGS:      # against the same mode without it, same placement
            plain = ahead.removesuffix("-ahead")
            if ahead in by and plain in by:
                by[ahead]["over_without_ahead"] = by[ahead]["tokens_per_s"] / by[plain]["tokens_per_s"]
        if "psd" in by and "sd" in by:
            by["psd"]["psd_over_sd"] = by["psd"]["tokens_per_s"] / by["sd"]["tokens_per_s"]
            by["psd"]["psd_bound_over_sd"] = psd_speedup_bound(level, gamma, profile) if level >= 2 else 1.0
        if "ar-1dev" in by:        # every row against plain decoding on the same one device
            for row in by.values():
                row["over_ar-1dev"] = row["tokens_per_s"] / by["ar-1dev"]["tokens_per_s"]
        for ar in ("ar-1dev", "ar-2dev"):
            if "psd" in by and ar in by:
                by["psd"][f"psd_over_{ar}"] = by["psd"]["tokens_per_s"] / by[ar]["tokens_per_s"]
            if "sd" in by and ar in by:
                by["sd"][f"sd_over_{ar}"] = by["sd"]["tokens_per_s"] / by[ar]["tokens_per_s"]
    return rows


def format_table(rows: list[dict]) -> str:
    head = (f"{'conc':>4} {'config':<15} {'tok/s':>8} {'pred':>8} {'lat_s':>7} {'accept':>6} "
            f"{'tok/call':>8} {'overlap':>7} {'psd/sd':>7} {'x ar1':>7} {'psd/ar2':>7} {'ahead':>6} {'hits':>5}")
    lines = [head, "-" * len(head)]
    for r in rows:
        def f(key, fmt):
            v = r.get(key)
            return format(v, fmt) if isinstance(v, (int, float)) else "-".rjust(int(fmt.split(".")[0]))
        lines.append(f"{r['concurrency']:>4} {r['config']:<15} {f('tokens_per_s', '8.1f')} "
                     f"{f('predicted_tokens_per_s', '8.1f')} {f('mean_latency_s', '7.3f')} "
                     f"{f('acceptance_rate', '6.2f')} {f('tokens_per_target_call', '8.2f')} "
                     f"{f('overlap_efficiency', '7.2f')} {f('psd_over_sd', '7.2f')} "
                     f"{f('over_ar-1dev', '7.2f')} {f('psd_over_ar-2dev', '7.2f')} "
                     f"{f('over_without_ahead', '6.2f')} {f('ahead_hit_rate', '5.2f')}")
    return "\n".join(lines)


def draw(rows: list[dict], path: str) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for name in dict.fromkeys(r["config"] for r in rows):
        rs = [r for r in rows if r["config"] == name]
        xs = [r["concurrency"] for r in rs]
        line, = ax1.plot(xs, [r["tokens_per_s"] for r in rs], marker="o", label=f"{name} measured")
        if any(r.get("predicted_tokens_per_s") for r in rs):
            ax1.plot(xs, [r.get("predicted_tokens_per_s") for r in rs], ls="--", color=line.get_color(),
                     label=f"{name} predicted")
        ax2.plot(xs, [r["mean_latency_s"] for r in rs], marker="o", label=name)
    for ax, title, ylabel in ((ax1, "throughput", "tokens/s"), (ax2, "mean request latency", "s")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.grid(alpha=0.3)
    ax1.legend(fontsize=7)
    ax2.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
