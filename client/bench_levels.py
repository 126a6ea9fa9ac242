"""`nightdraft bench levels`: "pays off at every load level" as one table.

At each fixed concurrency (closed loop: every finished request is replaced at once) and through
both paths a user meets, in process and through a real tritonserver, it runs side by side:

  ar-1dev  plain decoding, the target on one core (the core it keeps beside a drafter)
  ar-2dev  plain decoding on every core: the baseline of a user who runs no drafter
  sd       sequential SD, the drafter in its worker on its own core
  psd      batch-parallel SD, the same two devices
  auto     mode auto: the planner picks plain decoding, SD or PSD and gamma per step
  auto@KEY=VALUE[+KEY=VALUE]   mode auto with those planner settings (or engine settings, a
           KEY that names one, e.g. lend_drafter_cores=false), beside auto: each
           repeat's ratio to auto is reported (the two ran minutes apart in the same rotation,
           so a change tried as a setting is weighed without the drift between separate runs)

and reports auto's throughput against the best fixed configuration of that level (the
"best fixed" includes plain decoding on every core) and against plain decoding on every core.

In process every configuration is loaded once and, at each concurrency, runs the same prompts in
turn, the order rotating between repeats. Through the server all configurations are served at
once (one tritonserver each, idle while another is measured) and measured in the same rotating
order, by perf_analyzer (C++, light on the shared cores; the default) or by this process's gRPC
streams (``--server-client python``); the server's throughput is its own generated-token
counter over the measured wall time. In process a run's throughput is measured the same way,
at full load: its tokens and time until fewer than `concurrency` requests are left to finish
(`tokens_per_s_whole_run` keeps the whole run's, drain included; the drain is the run's end,
not the level's load: requests that speculation lets finish at different steps end a run in
smaller and smaller batches, which plain decoding in lockstep never runs). A warm-up, one wave
of `concurrency` requests, is measured whole.

Each level starts with a warm-up for every configuration alike: ``--warmup-requests-per-level``
x concurrency requests at that level's own concurrency, not counted in the table. A level is
a fixed load, and the table compares what each configuration sustains under it, as a server
under that load runs for hours; a level's measured runs are 50-160 engine steps, too short to
amortise the first probes auto's planner makes in a batch size it has not seen. The warm-up's
runs are kept in the result file (``"warmup": true``, with auto's arms), so what that first
pass cost is on record; `bench dynamic` measures auto across changes of load.
"""
from __future__ import annotations

import contextlib
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from client.bench_compare import build_engines, check_variants, engine_config, planner_variant, run_level
from client.bench_offline import add_engine_args
from client.plotting import pyplot
from client.prompts import load_prompts

CONFIGS = ("ar-1dev", "ar-2dev", "sd", "psd", "auto")
ADAPTIVE = "auto"
PATHS = ("in-process", "server")


def add_levels_parser(bench_sub) -> None:
    p = bench_sub.add_parser("levels", help="auto beside plain decoding and the best fixed mode, per concurrency, "
                                            "in process and through tritonserver")
    add_engine_args(p)
    p.add_argument("--gamma", type=int, default=4, help="gamma of sd and psd (auto's largest)")
    p.add_argument("--concurrency", default="1,4,16,64", help="comma-separated levels")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--requests-per-level", type=float, default=2.0,
                   help="requests per run = this x concurrency (at least 8)")
    p.add_argument("--warmup-requests-per-level", type=float, default=1.0,
                   help="unmeasured requests per configuration before each level = this x concurrency "
                        "(at least 4), at that level's concurrency; 0: no warm-up")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--prompts", default=None, help='a prompts file, or a bundled set: "heldout" (default)')
    p.add_argument("--configs", default=",".join(CONFIGS),
                   help="comma-separated; auto@KEY=VALUE[+KEY=VALUE] adds mode auto with those planner "
                        "(or engine) settings, reported against auto repeat by repeat")
    p.add_argument("--paths", default=",".join(PATHS),
                   help="comma-separated, out of in-process and server (default: both)")
    p.add_argument("--server-client", choices=("perf_analyzer", "python"), default="perf_analyzer",
                   help="who loads the server: perf_analyzer (C++) or gRPC streams from this process")
    p.add_argument("--pa-window-s", type=float, default=4.0,
                   help="perf_analyzer's measurement window (it measures three)")
    p.add_argument("--json", default="bench-levels.json")
    p.add_argument("--plot", default=None, help="PNG path (default: next to --json)")
    p.set_defaults(func=run_levels_cli)


