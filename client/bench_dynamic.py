"""`nightdraft bench dynamic`: a load that changes, and who copes with it.

Poisson arrivals in phases low -> high -> low, with rates set from the machine's measured
capacity and a tight KV budget, so that the high phase queues and memory pressure is real. The
same arrival schedule (same seed) is replayed, in real time, against each configuration:

  ar                   plain decoding
  sd                   sequential SD, fixed gamma
  psd                  batch-parallel SD, fixed gamma
  adaptive             mode "auto": the planner picks mode and gamma, and may offload the drafter
  adaptive_no_offload  the same planner, never offloading

Placement is the same for all: the target runs one thread on its core; wherever there is a
drafter it runs in its worker on the other core (on a CPU host the two share one RAM budget, so
an offloaded drafter's bytes go to the target's KV pool).

Per phase and overall: throughput, TTFT, TPOT, end-to-end latency (mean, p99); the planner's
gamma/mode timeline, offload events and switches; and its regret against the best fixed
configuration of each phase.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .bench_offline import DEFAULT_DRAFTER, DEFAULT_TARGET
from .prompts import load_prompts

CONFIGS = ("ar", "sd", "psd", "adaptive", "adaptive_no_offload")
PHASES = (("low", 0.25, 1.0), ("high", 1.6, 1.5), ("low", 0.25, 1.0))   # name, rate x capacity, length x base


def add_dynamic_parser(bench_sub) -> None:
    p = bench_sub.add_parser("dynamic", help="low -> high -> low Poisson load: fixed vs adaptive")
    p.add_argument("--target", default=str(DEFAULT_TARGET))
    p.add_argument("--drafter", default=str(DEFAULT_DRAFTER))
    p.add_argument("--prompts", default=None, help="file with one JSON string per line")
    p.add_argument("--json", default="bench-dynamic.json")
    p.add_argument("--plot", default=None, help="PNG path (default: next to --json)")
    p.add_argument("--scale", type=float, default=1.0,
                   help="multiplies every phase's length (base 20 s); 0.25 runs the whole "
                        "comparison in a few minutes")
    p.add_argument("--capacity", type=float, default=None,
                   help="requests/s the machine sustains (default: measured first)")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--gamma", type=int, default=3, help="gamma of the fixed sd and psd configs")
    p.add_argument("--kv-blocks", type=int, default=96,
                   help="target KV pool in blocks of 16 tokens (tight, so the high phase queues)")
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=run_dynamic_cli)


@dataclass
class Arrival:
    t: float
    phase: int
    prompt: str


@dataclass
class Record:
    phase: int
    arrival: float
    first_token: float | None = None
    finish: float | None = None
    tokens: int = 0


@dataclass
class RunResult:
    records: list[Record]
    phase_tokens: list[int]
    phase_bounds: list[tuple[float, float]]
    timeline: list[dict] = field(default_factory=list)
    events: list[dict] = field(default_factory=list)


def schedule(prompts: list[str], capacity: float, scale: float, seed: int) -> tuple[list[Arrival], list[tuple[float, float]]]:
    rng = random.Random(seed)
    arrivals, bounds, t0 = [], [], 0.0
    for i, (_, rate_x, length_x) in enumerate(PHASES):
        length = 20.0 * length_x * scale
        rate = rate_x * capacity
        t = t0
        while True:
            t += rng.expovariate(rate)
            if t >= t0 + length:
                break
            arrivals.append(Arrival(t, i, prompts[len(arrivals) % len(prompts)]))
        bounds.append((t0, t0 + length))
        t0 += length
    return arrivals, bounds


def make_engine(name: str, args):
    from backend.engine import Engine
    from backend.engine_config import EngineConfig
    from backend.kv_cache import PagedKVCache
    from backend.model_config import ModelConfig

    block = PagedKVCache.bytes_per_block(ModelConfig.from_pretrained(args.target), 16, torch.float32)
    common = dict(target=args.target, kv_cache_bytes=args.kv_blocks * block, max_num_seqs=64,
                  seed=args.seed, gamma_max=max(4, args.gamma))
    if name == "ar":
        return Engine(EngineConfig(**common))
    if name in ("sd", "psd"):
        return Engine(EngineConfig(**common, drafter=args.drafter, mode=name, gamma=args.gamma,
                                   drafter_device="cpu"))
    if name in ("adaptive", "adaptive_no_offload"):
        return Engine(EngineConfig(**common, drafter=args.drafter, mode="auto", drafter_device="cpu",
                                   offload=(name == "adaptive")))
    raise ValueError(f"unknown config {name!r}; choose from {CONFIGS}")


def measure_capacity(args, prompts: list[str]) -> float:
    """Requests/s plain decoding sustains with 16 in flight (a quick closed-loop probe)."""
    from backend.sampling_params import SamplingParams
    engine = make_engine("ar", args)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, ignore_eos=True)
    t0 = time.perf_counter()
    engine.generate(prompts[:32], params, max_concurrency=16)
    return 32 / (time.perf_counter() - t0)


def replay(engine, arrivals: list[Arrival], bounds, args) -> RunResult:
    """Real time: each request is added when its arrival time comes; the engine steps meanwhile."""
    from backend.sampling_params import SamplingParams
    records: list[Record] = []
    phase_tokens = [0] * len(bounds)
    timeline, last_mode = [], None
    start = time.perf_counter()
    nxt = 0
    while nxt < len(arrivals) or engine.has_unfinished():
        now = time.perf_counter() - start
        while nxt < len(arrivals) and arrivals[nxt].t <= now:
            a = arrivals[nxt]
            params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                                    ignore_eos=True, seed=args.seed + nxt)
            engine.add_request(str(nxt), a.prompt, params)
            records.append(Record(a.phase, start + a.t))
            nxt += 1
        if not engine.has_unfinished():
            time.sleep(max(0.0, min(arrivals[nxt].t - now, 0.05)) if nxt < len(arrivals) else 0)
            continue
        outs = engine.step()
        t = time.perf_counter()
        phase = _phase_at(t - start, bounds)
        for o in outs:
            r = records[int(o.request_id)]
            if o.new_token_ids:
                r.tokens += len(o.new_token_ids)
                phase_tokens[phase] += len(o.new_token_ids)
                r.first_token = r.first_token or t
            if o.finished:
                r.finish = t
        st = engine.stats()
        mode = (st.last_step.mode, st.gamma if st.last_step.mode != "ar" else 0, st.drafter_state)
        if mode != last_mode:
            timeline.append({"t": t - start, "mode": mode[0], "gamma": mode[1], "drafter": mode[2],
                             "running": st.num_running, "waiting": st.num_waiting})
            last_mode = mode
    events = []
    if getattr(engine, "memory", None) is not None:
        events = [{"t": e.t - start, "kind": e.kind, "target_kv_blocks": e.target_kv_blocks,
                   "seconds": e.seconds} for e in engine.memory.events]
    return RunResult(records, phase_tokens, bounds, timeline, events)


def _phase_at(t: float, bounds) -> int:
    for i, (_, hi) in enumerate(bounds):
        if t < hi:
            return i
    return len(bounds) - 1


def metrics(records: list[Record], tokens: int, seconds: float) -> dict:
    done = [r for r in records if r.finish is not None]
    ttft = [r.first_token - r.arrival for r in done if r.first_token]
    e2e = [r.finish - r.arrival for r in done]
    tpot = [(r.finish - r.first_token) / (r.tokens - 1) for r in done if r.first_token and r.tokens > 1]
    return {"requests": len(done), "throughput_tok_s": tokens / seconds if seconds else 0.0,
            "ttft_mean_s": _mean(ttft), "ttft_p99_s": _p99(ttft), "tpot_mean_s": _mean(tpot),
            "e2e_mean_s": _mean(e2e), "e2e_p99_s": _p99(e2e)}


def _mean(xs):
    return statistics.fmean(xs) if xs else 0.0


def _p99(xs):
    return sorted(xs)[int(0.99 * (len(xs) - 1))] if xs else 0.0


def summarise(run: RunResult) -> dict:
    phases = []
    for i, (lo, hi) in enumerate(run.phase_bounds):
        phases.append(metrics([r for r in run.records if r.phase == i], run.phase_tokens[i], hi - lo))
    ends = [r.finish for r in run.records if r.finish]
    span = (max(ends) - min(r.arrival for r in run.records)) if ends else 1.0
    return {"phases": phases, "overall": metrics(run.records, sum(run.phase_tokens), span)}


def run_dynamic_cli(args) -> int:
    names = [n.strip() for n in args.configs.split(",") if n.strip()]
    prompts = load_prompts(args.prompts)
    cores = sorted(os.sched_getaffinity(0))
    target_cores = cores[:-1] or cores

    def place_target() -> None:        # engines with a worker pin us; start each run alike
        os.sched_setaffinity(0, target_cores)
        torch.set_num_threads(len(target_cores))

    place_target()
    capacity = args.capacity or measure_capacity(args, prompts)
    arrivals, bounds = schedule(prompts, capacity, args.scale, args.seed)
    print(f"capacity ~{capacity:.2f} req/s; {len(arrivals)} requests over {bounds[-1][1]:.0f}s "
          f"in phases {[p[0] for p in PHASES]}", file=sys.stderr)
    configs, planner_info = {}, {}
    for name in names:
        print(f"  {name} ...", file=sys.stderr)
        os.sched_setaffinity(0, cores)     # the worker picks its core from the full set
        engine = make_engine(name, args)
        place_target()
        try:
            run = replay(engine, arrivals, bounds, args)
        finally:
            engine.close()
        configs[name] = summarise(run)
        configs[name]["timeline"] = run.timeline
        if name == "adaptive" or (name.startswith("adaptive") and not planner_info):
            ps = engine.planner.stats()
            planner_info = {"config": name, "switches": ps.get("switches", 0),
                            "offloads": sum(e["kind"] == "offload" for e in run.events),
                            "reloads": sum(e["kind"] == "reload_done" for e in run.events),
                            "events": run.events, "timeline": run.timeline,
                            "arm_counts": {str(k): v for k, v in ps.get("arm_counts", {}).items()}}
    report = {"capacity_req_s": capacity, "scale": args.scale, "kv_blocks": args.kv_blocks,
              "phases": [{"name": n, "rate_req_s": x * capacity, "start_s": lo, "end_s": hi}
                         for (n, x, _), (lo, hi) in zip(PHASES, bounds)],
              "configs": configs, "planner": planner_info,
              "regret": regret(configs, len(bounds))}
    Path(args.json).write_text(json.dumps(report, indent=1))
    print(format_table(report))
    plot = args.plot or str(Path(args.json).with_suffix(".png"))
    draw(report, plot)
    print(f"wrote {args.json} and {plot}", file=sys.stderr)
    return 0


def regret(configs: dict, n_phases: int) -> dict:
    """Per phase: adaptive's throughput and e2e latency relative to the best fixed config."""
    fixed = [n for n in ("ar", "sd", "psd") if n in configs]
    out = {}
    for name in ("adaptive", "adaptive_no_offload"):
        if name not in configs or not fixed:
            continue
        rows = []
        for i in range(n_phases):
            best_tp = max(fixed, key=lambda n: configs[n]["phases"][i]["throughput_tok_s"])
            best_e2e = min(fixed, key=lambda n: configs[n]["phases"][i]["e2e_mean_s"] or 1e9)
            a = configs[name]["phases"][i]
            rows.append({"best_fixed_throughput": best_tp,
                         "throughput_ratio": a["throughput_tok_s"] / configs[best_tp]["phases"][i]["throughput_tok_s"],
                         "best_fixed_e2e": best_e2e,
                         "e2e_ratio": (a["e2e_mean_s"] / configs[best_e2e]["phases"][i]["e2e_mean_s"]
                                       if configs[best_e2e]["phases"][i]["e2e_mean_s"] else None)})
        out[name] = rows
    return out


