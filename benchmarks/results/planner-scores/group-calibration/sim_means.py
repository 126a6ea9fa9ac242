"""PSD's mean share of the steps over every seed and fifth, for each psd_fill_sim-*.txt here.

    python benchmarks/results/planner-scores/group-calibration/sim_means.py
"""
import ast
from pathlib import Path

for path in sorted(Path(__file__).parent.glob("psd_fill_sim-*.txt")):
    shares = [s for line in path.read_text().splitlines() if "fifth" in line
              for s in ast.literal_eval(line.split("fifth ")[1])]
    worst = min(shares)
    print(f"{path.name}: PSD on {sum(shares) / len(shares):.3f} of the steps (worst fifth {worst:.2f})")