def run_levels_cli(args) -> int:
    names = [n.strip() for n in args.configs.split(",") if n.strip()]
    unknown = [n for n in names if n not in CONFIGS and planner_variant(n) is None]
    if unknown:
        raise ValueError(f"unknown config(s) {unknown}; choose from {CONFIGS} or auto@KEY=VALUE[+KEY=VALUE]")
    check_variants(names, lambda n: engine_config(n, args)[0])
    paths = [p.strip() for p in args.paths.split(",") if p.strip()]
    if not paths or any(p not in PATHS for p in paths):
        raise ValueError(f"--paths: choose from {PATHS}, got {args.paths!r}")
    if args.repeats < 1:
        raise ValueError("--repeats must be >= 1")
    if args.warmup_requests_per_level < 0:
        raise ValueError("--warmup-requests-per-level must be >= 0")
    levels = [int(c) for c in args.concurrency.split(",")]
    runs: list[dict] = []
    profiles: dict[str, dict] = {}     # the cost profile each in-process auto engine started from

    def record(run: dict) -> None:
        """Keep a run and rewrite the result file, so a failure later keeps what was measured."""
        runs.append(run)
        _progress(run)
        write_report(args, runs, complete=False, profiles=profiles)

    if "in-process" in paths:
        measure_in_process(args, names, levels, record, profiles)
    if "server" in paths:
        measure_on_server(args, names, levels, record)
    rows = write_report(args, runs, complete=True, profiles=profiles)
    print(format_table(rows))
    plot = args.plot or str(Path(args.json).with_suffix(".png"))
    draw(rows, plot)
    print(f"wrote {args.json} and {plot}", file=sys.stderr)
    return 0


def write_report(args, runs: list[dict], complete: bool, profiles: dict | None = None) -> list[dict]:
    """Write the result file (`complete` false while runs are still coming); returns its rows.
    `profiles`: the cost profile each in-process auto engine's planner started from (its prior
    orders the arms until they are measured, so a run's exploration can be read against it)."""
    rows = summarise(runs)
    report = {"complete": complete, "max_tokens": args.max_tokens, "temperature": args.temperature,
              "gamma": args.gamma, "target": args.target, "drafter": args.drafter, "repeats": args.repeats,
              "server_client": args.server_client, "cores": sorted(os.sched_getaffinity(0)),
              "torch": torch.__version__, "planner_cost_profiles": profiles or {}, "runs": runs,
              "rows": rows}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(args.json).with_suffix(".json.tmp")
    tmp.write_text(json.dumps(report, indent=1))
    tmp.replace(args.json)          # a reader never sees half a file
    return rows


def _rotated(names: list[str], rep: int) -> list[str]:
    return names[rep % len(names):] + names[:rep % len(names)]


def measure_in_process(args, names: list[str], levels: list[int], record, profiles: dict) -> None:
    cores = sorted(os.sched_getaffinity(0))
    engines = build_engines(args, names)
    try:
        for name, (engine, _) in engines.items():
            if engine.planner is not None and engine.planner.cost_profile is not None:
                profiles[name] = engine.planner.cost_profile.to_dict()
        for engine, placement in engines.values():
            compile_warm_up(engine, placement, args)
        for level in levels:
            prompts = load_prompts(args.prompts, max(8, int(args.requests_per_level * level)))
            warmup = load_prompts(args.prompts, warmup_requests(args, level))
            for rep in [WARMUP] * bool(warmup) + list(range(args.repeats)):
                for name in _rotated(names, max(rep, 0)):
                    engine, placement = engines[name]
                    before, counted = _arm_counts(engine), _engine_counters(engine)
                    r = run_level(engine, placement, warmup if rep == WARMUP else prompts, concurrency=level,
                                  max_tokens=args.max_tokens, temperature=args.temperature)
                    # at full load, as perf_analyzer measures the server (bench_compare.FullLoad);
                    # a warm-up is one wave, at full load only until its first request finishes:
                    # it is measured whole
                    tok = r["tokens_per_s"] if rep == WARMUP else r["tokens_per_s_at_full_load"]
                    run = _run_record("in-process", name, level, rep, tok)
                    run["tokens_per_s_whole_run"] = r["tokens_per_s"]
                    run["full_load_token_share"] = r["full_load_token_share"]
                    run["mean_latency_s"] = r["mean_latency_s"]
                    if engine.planner is not None:
                        run["arm_steps"] = _steps_since(before, _arm_counts(engine))
                    run["engine"] = {k: v - counted[k] for k, v in _engine_counters(engine).items()}
                    record(run)
    finally:
        for engine, _ in engines.values():
            engine.close()
        os.sched_setaffinity(0, cores)


