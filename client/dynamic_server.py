"""`nightdraft bench dynamic --server`: the same arrival schedule, through a real tritonserver.

For each configuration a model repository holding only the ``nightdraft`` model is laid out in a
temporary directory, with that configuration as its ``engine.json``; tritonserver starts on free
loopback ports, two warm-up requests go through, and then every request is sent at its arrival
time on its own gRPC stream (the client threads live in this process). TTFT and end-to-end
latency are what the client sees. The planner's state comes from the model's own metrics: the
endpoint is scraped every ``scrape_s`` for the gamma, pipeline-mode and drafter-state gauges, the
running/waiting requests and the target KV pool's size, and the offload, reload and switch
counters; the planner's own summary (arm counts, what each offload promised and delivered) is the
JSON file the model writes at unload (its ``planner_summary_file`` parameter, set here).
"""
from __future__ import annotations

import contextlib
import json
import re
import sys
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from backend.serving.planner_io import SUMMARY_FILE

from client.dynamic_report import Record, RunResult
from client.prompts import REPO

MODEL = "nightdraft"
READY_TIMEOUT_S = 300
PLANNER_SUMMARY_NAME = "planner_summary.json"


def write_repository(root: Path, engine_config: dict) -> Path:
    """A model repository with the nightdraft model only, configured by `engine_config`; the
    model writes its planner summary to :func:`planner_summary_path` at unload."""
    src = REPO / "model_repository"
    repo = root / "model_repository"
    dst = repo / MODEL
    (dst / "1").mkdir(parents=True)
    pbtxt = (src / MODEL / "config.pbtxt").read_text()
    (dst / "config.pbtxt").write_text(
        set_model_parameter(pbtxt, SUMMARY_FILE, str(planner_summary_path(repo).resolve())))
    (dst / "1" / "engine.json").write_text(json.dumps(engine_config, indent=2))
    return repo


def set_model_parameter(pbtxt: str, key: str, value: str) -> str:
    """config.pbtxt text with the string parameter `key` set to `value` (added if absent)."""
    pattern = re.compile(r'(key:\s*"%s"\s*value:\s*\{\s*string_value:\s*)"[^"]*"' % re.escape(key))
    literal = json.dumps(value)
    if pattern.search(pbtxt):
        return pattern.sub(lambda m: m.group(1) + literal, pbtxt, count=1)
    return pbtxt.rstrip("\n") + f'\nparameters: {{\n  key: "{key}"\n  value: {{ string_value: {literal} }}\n}}\n'


def planner_summary_path(repository: Path) -> Path:
    """Where the model of a repository from :func:`write_repository` writes its planner summary
    (next to the repository: Triton takes every folder inside it for a model)."""
    return Path(repository).parent / PLANNER_SUMMARY_NAME


def read_planner_summary(repository: Path) -> dict:
    """The planner summary the model wrote at unload (an empty dict if it wrote none)."""
    path = planner_summary_path(repository)
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return {}


def scrape_state(url: str) -> dict | None:
    """The nightdraft gauges and counters the benchmark follows, or None if the scrape failed."""
    from prometheus_client.parser import text_string_to_metric_families
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            text = r.read().decode()
    except OSError:
        return None
    out: dict = {"mode": "ar", "drafter": "none"}
    scalars = {"nightdraft_spec_decode_gamma": "gamma", "nightdraft_num_requests_running": "running",
               "nightdraft_num_requests_waiting": "waiting", "nightdraft_kv_cache_total_blocks": "kv_blocks",
               "nightdraft_drafter_offloads": "offloads", "nightdraft_drafter_reloads": "reloads",
               "nightdraft_planner_switches": "switches"}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.labels.get("model") != MODEL:
                continue
            key = scalars.get(fam.name)
            if key is not None and s.name in (fam.name, fam.name + "_total"):
                out[key] = int(s.value) if key != "gamma" else int(round(s.value))
            elif fam.name == "nightdraft_pipeline_mode" and s.value >= 1:
                out["mode"] = s.labels.get("mode", "ar")
            elif fam.name == "nightdraft_drafter_state" and s.value >= 1:
                out["drafter"] = s.labels.get("state", "none")
    return out


class _Scraper(threading.Thread):
    def __init__(self, url: str, start: float, every_s: float):
        super().__init__(name="bench-dynamic-scraper", daemon=True)
        self.url, self.start_t, self.every_s = url, start, every_s
        self.timeline: list[dict] = []
        self.events: list[dict] = []
        self.last: dict | None = None
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.is_set():
            s = scrape_state(self.url)
            if s is not None:
                t = time.monotonic() - self.start_t
                prev = self.last
                if prev is not None:
                    for kind, key in (("offload", "offloads"), ("reload_done", "reloads")):
                        if s.get(key, 0) > prev.get(key, 0):
                            self.events.append({"t": t, "kind": kind,
                                                "target_kv_blocks": s.get("kv_blocks", 0), "seconds": 0.0})
                if prev is None or any(s.get(k) != prev.get(k) for k in ("mode", "gamma", "drafter", "kv_blocks")) \
                        or not self.timeline or t - self.timeline[-1]["t"] >= 0.5:
                    self.timeline.append({"t": t, **{k: s.get(k, 0) for k in (
                        "mode", "gamma", "drafter", "running", "waiting", "kv_blocks")}})
                self.last = s
            self._stop_event.wait(self.every_s)

    def stop(self) -> None:
        self._stop_event.set()
        self.join(timeout=10)


