"""The metric families of Triton's vLLM backend (and vLLM V1's speculative-decoding counters),
under their names, labels, buckets and observation rules, so the dashboards and alerts of vLLM
users work unchanged. On when the model parameter ``REPORT_CUSTOM_METRICS`` is true (the
vLLM backend's switch); labels ``model`` and ``version``.

=================================================  =========  ===================================
vllm:prompt_tokens_total                           counter    prompt tokens processed
vllm:generation_tokens_total                       counter    tokens generated
vllm:time_to_first_token_seconds                   histogram  once per request
vllm:time_per_output_token_seconds                 histogram  once per output token after the
                                                              first (a step that commits k tokens
                                                              observes its interval / k, k times)
vllm:e2e_request_latency_seconds                   histogram  once per request
vllm:request_prompt_tokens                         histogram  once per request
vllm:request_generation_tokens                     histogram  once per request
vllm:request_params_n                              histogram  once per request (n is always 1)
vllm:num_requests_running, vllm:num_requests_waiting, vllm:gpu_cache_usage_perc   gauges
vllm:spec_decode_num_drafts_total                  counter    proposals verified (per sequence)
vllm:spec_decode_num_draft_tokens_total            counter
vllm:spec_decode_num_accepted_tokens_total         counter
vllm:spec_decode_num_accepted_tokens_per_pos_total counter    label position: drafts accepted at it
=================================================  =========  ===================================

vLLM names its speculative-decoding counters ``vllm:spec_decode_num_drafts`` and so on in
prometheus_client, which exposes them with the ``_total`` suffix; Triton's families are exposed
as named, so they carry the suffix here and the exposed names match.
"""
from __future__ import annotations

from typing import Any

TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0]
TPOT_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5]
E2E_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
               240.0, 480.0, 960.0, 1920.0, 7680.0]
N_BUCKETS = [1, 2, 5, 10, 20]


def buckets_1_2_5(limit: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to `limit` (vLLM's token-count buckets)."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            v = m * scale
            if v > limit:
                return out
            out.append(v)
        scale *= 10


class VllmMetrics:
    def __init__(self, pb: Any, labels: dict[str, str], max_model_len: int, max_positions: int):
        MF = pb.MetricFamily
        self._families: list[Any] = []         # referenced for the model's life (Triton drops others)

        def metric(name: str, desc: str, kind: Any, buckets=None, **extra):
            fam = MF(name=name, description=desc, kind=kind)
            self._families.append(fam)
            lab = {**labels, **extra}
            return fam.Metric(labels=lab, buckets=buckets) if buckets is not None else fam.Metric(labels=lab)

        C, H, G = MF.COUNTER, MF.HISTOGRAM, MF.GAUGE
        self.prompt_tokens = metric("vllm:prompt_tokens_total", "Number of prefill tokens processed.", C)
        self.generation_tokens = metric("vllm:generation_tokens_total", "Number of generation tokens processed.", C)
        self.ttft = metric("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                           H, TTFT_BUCKETS)
        self.tpot = metric("vllm:time_per_output_token_seconds",
                           "Histogram of time per output token in seconds.", H, TPOT_BUCKETS)
        self.e2e = metric("vllm:e2e_request_latency_seconds",
                          "Histogram of end to end request latency in seconds.", H, E2E_BUCKETS)
        tokens = buckets_1_2_5(max_model_len)
        self.request_prompt = metric("vllm:request_prompt_tokens", "Number of prefill tokens processed.", H, tokens)
        self.request_generation = metric("vllm:request_generation_tokens",
                                         "Number of generation tokens processed.", H, tokens)
        self.request_n = metric("vllm:request_params_n", "Histogram of the n request parameter.", H, N_BUCKETS)
        self.running = metric("vllm:num_requests_running", "Number of requests currently running.", G)
        self.waiting = metric("vllm:num_requests_waiting", "Number of requests waiting to be processed.", G)
        self.cache = metric("vllm:gpu_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", G)
        self.drafts = metric("vllm:spec_decode_num_drafts_total", "Number of spec decoding drafts.", C)
        self.draft_tokens = metric("vllm:spec_decode_num_draft_tokens_total", "Number of draft tokens.", C)
        self.accepted = metric("vllm:spec_decode_num_accepted_tokens_total", "Number of accepted tokens.", C)
        fam = MF(name="vllm:spec_decode_num_accepted_tokens_per_pos_total",
                 description="Accepted tokens per draft position.", kind=C)
        self._families.append(fam)
        self.per_pos = [fam.Metric(labels={**labels, "position": str(p)}) for p in range(max_positions)]
        self._seen: dict[str, float] = {}

    # ---- per request (the response thread)

    def observe_tokens(self, count: int, since_s: float | None, first_token_s: float | None) -> None:
        """An output delivered `count` tokens: `first_token_s` when its first is the request's
        first (its time to first token); `since_s`: the time they took since the previous token."""
        if first_token_s is not None:
            self.ttft.observe(max(0.0, first_token_s))
            count -= 1
        if count > 0 and since_s is not None:
            per = max(0.0, since_s) / count
            for _ in range(count):
                self.tpot.observe(per)

    def observe_request(self, e2e_s: float, prompt_tokens: int, generation_tokens: int) -> None:
        self.e2e.observe(max(0.0, e2e_s))
        self.request_prompt.observe(prompt_tokens)
        self.request_generation.observe(generation_tokens)
        self.request_n.observe(1)

    # ---- engine-wide (the engine loop thread, throttled)

    def update_from_stats(self, s: Any) -> None:
        self.running.set(float(s.num_running))
        self.waiting.set(float(s.num_waiting))
        self.cache.set(float(s.kv_usage))
        self._advance("prompt", self.prompt_tokens, s.prompt_tokens)
        self._advance("generation", self.generation_tokens, s.generation_tokens)
        self._advance("drafts", self.drafts, s.num_drafts)
        self._advance("draft_tokens", self.draft_tokens, s.drafted_tokens)
        self._advance("accepted", self.accepted, s.accepted_tokens)
        for pos, total in enumerate(s.accepted_per_position[:len(self.per_pos)]):
            self._advance(f"pos{pos}", self.per_pos[pos], total)

    def _advance(self, key: str, counter: Any, total: float) -> None:
        prev = self._seen.get(key, 0.0)
        if total > prev:
            counter.increment(total - prev)
            self._seen[key] = total
