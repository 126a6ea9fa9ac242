"""`nightdraft bench profile`: every engine step beside its floor, phase by phase.

For each configuration (mode x concurrency; the pair and gamma given once) it runs steady decoding
and splits each decode step into schedule, draft (in line; with a worker, the worker's time and
its transport), metadata, target forward, verify (sampling and acceptance) and commit
(detokenize, stop rules, outputs); beside it stand the floors measured in the same run: the
target forward's matmuls at the step's shapes and the drafter's (:mod:`backend.model.floor`).
Through the server (``--server``) the same load runs through a real tritonserver and the split
comes from the model's step-phase counters, plus what the adapter spends building and sending
responses.

Configurations:

  ar    plain decoding, target on one core
  sd    sequential SD, the drafter in process (drafts in line)
  psd   batch-parallel SD, the drafter in its worker on its own core

Writes JSON, prints a table and draws a stacked-bar plot (PNG next to the JSON).
"""
from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

from backend.mode import Mode
from client.bench_offline import add_engine_args, executor_args
from client.prompts import load_prompts
from client.plotting import pyplot

PHASES = ("schedule", "draft", "prepare", "forward", "verify", "commit", "other")
CONFIGS = tuple(m.value for m in (Mode.AR, Mode.SD, Mode.PSD))     # each configuration runs one mode


def add_profile_parser(bench_sub) -> None:
    p = bench_sub.add_parser("profile", help="each step split into phases beside its matmul floor")
    add_engine_args(p)
    p.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated: ar, sd, psd")
    p.add_argument("--gamma", type=int, default=4)
    p.add_argument("--concurrency", default="1,4,16,32,64", help="comma-separated levels")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--requests-per-level", type=float, default=2.0,
                   help="requests per run = this x concurrency (at least 4)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--server", action="store_true", help="also through a real tritonserver")
    p.add_argument("--server-client", choices=("python", "perf_analyzer"), default="python",
                   help="what drives the server: gRPC streams from this process, or perf_analyzer (C++)")
    p.add_argument("--pa-window-s", type=float, default=8.0,
                   help="perf_analyzer: seconds per measurement window (it runs three)")
    p.add_argument("--json", default="bench-profile.json")
    p.add_argument("--plot", default=None, help="PNG path (default: next to --json)")
    p.set_defaults(func=run_profile_cli)


# ---- one configuration -------------------------------------------------------------------------

def build(args, name: str):
    from backend.engine.config import EngineConfig
    from backend.engine.engine import Engine

    common = dict(target=args.target, device=args.device, dtype=args.dtype, kv_cache_bytes=args.kv_cache_mb << 20,
                  max_num_seqs=128, num_threads=args.threads or 1, seed=0, **executor_args(args))
    mode = Mode.parse(name, (Mode.AR, Mode.SD, Mode.PSD), what="configuration")
    if mode is Mode.AR:
        return Engine(EngineConfig(**common, mode=mode))
    return Engine(EngineConfig(**common, mode=mode, drafter=args.drafter, gamma=args.gamma,
                               drafter_device="cpu" if mode is Mode.PSD else None))


def steady_steps(engine, name: str, prompts: list[str], conc: int, args) -> tuple[list, float, int]:
    """Run `prompts` at concurrency `conc`; the decode steps that ran at full concurrency (no
    prefill), the wall time and the tokens made."""
    from backend.sampling.params import SamplingParams

    params = [SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, ignore_eos=True,
                             seed=None if args.temperature == 0 else i) for i in range(len(prompts))]
    full = conc if name != Mode.PSD or conc < 2 else (conc + 1) // 2   # psd verifies half
    steps = []

    def on_step(_outs):
        s = engine.stats().last_step
        if s.num_prefill_tokens == 0 and s.batch_size >= max(1, int(0.9 * full)) and \
                len(engine.scheduler.running) >= int(0.9 * conc):
            steps.append(s)
    engine.generate(prompts[:min(conc, 4)], params[:min(conc, 4)])     # warm-up
    t0 = time.perf_counter()
    out = engine.generate(prompts, params, on_step=on_step, max_concurrency=conc)
    return steps, time.perf_counter() - t0, sum(len(c.output_ids) for c in out)


def phase_split(steps: list) -> dict[str, float]:
    """Median seconds of each phase over the steps (other = what no phase names)."""
    def med(f):
        return statistics.median(f(s) for s in steps)
    split = {"schedule": med(lambda s: s.t_schedule_s),
             "draft": med(lambda s: s.t_draft_s if s.mode is not Mode.PSD else s.t_transport_s),
             "prepare": med(lambda s: s.t_prepare_s), "forward": med(lambda s: s.t_forward_s),
             "verify": med(lambda s: s.t_decide_s), "commit": med(lambda s: s.t_commit_s)}
    step = med(lambda s: s.t_step_s)
    split["other"] = max(0.0, step - sum(split.values()))
    return split | {"step": step}


