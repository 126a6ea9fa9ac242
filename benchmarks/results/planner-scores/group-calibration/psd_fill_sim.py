"""The planner's synthetic server at batch 4, where PSD's steady steps cost about 7 % less a token
than SD's and entering PSD costs a 6 ms fill (the sim of
tests/test_planner.py::test_psd_that_beats_sd_but_fills_its_pipeline_on_every_entry_is_still_chosen),
run for 3,000 steps a seed: PSD's share of the steps in each fifth of the run, per seed.

    python benchmarks/results/planner-scores/group-calibration/psd_fill_sim.py
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[4] / "tests"))
from backend.mode import Mode  # noqa: E402
from helpers.planner_sim import ServerCosts, ServerSim  # noqa: E402
from planner import Planner  # noqa: E402

costs = ServerCosts(d0=0.002)
for seed in range(8):
    p = Planner(gamma_max=6, psd_available=True, cost_profile=costs.calibration(), seed=seed)
    sim = ServerSim(p, costs, seed=seed, psd_fill_s=0.006)
    modes = [sim.step(4, queue_growth=0.0)[0].mode for _ in range(3000)]
    print(f"seed {seed}: PSD's share by fifth {[round(sum(m is Mode.PSD for m in modes[i:i + 600]) / 600, 2) for i in range(0, 3000, 600)]}")
