"""``nightdraft bench serve``: a load generator against a running server.

Closed loop (``--concurrency N``: N clients, each sends its next request when the last one
finished) or open loop (``--request-rate R``: Poisson arrivals at R requests/s, as many in
flight as it takes, optionally capped by ``--max-concurrency``). Every request streams; the
client times the first text (TTFT), the end (e2e), the gaps between responses (ITL) and
TPOT = (e2e - TTFT) / (output tokens - 1). Reports throughput and mean/p50/p99, prints a table,
writes ``--json``; when the server's metrics endpoint answers, it also reports what the engine
did during the run (drafted/accepted tokens, acceptance rate).

``python -m client.bench_serve --perf-analyzer-export FILE`` summarises a perf_analyzer
``--profile-export-file`` (streaming) in the same terms (see ``scripts/perf_analyzer.sh``).
"""
from __future__ import annotations

import argparse
import json
import math
import random
import re
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from client.triton_client import ClientError, make_client


@dataclass
class RequestRecord:
    prompt_chars: int
    ok: bool = False
    error: str | None = None
    ttft: float | None = None
    e2e: float | None = None
    output_tokens: int = 0
    input_tokens: int | None = None
    itl: list[float] = field(default_factory=list)
    t_start: float = 0.0

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.e2e is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    v = sorted(values)
    k = (len(v) - 1) * q / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return v[lo] if lo == hi else v[lo] + (v[hi] - v[lo]) * (k - lo)


def dist(values: list[float]) -> dict[str, float | None]:
    return {"mean": sum(values) / len(values) if values else None,
            "p50": percentile(values, 50), "p99": percentile(values, 99),
            "min": min(values) if values else None, "max": max(values) if values else None}


def run_one(client, prompt: str, args) -> RequestRecord:
    rec = RequestRecord(prompt_chars=len(prompt))
    rec.t_start = t0 = time.monotonic()
    last = None
    reported, text_chunks, any_reported = 0, 0, False
    try:
        for ch in client.stream(prompt, max_tokens=args.max_tokens, temperature=args.temperature,
                                top_p=args.top_p, ignore_eos=args.ignore_eos if args.schema != "ensemble" else None,
                                timeout_s=args.request_timeout):
            if ch.text:
                text_chunks += 1
                if rec.ttft is None:
                    rec.ttft = ch.t - t0
                elif last is not None:
                    rec.itl.append(ch.t - last)
                last = ch.t
            if ch.num_output_tokens is not None:
                reported += ch.num_output_tokens
                any_reported = True
            if ch.num_input_tokens is not None:
                rec.input_tokens = ch.num_input_tokens
        rec.e2e = time.monotonic() - t0
        # The server reports tokens per response; without that (the ensemble), count responses.
        rec.output_tokens = reported if any_reported else text_chunks
        rec.ok = True
    except ClientError as e:
        rec.error = str(e)
        rec.e2e = time.monotonic() - t0
    except Exception as e:  # transport failures count as failed requests, not crashes
        rec.error = f"{type(e).__name__}: {e}"
        rec.e2e = time.monotonic() - t0
    return rec


def scrape_metrics(url: str | None, model: str) -> dict[str, float]:
    """Sum the nightdraft_* samples of one model from a Prometheus text endpoint."""
    if not url:
        return {}
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            text = r.read().decode()
    except Exception:
        return {}
    out: dict[str, float] = {}
    pat = re.compile(r'^(nightdraft_[a-z0-9_]+)\{([^}]*)\}\s+(\S+)$')
    for line in text.splitlines():
        m = pat.match(line)
        if not m or f'model="{model}"' not in m.group(2):
            continue
        try:
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(3))
        except ValueError:
            pass
    return out


def summarize(records: list[RequestRecord], duration: float) -> dict[str, Any]:
    ok = [r for r in records if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.input_tokens or 0 for r in ok)
    itl = [x for r in ok for x in r.itl]
    return {
        "completed": len(ok), "failed": len(records) - len(ok), "duration_s": duration,
        "request_throughput": len(ok) / duration if duration > 0 else 0.0,
        "output_token_throughput": out_tokens / duration if duration > 0 else 0.0,
        "total_token_throughput": (out_tokens + in_tokens) / duration if duration > 0 else 0.0,
        "total_output_tokens": out_tokens, "total_input_tokens": in_tokens,
        "ttft_s": dist([r.ttft for r in ok if r.ttft is not None]),
        "tpot_s": dist([r.tpot for r in ok if r.tpot is not None]),
        "itl_s": dist(itl),
        "e2e_s": dist([r.e2e for r in ok if r.e2e is not None]),
        "errors": sorted({r.error for r in records if r.error})[:10],
    }


