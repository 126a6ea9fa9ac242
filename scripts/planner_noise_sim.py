#!/usr/bin/env python3
"""The planner's exploration on two synthetic paths, for the noise its confidence bounds use
(planner/bandit.py) and the acceptance's prior weight (planner/acceptance.py):

* **settling at batch 1**: the serving path of tests/helpers/planner_sim.py at batch 1, where
  SD at gamma 2-4 costs about 0.7x plain decoding a token, with the first `--rejected` drafts
  all rejected; how many of `--seeds` seeds still play plain decoding on most steps after the
  first third (of 1,500 steps); with `--prompted`, the same with no draft rejected but the
  first k speculative steps also feeding a prompt of `--prompt-tokens` tokens (a request joining
  in an engine's first steps, before the forward's cost line is fitted);
* **exploration's price**: the synthetic engine of tests/test_planner.py (`FakeEngine`) through
  phases of 2,500 steps at batch 2, 96 and 2 again; each phase's per-token cost over the
  per-step oracle's, the mean over `--seeds` seeds.

    .venv/bin/python scripts/planner_noise_sim.py [--seeds 30] [--rejected 3,4,5,6]
        [--prompted 2,3,4 --prompt-tokens 100,150] [--json F]

Runs the planner of the checkout it sits in (run a copy from another checkout to compare).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from helpers.planner_sim import speculative_share_at_batch_1   # noqa: E402
from planner import Planner                           # noqa: E402


def phases_over_oracle(seed: int) -> list[float]:
    from test_planner import FakeEngine, best_arm, profile, true_step
    p = Planner(gamma_max=6, psd_available=True, cost_profile=profile(), seed=seed)
    eng, rng, out = FakeEngine(p, seed=seed), np.random.default_rng(seed + 1), []
    for b, n in ((2, 2500), (96, 2500), (2, 2500)):
        wall, tokens, oracle = 0.0, 0, 0.0
        for _ in range(n):
            bb = max(1, b + int(rng.integers(-(b // 4), b // 4 + 1)))
            _, w, tok = eng.step(bb)
            wall, tokens = wall + w, tokens + tok
            a = best_arm(bb, p.arms)
            oracle += true_step(*a, bb)[0] / true_step(*a, bb)[1]
        out.append(wall / tokens / (oracle / n))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, default=30)
    ap.add_argument("--phase-seeds", type=int, default=6)
    ap.add_argument("--rejected", default="3,4,5,6")
    ap.add_argument("--prompted", default="",
                    help="comma-separated counts of first speculative steps that feed a prompt")
    ap.add_argument("--prompt-tokens", default="100,150")
    ap.add_argument("--json")
    args = ap.parse_args()
    result = {"settled_on_plain": {}, "phases_over_oracle": None}
    for k in (int(x) for x in args.rejected.split(",")):
        shares = [speculative_share_at_batch_1(s, k) for s in range(args.seeds)]
        stuck = sum(x < 0.5 for x in shares)
        result["settled_on_plain"][k] = stuck
        print(f"first {k} drafts rejected: {stuck}/{args.seeds} seeds on plain decoding "
              "after the first third", flush=True)
    if args.prompted:
        result["settled_on_plain_prompted"] = {}
        for pt in (int(x) for x in args.prompt_tokens.split(",")):
            for k in (int(x) for x in args.prompted.split(",")):
                shares = [speculative_share_at_batch_1(s, 0, prompted=k, prompt_tokens=pt)
                          for s in range(args.seeds)]
                stuck = sum(x < 0.5 for x in shares)
                result["settled_on_plain_prompted"][f"{k}x{pt}"] = stuck
                print(f"first {k} speculative steps feeding {pt} prompt tokens: {stuck}/{args.seeds}"
                      " seeds on plain decoding after the first third", flush=True)
    runs = [phases_over_oracle(s) for s in range(args.phase_seeds)]
    result["phases_over_oracle"] = [round(float(x), 3) for x in np.mean(runs, axis=0)]
    print("per-token cost over the oracle's, phases at batch 2 / 96 / 2 "
          f"(mean of {args.phase_seeds} seeds): " + " / ".join(f"{x:.3f}" for x in result["phases_over_oracle"]))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