def format_table(report: dict) -> str:
    head = (f"{'config':<20} {'phase':<8} {'tok/s':>8} {'ttft':>7} {'ttft99':>7} {'tpot':>7} "
            f"{'e2e':>7} {'e2e99':>7}")
    lines = [head, "-" * len(head)]
    names = [p["name"] for p in report["phases"]] + ["overall"]
    for cfg, res in report["configs"].items():
        for name, m in zip(names, res["phases"] + [res["overall"]]):
            lines.append(f"{cfg:<20} {name:<8} {m['throughput_tok_s']:8.1f} {m['ttft_mean_s']:7.3f} "
                         f"{m['ttft_p99_s']:7.3f} {m['tpot_mean_s']:7.4f} {m['e2e_mean_s']:7.3f} "
                         f"{m['e2e_p99_s']:7.3f}")
    p = report.get("planner") or {}
    if p:
        lines.append(f"planner ({p['config']}): {p['switches']} switches, {p['offloads']} offloads, "
                     f"{p['reloads']} reloads")
    for name, rows in report.get("regret", {}).items():
        lines.append(f"{name} vs best fixed per phase: " + ", ".join(
            f"tok/s x{r['throughput_ratio']:.2f} (vs {r['best_fixed_throughput']})" for r in rows))
    return "\n".join(lines)


