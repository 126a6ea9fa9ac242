"""The bin of tests/helpers/outlier_bin.py (SD calibrated on one early step, its evidence spent
by a shift) with the thin-calibration rule of `thin.diff` (applied first) off (`thin_plays` 0) and at the planner's default:
per seed, SD's share of the last 500 of 2,000 steps where SD truly costs 0.85x plain decoding
(its one step an outlier at twice its prior), and SD's steps of 2,000 where it truly costs 1.3x
(its one step at that).

    python benchmarks/results/planner-scores/thin-calibration/thin_sim.py
"""
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[4] / "tests"))
from helpers.outlier_bin import run_after_outlier  # noqa: E402
from planner.config import PLANNER_BANDIT  # noqa: E402

for thin in (0, PLANNER_BANDIT.thin_plays):
    cfg = replace(PLANNER_BANDIT, thin_plays=thin)
    wins, losses = [], []
    for seed in range(8):
        played = run_after_outlier(cfg, seed)
        wins.append(sum(a[0] == "sd" for a in played[-500:]) / 500)
        losses.append(sum(a[0] == "sd" for a in run_after_outlier(cfg, seed, sd_over_plain=1.3, outlier=None)))
    print(f"thin_plays {thin}: SD at 0.85x after an outlier, its share of the last 500 steps by seed "
          f"{[round(w, 2) for w in wins]}; SD at 1.3x, its steps of 2,000 by seed {losses}")
