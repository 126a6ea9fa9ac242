"""Where each `bench levels` engine's step time went, from a step trace (NIGHTDRAFT_STEP_TRACE):
per engine, its steps' whole cycle time a committed token, then by kind of step (the mode that
ran, `pf` where a decoding step also fed prompt tokens, and steps that fed only prompts) and the
placement of the target's thread: steps, cycle ms, tokens, ms a token, the forward's ms, the
time between steps, prompt tokens fed. Every step an engine ran is counted: its compile pass,
the level's warm-up and its measured run.

    python benchmarks/results/levels-c4-prompts/split.py benchmarks/results/levels-c4-prompts/steps.jsonl.gz
"""
import collections
import gzip
import json
import sys

ENGINES = {0: "ar-2dev", 1: "sd", 2: "psd", 3: "auto"}     # the order bench levels built them in

if __name__ == "__main__":
    steps = collections.defaultdict(list)
    for path in sys.argv[1:]:
        with (gzip.open if path.endswith(".gz") else open)(path, "rt") as f:
            for line in f:
                step = json.loads(line)
                steps[step["engine"]].append(step)
    for engine, rows in sorted(steps.items()):
        cycle = sum(r["t_cycle_s"] for r in rows)
        tokens = sum(r["tokens_committed"] for r in rows)
        print(f"{ENGINES.get(engine, engine)}: {len(rows)} steps, {1e3 * cycle:.0f} ms, {tokens} tokens, "
              f"{1e3 * cycle / tokens:.3f} ms a token")
        kinds = collections.defaultdict(lambda: [0, 0.0, 0, 0.0, 0.0, 0])
        for r in rows:
            decoded = r["num_forward_tokens"] > r["num_prefill_tokens"]
            kind = (r["mode"] if decoded else "prompts only") + (" pf" if decoded and r["num_prefill_tokens"] else "")
            k = kinds[(kind, r["placement"])]
            k[0] += 1
            k[1] += r["t_cycle_s"]
            k[2] += r["tokens_committed"]
            k[3] += r["t_forward_s"]
            k[4] += r["t_cycle_s"] - r["t_step_s"]
            k[5] += r["num_prefill_tokens"]
        for (kind, where), (n, c, tok, fwd, gap, pf) in sorted(kinds.items()):
            print(f"  {kind:13s} {where:7s} steps {n:4d}  cycle {1e3 * c:6.1f} ms  tokens {tok:4d}  "
                  f"{1e3 * c / max(tok, 1):6.3f} ms a token  forward {1e3 * fwd:6.1f} ms  between {1e3 * gap:5.1f} ms  "
                  f"prompt tokens {pf}")