class Floors:
    """Floors of the target's and the drafter's forwards: their matmuls at the forward's rows
    (measured once per shape), and one read of the K/V they attend at the copy bandwidth
    measured in the same run for a buffer of that size."""

    def __init__(self, target, drafter_path: str | None, dtype):
        from backend.model.loader import load_model
        self.target = target
        self.drafter = load_model(drafter_path, device="cpu", dtype=dtype) if drafter_path else None
        self._memo: dict = {}

    def _model(self, which: str):
        return self.target if which == "target" else self.drafter

    def __call__(self, which: str, rows: int) -> float:
        from backend.model.floor import forward_floor
        key = (which, rows)
        if key not in self._memo:
            self._memo[key] = forward_floor(self._model(which), rows)
        return self._memo[key]

    def kv(self, which: str, context_tokens: int) -> float:
        from backend.model.floor import copy_bandwidth, kv_bytes_per_token, kv_read_floor
        model = self._model(which)
        key = ("kv", which, context_tokens)
        if key not in self._memo:
            bandwidth = copy_bandwidth(context_tokens * kv_bytes_per_token(model))
            self._memo[key] = kv_read_floor(model, context_tokens, bandwidth)
        return self._memo[key]


def profile_config(engine, name: str, conc: int, prompts: list[str], floors: Floors, args) -> dict:
    steps, wall, tokens = steady_steps(engine, name, prompts, conc, args)
    row = {"config": name, "concurrency": conc, "tokens_per_s": tokens / wall, "steady_steps": len(steps)}
    if not steps:
        return row | {"note": "no steady decode steps (too few requests or tokens)"}
    split = phase_split(steps)
    batch = statistics.median(s.batch_size for s in steps)
    rows = int(statistics.median(s.num_forward_tokens for s in steps))
    context = int(statistics.median(s.num_context_tokens for s in steps))
    target_floor = floors("target", rows)
    kv_floor = floors.kv("target", context)
    row |= {"step_ms": 1e3 * split["step"], "phases_ms": {k: 1e3 * v for k, v in split.items() if k != "step"},
            "batch": batch, "forward_rows": rows, "context_tokens": context,
            "target_floor_ms": 1e3 * target_floor, "kv_floor_ms": 1e3 * kv_floor}
    g = args.gamma if name != Mode.AR else 0
    if name == Mode.AR:
        floor, full = target_floor, target_floor + kv_floor
    elif name == Mode.SD:
        # The drafter attends about the same contexts (without the drafts being verified).
        drafter_context = max(context - g * int(batch), int(batch))
        drafter_floor = floors("drafter", int(batch))
        drafter_full = drafter_floor + floors.kv("drafter", drafter_context)
        draft_step = split["draft"] / g
        row |= {"drafter_step_ms": 1e3 * draft_step, "drafter_floor_ms": 1e3 * drafter_floor,
                "drafter_full_floor_ms": 1e3 * drafter_full,
                "drafter_step_over_floor": draft_step / drafter_floor,
                "drafter_step_over_full_floor": draft_step / drafter_full}
        floor, full = target_floor + g * drafter_floor, target_floor + kv_floor + g * drafter_full
    else:   # psd: the worker drafts the other half while the target verifies
        psd = [s for s in steps if s.mode is Mode.PSD]
        if psd:
            row["overlap"] = statistics.median(s.overlap for s in psd)
            row["worker_draft_ms"] = 1e3 * statistics.median(s.t_draft_s for s in psd)
            row["verify_ms"] = 1e3 * statistics.median(s.t_verify_s for s in psd)
            drafter_floor = floors("drafter", max(1, conc - int(batch)))
            row["worker_drafter_step_over_floor"] = (row["worker_draft_ms"] / 1e3 / g) / drafter_floor
        floor, full = target_floor, target_floor + kv_floor
    row["step_over_floor"] = split["step"] / floor
    row["step_over_full_floor"] = split["step"] / full
    return row


# ---- the command ---------------------------------------------------------------------------------

