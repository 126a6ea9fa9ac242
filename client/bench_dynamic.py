"""`nightdraft bench dynamic`: a load that changes, and who copes with it.

Poisson arrivals in phases (a load shape, ``--shape``: low -> high -> low steps, a ramp, bursty
on/off periods, or short chats and long generations mixed; `client.load_shapes`), with rates set
from the machine's measured capacity and a tight KV budget, so that the high phases queue and
memory pressure is real. The same arrival schedule (same seed) is replayed, in real time, against
each configuration:

  ar                   plain decoding, the target on one core (the core it has beside a drafter)
  ar_all_cores         plain decoding given every core (the baseline of a user without a drafter)
  sd                   sequential SD, fixed gamma
  psd                  batch-parallel SD, fixed gamma
  adaptive             mode "auto": the planner picks mode and gamma, and may offload the drafter
  adaptive_no_offload  the same planner, never offloading
  adaptive@KEY=VALUE[+KEY=VALUE]
                       adaptive (or adaptive_no_offload@...) with those planner or engine
                       settings, e.g. ``adaptive@policy_check=true``: a planner setting weighed
                       against the planner without it, on the same arrivals

Placement: the target runs one thread on its core; wherever there is a drafter it runs in its
worker on the other core; ``ar_all_cores`` instead gives plain decoding every core (one thread
per core), because the drafter's core could serve the target instead. On a CPU host the two share one RAM budget, so
an offloaded drafter's bytes (weights and KV pool) become target KV blocks.

In-process by default (the engine stepped by this process); ``--server`` sends the same schedule
through a real tritonserver over gRPC, one server per configuration (`client.dynamic_server`),
started on every core (the engine places its target and drafter there as above), with this
process's client threads free to run on any of them, as a client on the same host would.
``--repeats N`` runs every configuration N times, interleaved (the order rotates each round, so a
slow spell of a shared machine does not land on one configuration), and reports medians and the
run-to-run spread. Per phase and overall: throughput, goodput (the tokens of requests that met
both latency targets, ``--slo-ttft`` and ``--slo-tpot``, per second), TTFT and TPOT p50/p99,
end-to-end latency (mean, p99) and the time share of each mode; the planner's gamma/mode
timeline, offload events and switches; adaptive's ratios to the best fixed configuration of
each phase and to each fixed one overall (`client.dynamic_report`).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

from client import dynamic_report as report_mod
from client.bench_compare import check_variants, planner_variant, split_variant
from client.bench_offline import DEFAULT_DRAFTER, DEFAULT_TARGET
from client.dynamic_report import Record, RunResult, Targets
from client.load_shapes import SHAPES, Arrival, schedule
from client.prompts import load_prompts

CONFIGS = ("ar", "ar_all_cores", "sd", "psd", "adaptive", "adaptive_no_offload")
ADAPTIVE_BASES = ("adaptive", "adaptive_no_offload")
BASE_PHASE_S = 20.0
TIMELINE_EVERY_S = 0.25     # the timeline records every change of mode, and samples the queue


def add_dynamic_parser(bench_sub) -> None:
    p = bench_sub.add_parser("dynamic", help="changing Poisson load (steps, ramp, bursty, mixed): fixed vs adaptive",
                             description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default=str(DEFAULT_TARGET))
    p.add_argument("--drafter", default=str(DEFAULT_DRAFTER))
    p.add_argument("--prompts", default=None, help="file with one JSON string per line")
    p.add_argument("--json", default="bench-dynamic.json")
    p.add_argument("--plot", default=None, help="PNG path (default: next to --json)")
    p.add_argument("--shape", default="steps", choices=SHAPES, help="the load shape (see above)")
    p.add_argument("--scale", type=float, default=1.0,
                   help=f"multiplies every phase's length (base {BASE_PHASE_S:.0f} s; steps' high "
                        "phase 1.5x that); 0.4 runs one repeat of the steps comparison in about 4 minutes")
    p.add_argument("--repeats", type=int, default=1, help="runs per configuration, interleaved")
    p.add_argument("--server", action="store_true",
                   help="through a real tritonserver over gRPC (one server per configuration)")
    p.add_argument("--capacity", type=float, default=None,
                   help="requests/s plain decoding sustains (default: measured first, the same way "
                        "the runs go: in-process, or through the server)")
    p.add_argument("--max-tokens", type=int, default=64,
                   help="tokens per request (the mixed shape: a quarter of it and twice it)")
    p.add_argument("--slo-ttft", type=float, default=None,
                   help="goodput's TTFT target in seconds (default: the time plain decoding with 16 "
                        "in flight takes for one whole request, from the capacity probe)")
    p.add_argument("--slo-tpot", type=float, default=None,
                   help="goodput's TPOT target in seconds (default: 1.5x plain decoding's TPOT with "
                        "16 in flight, from the capacity probe)")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--gamma", type=int, default=3, help="gamma of the fixed sd and psd configs")
    p.add_argument("--gamma-max", type=int, default=4, help="the planner's largest gamma")
    p.add_argument("--kv-blocks", type=int, default=64,
                   help="target KV pool in blocks of 16 tokens (tight, so the high phase queues)")
    p.add_argument("--planner", default=None, help="planner settings for the adaptive configs (JSON)")
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=run_dynamic_cli)


def engine_config(name: str, args, cores: list[int]) -> dict:
    """The engine configuration of one benchmark configuration (also the server's engine.json);
    `cores`: the machine's, all of which ``ar_all_cores`` takes."""
    variant = planner_variant(name, ADAPTIVE_BASES)
    if variant is not None:
        cfg = engine_config(name.partition("@")[0], args, cores)
        engine_keys, planner_keys = split_variant(variant)
        return cfg | engine_keys | {"planner": cfg.get("planner", {}) | planner_keys}
    from backend.model.kv_cache import PagedKVCache
    from backend.model.config import ModelConfig

    block = PagedKVCache.bytes_per_block(ModelConfig.from_pretrained(args.target), 16, torch.float32)
    cfg = dict(target=str(Path(args.target).resolve()), kv_cache_bytes=args.kv_blocks * block,
               block_size=16, max_num_seqs=64, seed=args.seed, num_threads=1, dtype="float32",
               gamma_max=max(args.gamma_max, args.gamma))
    if name == "ar":
        return cfg | {"mode": "ar", "gamma": 0}
    if name == "ar_all_cores":
        return cfg | {"mode": "ar", "gamma": 0, "num_threads": len(cores)}
    cfg |= {"drafter": str(Path(args.drafter).resolve()), "drafter_device": "cpu"}
    if name in ("sd", "psd"):
        return cfg | {"mode": name, "gamma": args.gamma}
    if name in ADAPTIVE_BASES:
        planner = json.loads(args.planner) if args.planner else {}
        return cfg | {"mode": "auto", "gamma": args.gamma, "offload": name == "adaptive",
                      **({"planner": planner} if planner else {})}
    raise ValueError(f"unknown config {name!r}; choose from {CONFIGS} or adaptive@KEY=VALUE[+KEY=VALUE]")


def make_engine(name: str, args, cores: list[int]):
    from backend.engine.engine import Engine
    from backend.engine.config import EngineConfig
    return Engine(EngineConfig(**engine_config(name, args, cores)))


def measure_capacity(args, prompts: list[str], cores: list[int]) -> float:
    """Requests/s plain decoding sustains with 16 in flight (a quick closed-loop probe)."""
    from backend.sampling.params import SamplingParams
    engine = make_engine("ar", args, cores)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, ignore_eos=True)
    engine.generate(prompts[:4], params)
    t0 = time.perf_counter()
    engine.generate(prompts[:32], params, max_concurrency=16)
    return 32 / (time.perf_counter() - t0)