@dataclass
class Served:
    client: object
    metrics_url: str
    planner_summary: dict = field(default_factory=dict)   # written by the model at unload


@contextlib.contextmanager
def serving(engine_config: dict, warmup_prompts: list[str], temperature: float,
            cores: list[int] | None = None):
    """A tritonserver running `engine_config`, warmed up, on `cores` (None: the calling
    thread's); yields a :class:`Served` whose ``planner_summary`` is filled in once the server
    has stopped."""
    from client.launcher import TritonServer, free_port
    from client.triton_client import GrpcClient

    with tempfile.TemporaryDirectory(prefix="nightdraft-dynamic-") as tmp:
        repo = write_repository(Path(tmp), engine_config)
        log_file = Path(tmp) / "tritonserver.log"
        server = TritonServer(repo, http_port=free_port(), grpc_port=free_port(),
                              metrics_port=free_port(), host="127.0.0.1",
                              log_file=log_file, models=[MODEL], exit_timeout_s=10, cores=cores)
        server.start()
        try:
            server.wait_ready(READY_TIMEOUT_S)
            served = Served(GrpcClient(server.grpc_url, MODEL, timeout_s=600.0), server.metrics_url)
            for p in warmup_prompts:                       # not measured
                for _ in served.client.stream(p, max_tokens=4, temperature=temperature, ignore_eos=True):
                    pass
            yield served
        except Exception:
            print(f"tritonserver log tail:\n{server.log_tail(40)}", file=sys.stderr)
            raise
        finally:
            server.stop(timeout_s=30)
        served.planner_summary = read_planner_summary(repo)


def measure_capacity_on_server(engine_config: dict, prompts: list[str], args,
                               cores: list[int] | None = None) -> float:
    """Requests/s the server sustains with 16 streams in flight (a quick closed-loop probe)."""
    with serving(engine_config, prompts[:2], args.temperature, cores) as served:
        def one(p: str) -> None:
            for _ in served.client.stream(p, max_tokens=args.max_tokens, temperature=args.temperature,
                                   ignore_eos=True):
                pass
        t0 = time.monotonic()
        with ThreadPoolExecutor(max_workers=16) as pool:
            list(pool.map(one, prompts[:32]))
        return 32 / (time.monotonic() - t0)


def replay_on_server(engine_config: dict, arrivals, bounds, args, *, scrape_s: float = 0.2,
                     cores: list[int] | None = None) -> RunResult:
    from client.triton_client import ClientError
    with serving(engine_config, [arrivals[0].prompt, arrivals[-1].prompt], args.temperature,
                 cores) as served:
        run = _replay(served.client, served.metrics_url, arrivals, bounds, args, scrape_s, ClientError)
    run.planner_summary = served.planner_summary
    run.arm_counts = served.planner_summary.get("arm_counts", {})
    return run


def _replay(client, metrics_url, arrivals, bounds, args, scrape_s, client_error) -> RunResult:
    records = [Record(a.phase, a.t) for a in arrivals]
    start = time.monotonic()
    scraper = _Scraper(metrics_url, start, scrape_s)
    scraper.start()

    def one(i: int) -> None:
        r, a = records[i], arrivals[i]
        try:
            for ch in client.stream(a.prompt, max_tokens=a.max_tokens, temperature=args.temperature,
                                    seed=args.seed + i, ignore_eos=True):
                t = time.monotonic() - start
                if ch.text and r.first_token is None:
                    r.first_token = t
                if ch.num_output_tokens:
                    r.tokens += ch.num_output_tokens
            r.finish = time.monotonic() - start
        except client_error as e:
            r.error = str(e)
        except Exception as e:  # a transport failure is a failed request, not a crashed benchmark
            r.error = f"{type(e).__name__}: {e}"

    with ThreadPoolExecutor(max_workers=min(len(arrivals), 512)) as pool:
        for i, a in enumerate(arrivals):
            delay = a.t - (time.monotonic() - start)
            if delay > 0:
                time.sleep(delay)
            pool.submit(one, i)
    time.sleep(2 * scrape_s)          # let the gauges settle after the last request
    scraper.stop()
    final = scraper.last or {}
    return RunResult(records, list(bounds), scraper.timeline, scraper.events,
                     switches=int(final.get("switches", 0)))