def draw(report: dict, path: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed; no plot", file=sys.stderr)
        return
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
    for name in ("adaptive", "adaptive_no_offload"):
        tl = report["configs"].get(name, {}).get("timeline", [])
        if tl:
            xs = [e["t"] for e in tl]
            ax1.step(xs, [e["gamma"] if e["mode"] != "psd" else -e["gamma"] for e in tl], where="post",
                     label=f"{name}: gamma (negative = psd)")
    for e in (report.get("planner") or {}).get("events", []):
        ax1.axvline(e["t"], color={"offload": "red", "reload_start": "orange"}.get(e["kind"], "green"),
                    ls=":", lw=1)
    for ph in report["phases"]:
        ax1.axvspan(ph["start_s"], ph["end_s"], alpha=0.06 if ph["name"] == "low" else 0.15, color="grey")
    ax1.set_ylabel("gamma")
    ax1.set_title("planner decisions (dotted: red offload, orange reload start, green reload done)")
    ax1.legend(fontsize=7)
    names = list(report["configs"])
    width = 0.8 / max(len(names), 1)
    for k, name in enumerate(names):
        phases = report["configs"][name]["phases"]
        xs = [(ph["start_s"] + ph["end_s"]) / 2 + (k - len(names) / 2) * width * 4 for ph in report["phases"]]
        ax2.bar(xs, [p["throughput_tok_s"] for p in phases], width=width * 4, label=name)
    ax2.set_ylabel("tokens/s")
    ax2.set_xlabel("seconds")
    ax2.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