def replay(engine, arrivals: list[Arrival], bounds, args) -> RunResult:
    """Real time: each request is added when its arrival time comes; the engine steps meanwhile."""
    from backend.errors import ServerBusy
    from backend.sampling.params import SamplingParams
    records = [Record(a.phase, a.t) for a in arrivals]
    timeline, last_state = [], None
    start = time.perf_counter()
    nxt = 0
    while nxt < len(arrivals) or engine.has_unfinished():
        now = time.perf_counter() - start
        while nxt < len(arrivals) and arrivals[nxt].t <= now:
            params = SamplingParams(max_tokens=arrivals[nxt].max_tokens, temperature=args.temperature,
                                    ignore_eos=True, seed=args.seed + nxt)
            try:
                engine.add_request(str(nxt), arrivals[nxt].prompt, params)
            except ServerBusy as e:      # the queue is full: refused, as the server would refuse it
                records[nxt].error = str(e)
            nxt += 1
        if not engine.has_unfinished():
            time.sleep(max(0.0, min(arrivals[nxt].t - now, 0.05)) if nxt < len(arrivals) else 0)
            continue
        outs = engine.step()
        t = time.perf_counter() - start
        for o in outs:
            r = records[int(o.request_id)]
            if o.new_token_ids:
                r.tokens += len(o.new_token_ids)
                if r.first_token is None:
                    r.first_token = t
            if o.finished:
                r.finish = t
        st = engine.stats()
        mode = st.last_step.mode                      # what the last step ran
        state = (mode.value, st.gamma if mode.speculative else 0, st.drafter_state, st.kv_total_blocks)
        if state != last_state or t - timeline[-1]["t"] >= TIMELINE_EVERY_S:
            timeline.append({"t": t, "mode": state[0], "gamma": state[1], "drafter": state[2],
                             "kv_blocks": state[3], "running": st.num_running, "waiting": st.num_waiting})
            last_state = state
    events = []
    if getattr(engine, "memory", None) is not None:
        events = [{"t": e.t - start, "kind": e.kind, "target_kv_blocks": e.target_kv_blocks,
                   "seconds": e.seconds} for e in engine.memory.events]
    run = RunResult(records, list(bounds), timeline, events)
    if engine.planner is not None:
        run.planner_summary = engine.planner.summary()
        run.switches = run.planner_summary["switches"]
        run.arm_counts = run.planner_summary["arm_counts"]
    return run