def run_bench(args) -> dict[str, Any]:
    from client.prompts import load_prompts
    prompts = load_prompts(args.prompts, n=args.num_prompts + args.warmup)
    rng = random.Random(args.seed)
    if args.shuffle:
        rng.shuffle(prompts)
    warm, prompts = prompts[:args.warmup], prompts[args.warmup:]
    def new_client():
        return make_client(args.url, args.protocol, args.model, schema=args.schema,
                           timeout_s=args.request_timeout, keep_open=True)
    # One client (over gRPC: one channel and one stream) per worker thread, reused for its
    # requests one after another: a channel per request costs this process more CPU than the
    # server's own work on a small model, on the same cores.
    local = threading.local()

    def thread_client():
        if getattr(local, "client", None) is None:
            local.client = new_client()
            with lock:
                clients.append(local.client)
        return local.client
    clients: list = []
    lock = threading.Lock()
    client = new_client()
    clients.append(client)
    for p in warm:
        rec = run_one(client, p, args)
        if not rec.ok:
            raise SystemExit(f"bench serve: warm-up request failed: {rec.error}")

    metrics_url = args.metrics_url
    # The ensemble's engine is its token-level model.
    metrics_model = "nightdraft_tokens" if args.model == "ensemble" else args.model
    before = scrape_metrics(metrics_url, metrics_model)
    records: list[RequestRecord] = []
    try:
        from tqdm import tqdm
        bar = tqdm(total=len(prompts), desc="requests", unit="req", disable=args.no_progress,
                   file=sys.stderr)
    except ImportError:  # pragma: no cover
        bar = None

    def done(rec: RequestRecord) -> None:
        with lock:
            records.append(rec)
            if bar is not None:
                bar.update(1)

    t0 = time.monotonic()
    if args.request_rate is None:
        it = iter(prompts)

        def worker():
            while True:
                with lock:
                    p = next(it, None)
                if p is None:
                    return
                done(run_one(thread_client(), p, args))
        threads = [threading.Thread(target=worker, daemon=True) for _ in range(args.concurrency)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    else:
        cap = args.max_concurrency or max(1, min(len(prompts), 512))
        sem = threading.BoundedSemaphore(cap)
        next_t = time.monotonic()

        def task(p):
            try:
                done(run_one(thread_client(), p, args))
            finally:
                sem.release()
        with ThreadPoolExecutor(max_workers=cap) as pool:
            for p in prompts:
                if math.isfinite(args.request_rate):
                    next_t += rng.expovariate(args.request_rate)
                    delay = next_t - time.monotonic()
                    if delay > 0:
                        time.sleep(delay)
                sem.acquire()
                pool.submit(task, p)
    duration = time.monotonic() - t0
    for c in clients:
        if hasattr(c, "close"):
            c.close()
    if bar is not None:
        bar.close()
    after = scrape_metrics(metrics_url, metrics_model)

    summary = summarize(records, duration)
    summary["clients"] = len(clients)     # channels (gRPC) the load generator opened
    # Token counts come from the server's num_output_tokens; the ensemble does not return them,
    # so there each response counts as one token (a response may carry several).
    summary["token_counts"] = "responses" if args.schema == "ensemble" else "server"
    summary["config"] = {k: getattr(args, k) for k in (
        "url", "protocol", "model", "schema", "concurrency", "request_rate", "max_concurrency",
        "num_prompts", "max_tokens", "temperature", "top_p", "ignore_eos", "warmup", "seed")}
    if before or after:
        d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after if k.endswith("_total")}
        drafted = d.get("nightdraft_spec_decode_draft_tokens_total", 0.0)
        accepted = d.get("nightdraft_spec_decode_accepted_tokens_total", 0.0)
        gen = d.get("nightdraft_generation_tokens_total")
        summary["server"] = {
            "model": metrics_model,
            "generation_tokens": gen,
            "output_token_throughput": gen / duration if gen is not None and duration > 0 else None,
            "engine_steps": d.get("nightdraft_engine_steps_total"),
            "drafted_tokens": drafted, "accepted_tokens": accepted,
            "acceptance_rate": accepted / drafted if drafted else None,
            "preemptions": d.get("nightdraft_preemptions_total"),
        }
    if args.save_requests:
        summary["requests"] = [asdict(r) | {"tpot": r.tpot} for r in records]
    return summary


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.1f}"


