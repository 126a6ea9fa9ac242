"""`nightdraft bench profile --server`: the same load through a real tritonserver.

For each configuration a server runs the same engine configuration (same checkpoints, one
thread per model, the drafter's placement unchanged) and is driven closed loop at each
concurrency, by gRPC streams from this process (``--server-client python``, one channel per
client thread) or by Triton's perf_analyzer (``--server-client perf_analyzer``: C++, light on the
cores the server shares with it; ``scripts/perf_analyzer.sh``). The model's own counters, read
before and after, give the engine steps and generated tokens. Beside the in-process run of the
same configuration and concurrency it reports the throughput ratio and the time per engine step,
whose difference is what serving costs a step (building and sending one response per request,
the stub's IPC, tritonserver and the client on the same cores).
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from client.bench_serve import scrape_metrics
from client.dynamic_server import MODEL, serving

# perf_analyzer's words when no request finished inside a measurement window, and when some
# window saw none finish (its throughput 0: no stability percentage passes): both say a window
# shorter than a request's life, as at high concurrency on a slow host
NOTHING_RECORDED = "No valid requests recorded"
UNSTABLE = "Failed to obtain stable measurement"
WINDOW_TOO_SHORT = (NOTHING_RECORDED, UNSTABLE)


def engine_config(args, name: str) -> dict:
    from client.bench_offline import executor_args
    cfg = dict(target=args.target, device=args.device, dtype=args.dtype, kv_cache_bytes=args.kv_cache_mb << 20,
               max_num_seqs=128, num_threads=args.threads or 1, seed=0, mode=name, **executor_args(args))
    if name != "ar":
        cfg |= {"drafter": args.drafter, "gamma": args.gamma}
    if name == "psd":
        cfg["drafter_device"] = "cpu"
    return cfg


def drive(client, prompts: list[str], conc: int, args) -> tuple[float, int]:
    def one(p: str) -> int:
        n = 0
        for chunk in client.stream(p, max_tokens=args.max_tokens, temperature=args.temperature, ignore_eos=True):
            n += len(chunk.token_ids) if getattr(chunk, "token_ids", None) else 0
        return n
    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=conc) as pool:
        list(pool.map(one, prompts))
    return time.perf_counter() - t0, len(prompts) * args.max_tokens


def window_too_short(perf_analyzer_output: str) -> bool:
    """Did perf_analyzer fail because its window is shorter than a request's life?"""
    return any(words in perf_analyzer_output for words in WINDOW_TOO_SHORT)


def drive_perf_analyzer(grpc_url: str, conc: int, args, retries: int = 2) -> float:
    """perf_analyzer at `conc` streams for three windows of ``--pa-window-s``; returns the wall
    time it ran (the caller reads the tokens from the server's counters around it, so a retry's
    tokens and time both count). When no request completed inside a window, or a window saw
    none complete so that no measurement was stable (a slow host, a high concurrency), it runs
    again with a window twice as long, up to `retries` times."""
    script = Path(__file__).resolve().parent.parent / "scripts" / "perf_analyzer.sh"
    out = Path(args.json).with_suffix(f".pa-c{conc}.json")
    window_s = args.pa_window_s
    t0 = time.perf_counter()
    for attempt in range(retries + 1):
        out.unlink(missing_ok=True)     # perf_analyzer refuses to overwrite its export (each run keeps the last)
        cmd = [str(script), "-u", grpc_url, "-m", MODEL, "-c", str(conc), "-n", str(args.max_tokens),
               "-t", str(args.temperature), "-o", str(out), "--",
               "--measurement-interval", str(int(1000 * window_s)), "--stability-percentage", "999"]
        res = subprocess.run(cmd, capture_output=True, text=True, env=os.environ | {"PYTHON": sys.executable})
        if res.returncode == 0:
            break
        if not window_too_short(res.stdout + res.stderr) or attempt == retries:
            # perf_analyzer prints the reason first, then its whole usage text
            raise RuntimeError(f"perf_analyzer failed ({res.returncode}): {res.stderr[:1500]}\n"
                               f"... {res.stdout[-1000:]}")
        window_s *= 2
        print(f"perf_analyzer found its window too short at concurrency {conc}; "
              f"again with a {window_s:g} s window", file=sys.stderr, flush=True)
    return time.perf_counter() - t0


def profile_on_server(args, names: list[str], levels: list[int], prompts: list[str],
                      in_process: list[dict]) -> list[dict]:
    rows = []
    for name in names:
        print(f"profiling {name} through tritonserver ...", file=sys.stderr)
        with serving(engine_config(args, name), prompts[:2], args.temperature) as served:
            for conc in levels:
                n = max(4, int(conc * args.requests_per_level))
                before = scrape_metrics(served.metrics_url, MODEL)
                if args.server_client == "perf_analyzer":
                    wall, tokens = drive_perf_analyzer(served.client.url, conc, args), 0
                else:
                    wall, tokens = drive(served.client, prompts[:n], conc, args)
                time.sleep(0.5)        # the engine-wide counters are refreshed when it goes idle
                after = scrape_metrics(served.metrics_url, MODEL)
                steps = after.get("nightdraft_engine_steps_total", 0) - before.get("nightdraft_engine_steps_total", 0)
                made = after.get("nightdraft_generation_tokens_total", 0) - \
                    before.get("nightdraft_generation_tokens_total", 0)
                local = next((r for r in in_process if r["config"] == name and r["concurrency"] == conc
                              and not r.get("server")), {})
                row = {"config": name, "concurrency": conc, "server": True, "client": args.server_client,
                       "tokens_per_s": (made or tokens) / wall,
                       "mean_step_ms": 1e3 * wall / steps if steps else None}
                if local.get("tokens_per_s"):
                    row["over_in_process"] = row["tokens_per_s"] / local["tokens_per_s"]
                rows.append(row)
                print(f"{name:>4} (server) c={conc:>3}: {row['tokens_per_s']:.0f} tok/s"
                      + (f" = {row['over_in_process']:.2f}x in-process" if "over_in_process" in row else ""),
                      flush=True)
    return rows