def run_profile_cli(args) -> int:
    import torch

    names = [c.strip() for c in args.configs.split(",") if c.strip()]
    levels = [int(c) for c in args.concurrency.split(",") if c.strip()]
    prompts = load_prompts(None, max(4, int(max(levels) * args.requests_per_level)))
    results = []
    for name in names:
        print(f"profiling {name} ...", file=sys.stderr)
        engine = build(args, name)
        floors = Floors(engine.target, None if name == Mode.AR else args.drafter, engine.dtype)
        try:
            for conc in levels:
                n = max(4, int(conc * args.requests_per_level))
                row = profile_config(engine, name, conc, prompts[:n], floors, args)
                results.append(row)
                print(format_row(row), flush=True)
        finally:
            engine.close()
            torch.set_num_threads(args.threads or 1)
    if args.server:
        from client.profile_server import profile_on_server
        results += profile_on_server(args, names, levels, prompts, results)
    report = {"gamma": args.gamma, "max_tokens": args.max_tokens, "temperature": args.temperature,
              "threads": args.threads or 1, "target": args.target, "drafter": args.drafter, "rows": results}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(report, indent=1))
    print_table(results)
    plot = args.plot or str(Path(args.json).with_suffix(".png"))
    draw(results, plot)
    print(f"wrote {args.json} and {plot}", file=sys.stderr)
    return 0


def format_row(r: dict) -> str:
    if "step_ms" not in r:
        return f"{r['config']:>4} c={r['concurrency']:>3}: {r.get('note', '')}"
    extra = ""
    if "drafter_step_over_floor" in r:
        extra = f", drafter step {r['drafter_step_ms']:.2f} ms = {r['drafter_step_over_floor']:.1f}x its floor"
    if "overlap" in r:
        extra = f", overlap {r['overlap']:.2f}"
    where = " (server)" if r.get("server") else ""
    return (f"{r['config']:>4}{where} c={r['concurrency']:>3}: step {r['step_ms']:.2f} ms, floor "
            f"{r['target_floor_ms']:.2f} ms (+ K/V read {r.get('kv_floor_ms', 0):.2f} ms), step/floor "
            f"{r['step_over_floor']:.2f} ({_fmt(r.get('step_over_full_floor'))} with the K/V read){extra}; "
            f"{r['tokens_per_s']:.0f} tok/s")


def print_table(rows: list[dict]) -> None:
    served = [r for r in rows if r.get("server")]
    if served:
        print("\n| config | c | tok/s through tritonserver | / in-process | ms per engine step |")
        print("|---|---|---|---|---|")
        for r in served:
            print(f"| {r['config']} | {r['concurrency']} | {r['tokens_per_s']:.0f} | "
                  f"{_fmt(r.get('over_in_process'))} | {_fmt(r.get('mean_step_ms'))} |")
    print("\n| config | c | tok/s | step ms | matmul floor ms | K/V read ms | step/floor | step/(floor + K/V) | " +
          " | ".join(PHASES) + " | drafter step/floor | drafter step/(floor + K/V) | overlap |")
    print("|" + "---|" * (11 + len(PHASES)))
    for r in rows:
        if "step_ms" not in r:
            continue
        ph = r["phases_ms"]
        name = r["config"] + (" (server)" if r.get("server") else "")
        dr = r.get("drafter_step_over_floor", r.get("worker_drafter_step_over_floor"))
        print(f"| {name} | {r['concurrency']} | {r['tokens_per_s']:.0f} | {r['step_ms']:.2f} | "
              f"{r['target_floor_ms']:.2f} | {_fmt(r.get('kv_floor_ms'))} | {r['step_over_floor']:.2f} | "
              f"{_fmt(r.get('step_over_full_floor'))} | " +
              " | ".join(f"{ph.get(p, 0):.2f}" for p in PHASES) +
              f" | {_fmt(dr)} | {_fmt(r.get('drafter_step_over_full_floor'))} | {_fmt(r.get('overlap'))} |")


def _fmt(v) -> str:
    return "" if v is None else f"{v:.2f}"


def draw(rows: list[dict], path: str) -> None:
    plt = pyplot()
    if plt is None:
        return
    rows = [r for r in rows if "step_ms" in r]
    labels = [f"{r['config']}{'*' if r.get('server') else ''}\nc={r['concurrency']}" for r in rows]
    fig, ax = plt.subplots(figsize=(max(6, 0.7 * len(rows)), 4.5))
    bottom = [0.0] * len(rows)
    for phase in PHASES:
        vals = [r["phases_ms"].get(phase, 0.0) for r in rows]
        ax.bar(labels, vals, bottom=bottom, label=phase)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.scatter(labels, [r["target_floor_ms"] for r in rows], color="black", marker="_", s=400,
               label="target matmul floor", zorder=3)
    ax.set_ylabel("ms per step")
    ax.set_title("Engine step by phase beside its floor (* through tritonserver)")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