def print_table(s: dict[str, Any], title: str = "nightdraft bench serve", file=sys.stdout) -> None:
    cfg = s.get("config", {})
    load = (f"concurrency {cfg.get('concurrency')}" if cfg.get("request_rate") is None
            else f"request rate {cfg.get('request_rate')}/s")
    print(f"\n== {title}: {cfg.get('model', '')} via {cfg.get('protocol', '')}, {load} ==", file=file)
    print(f"requests      {s['completed']} ok, {s['failed']} failed in {s['duration_s']:.2f} s", file=file)
    print(f"throughput    {s['request_throughput']:.2f} req/s, {s['output_token_throughput']:.1f} output tok/s, "
          f"{s['total_token_throughput']:.1f} total tok/s", file=file)
    print(f"{'(ms)':<10}{'mean':>10}{'p50':>10}{'p99':>10}", file=file)
    for key, label in (("ttft_s", "TTFT"), ("tpot_s", "TPOT"), ("itl_s", "ITL"), ("e2e_s", "E2E")):
        d = s.get(key) or {}
        print(f"{label:<10}{_ms(d.get('mean')):>10}{_ms(d.get('p50')):>10}{_ms(d.get('p99')):>10}", file=file)
    if s.get("token_counts") == "responses":
        print("              (tokens counted as responses: the ensemble does not report token counts)", file=file)
    srv = s.get("server")
    if srv and srv.get("output_token_throughput"):
        print(f"server tokens {srv['generation_tokens']:.0f} generated by {srv['model']} "
              f"({srv['output_token_throughput']:.1f} tok/s over the run)", file=file)
    if srv and srv.get("acceptance_rate") is not None:
        print(f"server        drafted {srv['drafted_tokens']:.0f}, accepted {srv['accepted_tokens']:.0f} "
              f"(acceptance {srv['acceptance_rate']:.2f}), steps {srv.get('engine_steps') or 0:.0f}", file=file)
    if s.get("errors"):
        print("errors        " + "\n              ".join(s["errors"]), file=file)


def _default_metrics_url(url: str | None) -> str:
    host = (url or "localhost").split("://")[-1].rsplit(":", 1)[0] or "localhost"
    return f"http://{host}:8002/metrics"


def add_bench_serve_parser(bench_subparsers) -> argparse.ArgumentParser:
    p = bench_subparsers.add_parser("serve", help="load-test a running server (TTFT, TPOT, throughput)",
                                    description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_args(p)
    p.set_defaults(func=bench_serve_main)
    return p


def _add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default=None, help="server address (default: localhost:8001 for grpc, "
                                               "localhost:8000 for http)")
    p.add_argument("--protocol", choices=("grpc", "http"), default="grpc")
    p.add_argument("--model", default="nightdraft", help="model to call (nightdraft or ensemble)")
    p.add_argument("--schema", choices=("vllm", "ensemble"), default=None,
                   help="request schema (default: ensemble for the ensemble model, else vllm)")
    load = p.add_mutually_exclusive_group()
    load.add_argument("--concurrency", type=int, default=1, help="closed loop: clients in flight (default 1)")
    load.add_argument("--request-rate", type=float, default=None,
                      help="open loop: Poisson arrivals per second (inf: all at once)")
    p.add_argument("--max-concurrency", type=int, default=None, help="with --request-rate: cap in flight")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--prompts", default=None, help="JSONL of prompt strings (default: models/prompts.jsonl)")
    p.add_argument("--shuffle", action="store_true", help="shuffle the prompts (with --seed)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=1.0,
                   help="default 1.0: greedy tiny models loop, which inflates acceptance")
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="generate exactly --max-tokens (default on)")
    p.add_argument("--warmup", type=int, default=2, help="requests sent (and not measured) first")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--request-timeout", type=float, default=600.0)
    p.add_argument("--metrics-url", default="auto",
                   help="Prometheus endpoint to read engine counters from ('auto': port 8002 of the "
                        "server's host; 'none' to skip)")
    p.add_argument("--json", default=None, metavar="OUT", help="write the results here")
    p.add_argument("--save-requests", action="store_true", help="include every request in --json")
    p.add_argument("--no-progress", action="store_true")


