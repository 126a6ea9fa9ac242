"""PSD's share of 1,200 steps in the PSD-fill sim of
`test_psd_that_beats_sd_but_fills_its_pipeline_on_every_entry_is_still_chosen`, 16 seeds,
without the acceptance probe and with it. Needs `acceptance_probe.diff` applied; from the
checkout: `PYTHONPATH=$PWD python benchmarks/results/acceptance-probe/sims/psd_fill_share.py`."""
import sys
from collections import Counter

sys.path.insert(0, "tests")
from helpers.planner_sim import ServerCosts, ServerSim  # noqa: E402
from backend.mode import Mode  # noqa: E402
from planner import Planner, PlannerConfig  # noqa: E402

costs = ServerCosts(d0=0.002)
for probe in (0, 32):
    shares = []
    for seed in range(16):
        p = Planner(PlannerConfig(alpha_probe_sequences=probe), gamma_max=6, psd_available=True,
                    cost_profile=costs.calibration(), seed=seed)
        sim = ServerSim(p, costs, seed=seed, psd_fill_s=0.006)
        modes = Counter(sim.step(4, queue_growth=0.0)[0].mode for _ in range(1200))
        shares.append(round(modes[Mode.PSD] / 1200, 2))
    print(f"alpha_probe_sequences={probe}: mean {sum(shares) / len(shares):.2f}, lowest {min(shares)}:", shares)
