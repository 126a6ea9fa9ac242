"""The table of README.md, from the runs' JSON files here: per run, adaptive's goals against SD
and, per repeat, its offload (promised and delivered speed-up, seconds from the first weigh,
whether a settled probe ran), and the high phase's share of arrivals meeting both targets by
quarter, adaptive against SD.

    python benchmarks/results/offload-settled/summary.py
"""
import json
import statistics
from pathlib import Path

HERE = Path(__file__).parent


def quarters(cfg: dict) -> str:
    runs = [r["phases"][1]["met_by_quarter"] for r in cfg["runs"]]
    return " / ".join(", ".join(f"{q:.2f}" for q in r) for r in runs)


def main() -> None:
    rows = {"before": [], "after": []}
    print("| run | goodput / SD | worst phase / its best | e2e / SD | offloads: promised, delivered, s after the first weigh, probed | high phase met, adaptive | high phase met, SD |")
    print("|---|---|---|---|---|---|---|")
    for side in ("before", "after"):
        for f in sorted(HERE.glob(f"{side}*.json")):
            d = json.loads(f.read_text())
            g = d["goals"]["adaptive"]
            rows[side].append(g)
            offloads = []
            claims = [s["memory"] for s in d["configs"]["adaptive"]["planner_summaries"]]
            for m in claims:
                for w in m.get("offload_weighings", []):
                    c = (m.get("offload_claims") or [{}])[-1] if w["paid_after_s"] is not None else {}
                    promised = c.get("predicted_gain")
                    delivered = (c["baseline_s_per_token"] / c["delivered_s_per_token"]
                                 if c.get("delivered_s_per_token") else None)
                    offloads.append("none" if w["paid_after_s"] is None else
                                    f"{promised:.2f}, {delivered:.2f}, {w['paid_after_s']:.1f} s"
                                    + (", probed" if w.get("probed") else ""))
            print(f"| {f.stem} | {g['goodput_vs_best_fixed']:.2f} | {g['worst_phase_goodput_vs_best_fixed']:.2f} "
                  f"| {g['e2e_vs_sd']:.2f} | {'; '.join(offloads)} | {quarters(d['configs']['adaptive'])} "
                  f"| {quarters(d['configs']['sd'])} |")
    for side, gs in rows.items():
        gs = gs[1:] if side == "after" else gs       # after1 ran without the probe
        print(f"{side}: medians goodput {statistics.median(x['goodput_vs_best_fixed'] for x in gs):.2f}, "
              f"worst phase {statistics.median(x['worst_phase_goodput_vs_best_fixed'] for x in gs):.2f}, "
              f"e2e {statistics.median(x['e2e_vs_sd'] for x in gs):.2f} over {len(gs)} runs")


if __name__ == "__main__":
    main()