def compile_warm_up(engine, placement, args) -> None:
    """Run an engine's graphs once before anything is measured (4 requests of 6 tokens at
    concurrency 2), as every in-process configuration gets before its levels."""
    run_level(engine, placement, load_prompts(args.prompts, 4), concurrency=2, max_tokens=6,
              temperature=args.temperature)


WARMUP = -1      # the repeat number of a level's warm-up run


def warmup_requests(args, level: int) -> int:
    """Requests of a level's warm-up per configuration (0: none)."""
    w = args.warmup_requests_per_level
    return max(4, int(w * level)) if w > 0 else 0


def _run_record(path: str, name: str, level: int, rep: int, tokens_per_s: float) -> dict:
    run = {"path": path, "config": name, "concurrency": level, "repeat": rep, "tokens_per_s": tokens_per_s}
    if rep == WARMUP:
        run["warmup"] = True
    return run


def _engine_counters(engine) -> dict[str, float]:
    """ENGINE_COUNTERS as the engine in this process has them now."""
    s = engine.stats()
    return {name: getattr(s, attr) for name, (attr, _) in ENGINE_COUNTERS.items()}


def _arm_counts(engine) -> dict[str, int]:
    """The steps the planner has given each arm ("ar", "sd:3", ...) so far; {} without one."""
    return dict(engine.planner.summary()["arm_counts"]) if engine.planner is not None else {}