def _planner_line(run: RunResult) -> str:
    """Switches and offloads of an adaptive run, with what each memory-aware offload promised."""
    ps = run.planner_summary
    if not ps:
        return ""
    offloads = sum(e["kind"] == "offload" for e in run.events)
    claims = ", ".join(f"x{c['predicted_gain']:.2f} promised"
                       + (f", x{c['baseline_s_per_token'] / c['delivered_s_per_token']:.2f} delivered"
                          if c.get("delivered_s_per_token") else "")
                       for c in ps.get("memory", {}).get("offload_claims", []))
    return f"; {ps.get('switches', 0)} switches, {offloads} offloads" + (f" ({claims})" if claims else "")


def run_one(name: str, arrivals, bounds, args, cores: list[int]) -> RunResult:
    if args.server:      # the server gets every core, whatever this thread's affinity
        from client.dynamic_server import replay_on_server
        return replay_on_server(engine_config(name, args, cores), arrivals, bounds, args, cores=cores)
    os.sched_setaffinity(0, cores)     # the drafter worker picks its core from the full set
    engine = make_engine(name, args, cores)
    if name == "ar_all_cores":
        torch.set_num_threads(len(cores))
    else:
        _place_target(cores)
    try:
        return replay(engine, arrivals, bounds, args)
    finally:
        engine.close()


def _place_target(cores: list[int]) -> None:
    """Every configuration's target gets the same core and one thread (engines with a worker
    have pinned themselves like this already)."""
    os.sched_setaffinity(0, cores[:-1] or cores)
    torch.set_num_threads(1)


def default_targets(capacity_req_s: float, args) -> Targets:
    """Goodput's targets: given, or from the capacity probe (16 requests in flight): TTFT within
    the time one whole request takes there, TPOT within 1.5x that request's per-token time."""
    request_s = 16.0 / capacity_req_s
    return Targets(ttft_s=args.slo_ttft if args.slo_ttft is not None else request_s,
                   tpot_s=args.slo_tpot if args.slo_tpot is not None else 1.5 * request_s / args.max_tokens)


