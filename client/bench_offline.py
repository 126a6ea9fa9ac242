"""`nightdraft bench offline`: the engine in-process on held-out prompts, one mode at a time."""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from backend.mode import CONFIGURED_MODES, Mode
from client.prompts import REPO, load_prompts

DEFAULT_TARGET = REPO / "models" / "tiny-target"
DEFAULT_DRAFTER = REPO / "models" / "tiny-drafter"


def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default=str(DEFAULT_TARGET), help="target checkpoint directory")
    p.add_argument("--drafter", default=str(DEFAULT_DRAFTER), help="drafter checkpoint directory")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="auto: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--kv-cache-mb", type=int, default=256, help="target KV cache budget (MiB)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--attention", default="auto", choices=["auto", "paged", "sdpa"],
                   help="attention backend (EngineConfig.attention)")
    p.add_argument("--compile", default=None, choices=["auto", "on", "off"],
                   help="captured steps (EngineConfig.compile; default: $NIGHTDRAFT_COMPILE or auto)")


def executor_args(args) -> dict:
    """The engine configuration's executor keys the command line set (attention, compile)."""
    out = {"attention": getattr(args, "attention", "auto")}
    if getattr(args, "compile", None) is not None:
        out["compile"] = args.compile
    return out


def add_offline_parser(bench_sub) -> None:
    p = bench_sub.add_parser("offline", help="run the engine in-process on held-out prompts")
    add_engine_args(p)
    p.add_argument("--mode", default=Mode.SD, type=Mode, choices=CONFIGURED_MODES)
    p.add_argument("--drafter-device", default=None,
                   help="run the drafter in a worker on its own device: cpu, cpu:CORES or cuda:N "
                        "(psd needs one; default for psd: cpu)")
    p.add_argument("--gamma", type=int, default=4)
    p.add_argument("--prompts", default=None, help='file with one JSON string per line, or a bundled set: "heldout" (default), "edit", "prose"')
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--planner-cost-profile", default="calibrate",
                   help='mode auto: "calibrate" (at load), "off" (a cold start) or a cost profile JSON')
    p.add_argument("--lend-drafter-cores", dest="lend_drafter_cores", default="measured",
                   type=lambda v: {"always": True, "never": False}.get(v, v), choices=("measured", True, False),
                   metavar="{measured,always,never}",
                   help="mode auto, drafter on its own cores: whether plain decoding runs on them too "
                        "(measured: where that measures faster, per batch size)")
    p.add_argument("--no-lend-drafter-cores", dest="lend_drafter_cores", action="store_const", const=False,
                   help="the same as --lend-drafter-cores never")
    p.add_argument("--json", default=None, help="write the result here")
    p.set_defaults(func=run_offline_cli)


def build_engine(args, mode: Mode | str, gamma: int):
    from backend.engine.engine import Engine
    from backend.engine.config import EngineConfig
    mode = Mode.parse(mode, CONFIGURED_MODES)
    drafter_device = getattr(args, "drafter_device", None)
    if mode is Mode.PSD and drafter_device is None:
        drafter_device = "cpu" if args.device == "cpu" else None
    plain = mode is Mode.AR
    return Engine(EngineConfig(
        target=args.target, drafter=None if plain else args.drafter, device=args.device,
        drafter_device=None if plain else drafter_device,
        dtype=args.dtype, kv_cache_bytes=args.kv_cache_mb << 20, mode=mode,
        gamma=0 if plain else gamma, gamma_max=max(8, gamma), seed=args.seed,
        num_threads=args.threads, max_num_seqs=max(64, args.concurrency),
        planner_cost_profile=getattr(args, "planner_cost_profile", "calibrate"),
        lend_drafter_cores=getattr(args, "lend_drafter_cores", "measured"), **executor_args(args)))