def bench_serve_main(args: argparse.Namespace) -> int:
    if args.concurrency is not None and args.concurrency < 1:
        raise ValueError("--concurrency must be >= 1")
    if args.request_rate is not None and not args.request_rate > 0:
        raise ValueError("--request-rate must be > 0")
    if args.schema is None:
        args.schema = "ensemble" if args.model == "ensemble" else "vllm"
    if args.metrics_url == "auto":
        args.metrics_url = _default_metrics_url(args.url)
    elif args.metrics_url in (None, "", "none"):
        args.metrics_url = None
    summary = run_bench(args)
    print_table(summary)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(summary, indent=2))
        print(f"wrote {args.json}")
    return 0 if summary["failed"] == 0 else 1


# ------------------------------------------------------------------ perf_analyzer's export


def summarize_perf_analyzer_export(path: str | Path) -> list[dict[str, Any]]:
    """TTFT / ITL / TPOT / e2e from a perf_analyzer ``--profile-export-file`` of a streaming run
    (one entry per concurrency or request-rate level). Response counts stand in for token
    counts: the nightdraft model sends one response per engine step, which may carry more than
    one token when speculation is accepted, so TPOT here is time per *response* after the first."""
    data = json.loads(Path(path).read_text())
    out = []
    for exp in data.get("experiments", []):
        ttft, itl, tpot, e2e = [], [], [], []
        starts, ends, n_resp = [], [], 0
        for req in exp.get("requests", []):
            ts = req.get("timestamp")
            rts = req.get("response_timestamps") or []
            if ts is None or not rts:
                continue
            starts.append(ts)
            ends.append(rts[-1])
            n_resp += len(rts)
            ttft.append((rts[0] - ts) / 1e9)
            e2e.append((rts[-1] - ts) / 1e9)
            itl += [(b - a) / 1e9 for a, b in zip(rts, rts[1:])]
            if len(rts) > 1:
                tpot.append((rts[-1] - rts[0]) / 1e9 / (len(rts) - 1))
        span = (max(ends) - min(starts)) / 1e9 if starts else 0.0
        out.append({"experiment": exp.get("experiment", {}), "requests": len(starts),
                    "duration_s": span,
                    "request_throughput": len(starts) / span if span else 0.0,
                    "response_throughput": n_resp / span if span else 0.0,
                    "ttft_s": dist(ttft), "itl_s": dist(itl), "tpot_s": dist(tpot), "e2e_s": dist(e2e)})
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m client.bench_serve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_args(p)
    p.add_argument("--perf-analyzer-export", default=None, metavar="FILE",
                   help="only summarise this perf_analyzer profile export and exit")
    args = p.parse_args(argv)
    if args.perf_analyzer_export:
        rows = summarize_perf_analyzer_export(args.perf_analyzer_export)
        for r in rows:
            e = r["experiment"]
            print(f"\n== perf_analyzer {e.get('mode', '')} {e.get('value', '')}: {r['requests']} requests "
                  f"in {r['duration_s']:.2f} s ==")
            print(f"throughput    {r['request_throughput']:.2f} req/s, {r['response_throughput']:.1f} responses/s")
            print(f"{'(ms)':<10}{'mean':>10}{'p50':>10}{'p99':>10}")
            for key, label in (("ttft_s", "TTFT"), ("tpot_s", "TPOT*"), ("itl_s", "ITL"), ("e2e_s", "E2E")):
                d = r[key]
                print(f"{label:<10}{_ms(d['mean']):>10}{_ms(d['p50']):>10}{_ms(d['p99']):>10}")
        print("\n* per response after the first (a response may carry several tokens)")
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=2))
        return 0
    return bench_serve_main(args)


if __name__ == "__main__":
    sys.exit(main())