def _steps_since(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {arm: n - before.get(arm, 0) for arm, n in after.items() if n > before.get(arm, 0)}


def arm_shares(runs: list[dict]) -> dict[str, float]:
    """Each arm's share of the steps over `runs` (auto's, in process): which arms it played."""
    total: dict[str, int] = {}
    for r in runs:
        for arm, n in r.get("arm_steps", {}).items():
            total[arm] = total.get(arm, 0) + n
    steps = sum(total.values())
    return {arm: n / steps for arm, n in sorted(total.items(), key=lambda kv: -kv[1])} if steps else {}


def measure_on_server(args, names: list[str], levels: list[int], record) -> None:
    from client.bench_serve import scrape_metrics
    from client.dynamic_server import MODEL, serving
    from client.profile_server import drive, drive_perf_analyzer

    prompts = load_prompts(args.prompts, max(8, int(args.requests_per_level * max(levels))))
    with contextlib.ExitStack() as stack:
        served = {}
        for name in names:
            print(f"starting tritonserver for {name} ...", file=sys.stderr)
            served[name] = stack.enter_context(serving(engine_config(name, args)[0], prompts[:2], args.temperature))
        for level in levels:
            n = max(8, int(args.requests_per_level * level))
            warmup = load_prompts(args.prompts, warmup_requests(args, level))
            for rep in [WARMUP] * bool(warmup) + list(range(args.repeats)):
                for name in _rotated(names, max(rep, 0)):
                    s = served[name]
                    before = scrape_metrics(s.metrics_url, MODEL)
                    t0 = time.perf_counter()
                    if rep == WARMUP:     # a fixed number of requests, from this process's streams
                        drive(s.client, warmup, level, args)
                    elif args.server_client == "perf_analyzer":
                        drive_perf_analyzer(s.client.url, level, args)
                    else:
                        drive(s.client, prompts[:n], level, args)
                    wall = time.perf_counter() - t0
                    time.sleep(0.5)        # the engine-wide counters are refreshed when it goes idle
                    after = scrape_metrics(s.metrics_url, MODEL)
                    delta = {k: after.get(k, 0) - before.get(k, 0) for k in after}
                    run = _run_record("server", name, level, rep,
                                      delta.get("nightdraft_generation_tokens_total", 0) / wall)
                    run["client"] = "python" if rep == WARMUP else args.server_client
                    # what the engine did meanwhile (the planner's arms are not exported)
                    run["engine"] = {name: delta.get(metric, 0) for name, (_, metric) in ENGINE_COUNTERS.items()}
                    record(run)


# The engine's counters recorded around each run: name -> (EngineStats attribute, read in
# process; metric family, read through the server).
ENGINE_COUNTERS = {
    "steps": ("steps", "nightdraft_engine_steps_total"),
    "psd_steps": ("psd_steps", "nightdraft_psd_steps_total"),
    "draft_tokens": ("drafted_tokens", "nightdraft_spec_decode_draft_tokens_total"),
    "accepted_tokens": ("accepted_tokens", "nightdraft_spec_decode_accepted_tokens_total"),
    "catchup_tokens": ("drafter_catchup_tokens", "nightdraft_drafter_catchup_tokens_total"),
    "planner_switches": ("planner_switches", "nightdraft_planner_switches_total"),
    "offloads": ("offloads", "nightdraft_drafter_offloads_total"),
    # what else used the cores: the drafter's worker, and recompilation
    "drafter_cpu_s": ("drafter_cpu_s", "nightdraft_drafter_cpu_seconds_total"),
    "compiled_graphs": ("compiled_graphs", "nightdraft_compiled_graphs_total"),
}


def _progress(run: dict) -> None:
    rep = "warm-up" if run.get("warmup") else run["repeat"] + 1
    print(f"  {run['path']:<10} c={run['concurrency']:>3} {run['config']:<8} [{rep}] "
          f"{run['tokens_per_s']:8.1f} tok/s", file=sys.stderr, flush=True)


def summarise(runs: list[dict]) -> list[dict]:
    """One row per path and concurrency: each configuration's median throughput (and its range),
    the best fixed configuration, and auto against it and against plain decoding on every core.
    Warm-up runs are left out of the figures; auto's arms in its warm-up are reported apart."""
    warmups, runs = [r for r in runs if r.get("warmup")], [r for r in runs if not r.get("warmup")]
    rows = []
    for path in dict.fromkeys(r["path"] for r in runs):
        for level in dict.fromkeys(r["concurrency"] for r in runs if r["path"] == path):
            mine = [r for r in runs if r["path"] == path and r["concurrency"] == level]
            tok = {}
            spread = {}
            for name in dict.fromkeys(r["config"] for r in mine):
                vals = [r["tokens_per_s"] for r in mine if r["config"] == name]
                tok[name] = statistics.median(vals)
                spread[name] = [min(vals), max(vals)]
            fixed = [n for n in tok if not adaptive(n)]
            row = {"path": path, "concurrency": level, "tokens_per_s": tok, "range": spread}
            if fixed:
                best = max(fixed, key=tok.get)
                row["best_fixed"] = best
            if ADAPTIVE in tok and fixed:
                row["auto_over_best_fixed"] = tok[ADAPTIVE] / tok[best]
                row["auto_over_best_fixed_by_repeat"] = _paired(mine, best)
            if ADAPTIVE in tok and "ar-2dev" in tok:
                row["auto_over_ar_all_cores"] = tok[ADAPTIVE] / tok["ar-2dev"]
            variants = {n: _variant_row(mine, n, tok, best if fixed else None)
                        for n in tok if adaptive(n) and n != ADAPTIVE}
            if variants:
                row["variants"] = variants
            shares = arm_shares([r for r in mine if r["config"] == ADAPTIVE])
            if shares:
                row["auto_arm_shares"] = shares
            warm = {r["config"]: r for r in warmups if r["path"] == path and r["concurrency"] == level}
            if ADAPTIVE in warm and fixed and best in warm:    # the first pass at this load
                row["warmup_auto_over_best_fixed"] = warm[ADAPTIVE]["tokens_per_s"] / warm[best]["tokens_per_s"]
            shares = arm_shares([warm[ADAPTIVE]] if ADAPTIVE in warm else [])
            if shares:
                row["auto_warmup_arm_shares"] = shares
            rows.append(row)
    return rows


def adaptive(name: str) -> bool:
    """Mode auto, as it ships or with planner settings of its own (never a fixed configuration)."""
    return name == ADAPTIVE or planner_variant(name) is not None


def _paired(runs: list[dict], best: str, name: str = ADAPTIVE) -> list[float]:
    """`name` / `best` within each repeat (the two ran minutes apart, not hours)."""
    by = {(r["config"], r["repeat"]): r["tokens_per_s"] for r in runs}
    return [by[(name, k)] / by[(best, k)] for (c, k) in by if c == name and (best, k) in by]


def _variant_row(runs: list[dict], name: str, tok: dict, best: str | None) -> dict:
    """A planner variant against auto, repeat by repeat, and against the best fixed configuration."""
    row: dict = {"arm_shares": arm_shares([r for r in runs if r["config"] == name])}
    if ADAPTIVE in tok:
        by_repeat = _paired(runs, ADAPTIVE, name)
        row["over_auto_by_repeat"] = by_repeat
        row["over_auto"] = statistics.median(by_repeat) if by_repeat else None
    if best is not None:
        row["over_best_fixed"] = tok[name] / tok[best]
    return row


def format_table(rows: list[dict]) -> str:
    names = list(dict.fromkeys(n for r in rows for n in r["tokens_per_s"]))
    head = (f"{'path':<10} {'conc':>4} " + " ".join(f"{n:>8}" for n in names)
            + f" {'best fixed':>10} {'auto/best':>9} {'auto/ar2':>8}")
    lines = ["tokens/s (median over repeats)", head, "-" * len(head)]
    for r in rows:
        cells = " ".join(f"{r['tokens_per_s'][n]:8.1f}" if n in r["tokens_per_s"] else f"{'-':>8}" for n in names)
        ratio = lambda k: f"{r[k]:.2f}" if k in r else "-"
        lines.append(f"{r['path']:<10} {r['concurrency']:>4} {cells} {r.get('best_fixed', '-'):>10} "
                     f"{ratio('auto_over_best_fixed'):>9} {ratio('auto_over_ar_all_cores'):>8}"
                     + (f"  auto played {_top_arms(r['auto_arm_shares'])}" if "auto_arm_shares" in r else "")
                     + (f"  (warm-up: auto/best {r['warmup_auto_over_best_fixed']:.2f}"
                        + (f", played {_top_arms(r['auto_warmup_arm_shares'])}" if "auto_warmup_arm_shares" in r else "")
                        + ")" if "warmup_auto_over_best_fixed" in r else ""))
        for name, v in r.get("variants", {}).items():
            over_auto = (f"/ auto {v['over_auto']:.3f} (by repeat "
                         + " ".join(f"{x:.3f}" for x in v["over_auto_by_repeat"]) + ")"
                         if v.get("over_auto") is not None else "")
            lines.append(f"{'':<16}{name}: {over_auto}"
                         + (f", / best fixed {v['over_best_fixed']:.2f}" if "over_best_fixed" in v else "")
                         + (f", played {_top_arms(v['arm_shares'])}" if v["arm_shares"] else ""))
    return "\n".join(lines)


def _top_arms(shares: dict[str, float], n: int = 3) -> str:
    return " ".join(f"{arm}:{share:.0%}" for arm, share in list(shares.items())[:n])


def draw(rows: list[dict], path: str) -> None:
    plt = pyplot()
    if plt is None:
        return
    paths = list(dict.fromkeys(r["path"] for r in rows))
    fig, axes = plt.subplots(1, len(paths), figsize=(5.5 * len(paths), 4), squeeze=False)
    for ax, where in zip(axes[0], paths):
        rs = [r for r in rows if r["path"] == where]
        xs = [r["concurrency"] for r in rs]
        for name in dict.fromkeys(n for r in rs for n in r["tokens_per_s"]):
            ax.plot(xs, [r["tokens_per_s"].get(name) for r in rs], marker="o", label=name,
                    lw=2.5 if adaptive(name) else 1.2)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency")
        ax.set_ylabel("tokens/s")
        ax.set_title(f"{where}: auto beside the fixed modes")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