def run_offline(engine, prompts: list[str], *, max_tokens: int, concurrency: int, temperature: float,
                seed: int, progress: bool = True) -> dict:
    from backend.sampling.params import SamplingParams
    params = [SamplingParams(max_tokens=max_tokens, temperature=temperature, ignore_eos=True,
                             seed=None if temperature == 0 else seed + i) for i in range(len(prompts))]
    before = engine.stats()
    drafted0, accepted0 = before.drafted_tokens, before.accepted_tokens
    calls0, dtok0 = before.target_calls, before.decode_tokens
    bar = _progress(len(prompts), progress)
    step_times: list[float] = []
    t_draft = t_verify = 0.0
    psd = {"draft": 0.0, "verify": 0.0, "step": 0.0}
    modes: dict[str, int] = {}

    def on_step(outs):
        nonlocal t_draft, t_verify
        s = engine.stats().last_step
        step_times.append(s.t_step_s)
        t_draft += s.t_draft_s
        t_verify += s.t_verify_s
        modes[s.mode.value] = modes.get(s.mode.value, 0) + 1
        if s.mode is Mode.PSD:
            psd["draft"] += s.t_draft_s
            psd["verify"] += s.t_verify_s
            psd["step"] += s.t_step_s
        done = sum(o.finished for o in outs)
        if bar and done:
            bar.update(done)

    t0 = time.perf_counter()
    completions = engine.generate(prompts, params, on_step=on_step, max_concurrency=concurrency)
    wall = time.perf_counter() - t0
    if bar:
        bar.close()
    after = engine.stats()
    drafted = after.drafted_tokens - drafted0
    accepted = after.accepted_tokens - accepted0
    calls = after.target_calls - calls0
    out_tokens = sum(len(c.output_ids) for c in completions)
    return {
        "mode": engine.config.mode.value,
        "gamma": engine.gamma,
        "requests": len(prompts),
        "concurrency": concurrency,
        "temperature": temperature,
        "max_tokens": max_tokens,
        "output_tokens": out_tokens,
        "wall_s": wall,
        "tokens_per_s": out_tokens / wall if wall else 0.0,
        "acceptance_rate": accepted / drafted if drafted else 0.0,
        "drafted_tokens": drafted,
        "accepted_tokens": accepted,
        "mean_tokens_per_target_call": (after.decode_tokens - dtok0) / calls if calls else 0.0,
        "steps": len(step_times),
        "mean_step_s": statistics.fmean(step_times) if step_times else 0.0,
        "draft_s": t_draft,
        "verify_s": t_verify,
        "mean_t_draft_s": t_draft / max(len(step_times), 1),
        "mean_t_verify_s": t_verify / max(len(step_times), 1),
        # (T_draft + T_verify) / T_step over batch-parallel steps: 1 = no overlap, 2 = perfect.
        "overlap_efficiency": (psd["draft"] + psd["verify"]) / psd["step"] if psd["step"] else None,
        "steps_by_mode": modes,
        "preemptions": after.preemptions - before.preemptions,
        "outputs": [c.output_ids for c in completions],
    }


def run_offline_cli(args) -> int:
    prompts = load_prompts(args.prompts, args.num_prompts)
    print(f"loading engine (mode={args.mode}, gamma={args.gamma}) ...", file=sys.stderr)
    engine = build_engine(args, args.mode, args.gamma)
    result = run_offline(engine, prompts, max_tokens=args.max_tokens, concurrency=args.concurrency,
                         temperature=args.temperature, seed=args.seed)
    engine.close()
    result.update(target=args.target, drafter=None if args.mode is Mode.AR else args.drafter)
    print(summary_line(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
        print(f"wrote {args.json}", file=sys.stderr)
    return 0


def summary_line(r: dict) -> str:
    return (f"{r['mode']:>3} gamma={r['gamma']} conc={r['concurrency']:>3}: "
            f"{r['output_tokens']} tokens in {r['wall_s']:.2f}s = {r['tokens_per_s']:.1f} tok/s, "
            f"acceptance {r['acceptance_rate']:.3f}, tokens/target call "
            f"{r['mean_tokens_per_target_call']:.2f}, steps {r['steps']}"
            + (f", overlap {r['overlap_efficiency']:.2f}" if r.get("overlap_efficiency") else ""))


def _progress(total: int, enabled: bool):
    if not enabled:
        return None
    from tqdm import tqdm
    return tqdm(total=total, desc="requests", file=sys.stderr, leave=False)