def run_dynamic_cli(args) -> int:
    names = [n.strip() for n in args.configs.split(",") if n.strip()]
    unknown = [n for n in names if n not in CONFIGS and planner_variant(n, ADAPTIVE_BASES) is None]
    if unknown:
        raise ValueError(f"unknown config(s) {unknown}; choose from {CONFIGS} or adaptive@KEY=VALUE[+KEY=VALUE]")
    if args.repeats < 1:
        raise ValueError("--repeats must be >= 1")
    if args.planner:
        json.loads(args.planner)       # fail now, not after the first runs
    check_variants(names, lambda n: engine_config(n, args, [0]), ADAPTIVE_BASES)
    prompts = load_prompts(args.prompts)
    cores = sorted(os.sched_getaffinity(0))
    if not args.server:
        _place_target(cores)     # this thread runs the engines; through a server it is a client
    if args.capacity:
        capacity = args.capacity
    elif args.server:         # the server has costs of its own (gRPC, the Python backend)
        from client.dynamic_server import measure_capacity_on_server
        capacity = measure_capacity_on_server(engine_config("ar", args, cores), prompts, args, cores)
    else:
        capacity = measure_capacity(args, prompts, cores)
    arrivals, bounds, plan = schedule(args.shape, prompts, capacity, args.max_tokens,
                                      BASE_PHASE_S * args.scale, args.seed)
    targets = default_targets(capacity, args)
    where = "through tritonserver (gRPC)" if args.server else "in-process"
    print(f"capacity ~{capacity:.2f} req/s; {len(arrivals)} requests over {bounds[-1][1]:.0f} s, "
          f"shape {args.shape} {[p.name for p in plan]}; goodput targets TTFT <= {targets.ttft_s:.3f} s, "
          f"TPOT <= {targets.tpot_s:.4f} s; {len(names)} configs x {args.repeats} repeats, {where}",
          file=sys.stderr)
    runs: dict[str, list[RunResult]] = {n: [] for n in names}
    for rep in range(args.repeats):
        order = names[rep % len(names):] + names[:rep % len(names)]
        for name in order:
            t0 = time.perf_counter()
            run = run_one(name, arrivals, bounds, args, cores)
            runs[name].append(run)
            s = report_mod.summarise(run, targets)["overall"]
            print(f"  [{rep + 1}/{args.repeats}] {name:<20} {time.perf_counter() - t0:5.1f} s: "
                  f"{s['throughput_tok_s']:.0f} tok/s, goodput {s['goodput_tok_s']:.0f}, "
                  f"TTFT {s['ttft_mean_s']:.3f} s, "
                  f"e2e {s['e2e_mean_s']:.3f} s" + (f", {s['failed']} failed" if s["failed"] else "")
                  + _planner_line(run), file=sys.stderr)
    os.sched_setaffinity(0, cores)

    summaries = {n: [report_mod.summarise(r, targets) for r in rs] for n, rs in runs.items()}
    configs = {}
    for n in names:
        configs[n] = report_mod.median_summary(summaries[n])
        configs[n]["runs"] = summaries[n]
        configs[n]["timeline"] = runs[n][0].timeline
        if n.startswith("adaptive"):
            configs[n]["switches"] = [r.switches for r in runs[n]]
            configs[n]["offloads"] = [sum(e["kind"] == "offload" for e in r.events) for r in runs[n]]
            configs[n]["planner_summaries"] = [r.planner_summary for r in runs[n]]
    planner_info = {}
    for n in ("adaptive", "adaptive_no_offload"):
        if n in runs:
            first = runs[n][0]
            planner_info = {"config": n, "switches": first.switches,
                            "offloads": sum(e["kind"] == "offload" for e in first.events),
                            "reloads": sum(e["kind"] == "reload_done" for e in first.events),
                            "events": first.events, "timeline": first.timeline,
                            "arm_counts": first.arm_counts,
                            "offload_weighings": [((r.planner_summary or {}).get("memory") or {})
                                                  .get("offload_weighings", []) for r in runs[n]]}
            break
    report = {"where": "server" if args.server else "in-process", "shape": args.shape,
              "capacity_req_s": capacity, "scale": args.scale, "repeats": args.repeats,
              "kv_blocks": args.kv_blocks, "max_tokens": args.max_tokens,
              "temperature": args.temperature, "gamma": args.gamma,
              "targets": {"ttft_s": targets.ttft_s, "tpot_s": targets.tpot_s},
              "phases": [{"name": ph.name, "demand_x_capacity": ph.rate_x, "start_s": lo, "end_s": hi,
                          "requests": sum(a.phase == i for a in arrivals),
                          "tokens_asked": sum(a.max_tokens for a in arrivals if a.phase == i)}
                         for i, (ph, (lo, hi)) in enumerate(zip(plan, bounds))],
              "configs": configs, "planner": planner_info,
              "noise": report_mod.noise(summaries),
              "regret": report_mod.regret(configs, len(bounds))}
    report["goals"] = report_mod.goals(report)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(report, indent=1))
    print(report_mod.format_table(report))
    plot = args.plot or str(Path(args.json).with_suffix(".png"))
    report_mod.draw(report, plot)
    print(f"wrote {args.json} and {plot}", file=sys.stderr)
    return 0
