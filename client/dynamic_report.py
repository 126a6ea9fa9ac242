"""What `nightdraft bench dynamic` reports: per-phase metrics, medians over repeats, the
planner's regret, the table and the plot.

A request belongs to the phase it *arrived* in. A phase's throughput is its requests' tokens over
the time from the phase's start to the last of them finishing, so a configuration that falls
behind in the high phase is charged there, not credited in the next phase for draining its
backlog. Goodput counts, over the same time, only the tokens of requests that met both latency
targets (:class:`Targets`: TTFT and TPOT), as DistServe defines it: a configuration that keeps
its throughput by letting every request's latency slip loses goodput. A phase's mode shares are
the fraction of its time the engine spent in each arm (mode and gamma), from the timeline. With ``--repeats`` every metric is the median over the repeats, and the run-to-run spread
of the fixed configurations is the noise that the ratios are read against.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

from client.plotting import pyplot

METRICS = ("throughput_tok_s", "goodput_tok_s", "ttft_mean_s", "ttft_p50_s", "ttft_p99_s",
           "tpot_mean_s", "tpot_p50_s", "tpot_p99_s", "e2e_mean_s", "e2e_p99_s")
FIXED = ("ar", "ar_all_cores", "sd", "psd")
ADAPTIVE = ("adaptive", "adaptive_no_offload")


def adaptive_names(configs) -> list[str]:
    """The planner's configurations among `configs`: adaptive, adaptive_no_offload and their
    ``@KEY=VALUE`` variants (`client.bench_dynamic`), in their order."""
    return [n for n in configs if n.partition("@")[0] in ADAPTIVE]


@dataclass(frozen=True)
class Targets:
    """Latency objectives a request must meet for its tokens to count as goodput."""
    ttft_s: float = float("inf")
    tpot_s: float = float("inf")

    def met(self, ttft: float, tpot: float | None) -> bool:
        return ttft <= self.ttft_s and (tpot is None or tpot <= self.tpot_s)


@dataclass
class Record:
    phase: int
    arrival: float                 # seconds since the run's start
    first_token: float | None = None
    finish: float | None = None
    tokens: int = 0
    error: str | None = None


@dataclass
class RunResult:
    records: list[Record]
    phase_bounds: list[tuple[float, float]]
    timeline: list[dict] = field(default_factory=list)   # planner / engine state over time
    events: list[dict] = field(default_factory=list)     # offload / reload events
    switches: int = 0
    arm_counts: dict = field(default_factory=dict)
    planner_summary: dict = field(default_factory=dict)   # Planner.summary() at the end


def request_metrics(records: list[Record], start: float, end: float | None = None,
                    targets: Targets = Targets()) -> dict:
    done = [r for r in records if r.finish is not None and r.error is None]
    ttft = [r.first_token - r.arrival for r in done if r.first_token is not None]
    e2e = [r.finish - r.arrival for r in done]
    tpot = [_tpot(r) for r in done if _tpot(r) is not None]
    good = sum(r.tokens for r in done
               if r.first_token is not None and targets.met(r.first_token - r.arrival, _tpot(r)))
    last = max((r.finish for r in done), default=start)
    span = max(last, end or start) - start
    return {"requests": len(done), "failed": len(records) - len(done),
            "tokens": sum(r.tokens for r in done),
            "throughput_tok_s": sum(r.tokens for r in done) / span if span > 0 else 0.0,
            "goodput_tok_s": good / span if span > 0 else 0.0,
            "ttft_mean_s": _mean(ttft), "ttft_p50_s": _pct(ttft, 0.5), "ttft_p99_s": _p99(ttft),
            "tpot_mean_s": _mean(tpot), "tpot_p50_s": _pct(tpot, 0.5), "tpot_p99_s": _p99(tpot),
            "e2e_mean_s": _mean(e2e), "e2e_p99_s": _p99(e2e)}


def _tpot(r: Record) -> float | None:
    if r.first_token is None or r.finish is None or r.tokens < 2:
        return None
    return (r.finish - r.first_token) / (r.tokens - 1)


def mode_shares(timeline: list[dict], start: float, end: float) -> dict[str, float]:
    """The fraction of [start, end) spent in each arm ("ar", "sd3", "psd2", ...), each timeline
    entry's state holding until the next entry."""
    spent: dict[str, float] = {}
    for i, e in enumerate(timeline):
        lo = max(e["t"], start)
        hi = min(timeline[i + 1]["t"] if i + 1 < len(timeline) else end, end)
        if hi > lo:
            arm = "ar" if e["mode"] == "ar" or not e.get("gamma") else f"{e['mode']}{e['gamma']}"
            spent[arm] = spent.get(arm, 0.0) + hi - lo
    total = sum(spent.values())
    return {k: v / total for k, v in sorted(spent.items())} if total > 0 else {}


def met_by_quarter(records: list[Record], start: float, end: float,
                   targets: Targets = Targets()) -> list[float | None]:
    """Of the requests that arrived in each quarter of [start, end), the share that met the
    goodput targets (None: none arrived then). Under a step of overload the early arrivals
    can still meet a TTFT target and the late ones cannot: this tells a configuration that
    lost its goodput at the step (a slow reaction) from one that lost it to the queue after."""
    quarter = (end - start) / 4
    met, seen = [0] * 4, [0] * 4
    for r in records:
        if quarter <= 0 or not start <= r.arrival < end:
            continue
        q = min(int((r.arrival - start) / quarter), 3)
        seen[q] += 1
        ok = (r.finish is not None and r.error is None and r.first_token is not None
              and targets.met(r.first_token - r.arrival, _tpot(r)))
        met[q] += ok
    return [m / n if n else None for m, n in zip(met, seen)]


def summarise(run: RunResult, targets: Targets = Targets()) -> dict:
    phases = []
    for i, (lo, hi) in enumerate(run.phase_bounds):
        records = [r for r in run.records if r.phase == i]
        m = request_metrics(records, lo, hi, targets)
        m["mode_shares"] = mode_shares(run.timeline, lo, hi)
        m["met_by_quarter"] = met_by_quarter(records, lo, hi, targets)
        phases.append(m)
    first = min((r.arrival for r in run.records), default=0.0)
    overall = request_metrics(run.records, first, targets=targets)
    overall["mode_shares"] = mode_shares(run.timeline, first, run.phase_bounds[-1][1] if run.phase_bounds else first)
    return {"phases": phases, "overall": overall}


def median_summary(summaries: list[dict]) -> dict:
    """Metric by metric, the median over repeats (and the runs themselves, for the record)."""
    def med(rows: list[dict]) -> dict:
        out = {k: statistics.median(r[k] for r in rows) for k in METRICS}
        out["requests"] = rows[0]["requests"]
        out["tokens"] = min(r.get("tokens", 0) for r in rows)
        out["failed"] = max(r["failed"] for r in rows)
        arms = sorted({a for r in rows for a in r.get("mode_shares", {})})
        out["mode_shares"] = {a: statistics.fmean(r.get("mode_shares", {}).get(a, 0.0) for r in rows)
                              for a in arms}
        return out
    n_phases = len(summaries[0]["phases"])
    return {"phases": [med([s["phases"][i] for s in summaries]) for i in range(n_phases)],
            "overall": med([s["overall"] for s in summaries])}


def noise(runs: dict[str, list[dict]]) -> float | None:
    """Run-to-run spread of the fixed configurations: the median, over fixed configs, phases and
    metrics, of (max - min) / median across repeats. None with a single repeat."""
    spreads = []
    for name in FIXED:
        rs = runs.get(name, [])
        if len(rs) < 2:
            continue
        for part in range(len(rs[0]["phases"]) + 1):
            rows = [r["phases"][part] if part < len(r["phases"]) else r["overall"] for r in rs]
            for k in ("throughput_tok_s", "goodput_tok_s", "ttft_mean_s", "e2e_mean_s"):
                vals = [row[k] for row in rows]
                m = statistics.median(vals)
                if m > 0:
                    spreads.append((max(vals) - min(vals)) / m)
    return statistics.median(spreads) if spreads else None


def regret(configs: dict, n_phases: int) -> dict:
    """Adaptive against the fixed configurations: per phase against the best fixed one of that
    phase (throughput: higher is better, latencies: lower), overall against each."""
    fixed = [n for n in FIXED if n in configs]
    out = {}
    for name in adaptive_names(configs):
        if not fixed:
            continue
        rows = []
        for i in range(n_phases):
            a = configs[name]["phases"][i]
            row = {}
            for k, better in (("throughput_tok_s", max), ("goodput_tok_s", max), ("ttft_mean_s", min),
                              ("e2e_mean_s", min)):
                best = better(fixed, key=lambda n: configs[n]["phases"][i][k])
                ref = configs[best]["phases"][i][k]
                row[k] = {"best_fixed": best, "ratio": a[k] / ref if ref else None}
            rows.append(row)
        overall = {n: {k: (configs[name]["overall"][k] / configs[n]["overall"][k]
                           if configs[n]["overall"][k] else None)
                       for k in ("throughput_tok_s", "goodput_tok_s", "ttft_mean_s", "e2e_mean_s")}
                   for n in fixed}
        best_good = max(fixed, key=lambda n: configs[n]["overall"]["goodput_tok_s"])
        ref = configs[best_good]["overall"]["goodput_tok_s"]
        out[name] = {"per_phase": rows, "overall_vs": overall,
                     "goodput_vs_best_fixed": {"best_fixed": best_good, "ratio": (
                         configs[name]["overall"]["goodput_tok_s"] / ref if ref else None)}}
    return out


def goals(report: dict) -> dict:
    """The adaptive planner's goal rows (issue 16), from the medians: goodput over the whole run
    against the best fixed configuration's, the worst phase's goodput against that phase's best
    fixed, mean e2e against sequential SD's, and the worst phase's TTFT / e2e with offloading
    against without, with the offloads the planner made over the repeats (``offloads``; None
    where not recorded): at 0 the two configurations made the same choices, and the row is the
    runs' noise, not the offload's effect."""
    c, out = report["configs"], {}
    for name, r in report.get("regret", {}).items():
        per = [row["goodput_tok_s"]["ratio"] for row in r["per_phase"]]
        per = [x for x in per if x is not None]
        sd = r["overall_vs"].get("sd", {}).get("e2e_mean_s")
        out[name] = {"goodput_vs_best_fixed": r["goodput_vs_best_fixed"]["ratio"],
                     "worst_phase_goodput_vs_best_fixed": min(per) if per else None,
                     "e2e_vs_sd": sd}
    if all(n in c for n in ADAPTIVE):
        worst = {}
        for k in ("ttft_mean_s", "e2e_mean_s"):
            ratios = [a[k] / b[k] for a, b in zip(c["adaptive"]["phases"], c["adaptive_no_offload"]["phases"])
                      if b[k]]
            worst[k] = max(ratios) if ratios else None
        offloads = c["adaptive"].get("offloads")
        worst["offloads"] = sum(offloads) if offloads is not None else None
        out["offload_worst_phase"] = worst
    return out


def format_table(report: dict) -> str:
    head = (f"{'config':<20} {'phase':<8} {'tok/s':>7} {'good/s':>7} {'ttft':>7} {'ttft99':>7} "
            f"{'tpot':>7} {'tpot99':>7} {'e2e':>7} {'e2e99':>7}  arms")
    lines = [head, "-" * len(head)]
    names = [p["name"] for p in report["phases"]] + ["overall"]
    for cfg, res in report["configs"].items():
        for name, m in zip(names, res["phases"] + [res["overall"]]):
            arms = " ".join(f"{a}:{v:.0%}" for a, v in m.get("mode_shares", {}).items() if v >= 0.01)
            lines.append(f"{cfg:<20} {name:<8} {m['throughput_tok_s']:7.1f} {m['goodput_tok_s']:7.1f} "
                         f"{m['ttft_mean_s']:7.3f} {m['ttft_p99_s']:7.3f} {m['tpot_mean_s']:7.4f} "
                         f"{m['tpot_p99_s']:7.4f} {m['e2e_mean_s']:7.3f} {m['e2e_p99_s']:7.3f}  "
                         + (arms if cfg.startswith("adaptive") else "")
                         + (f"  ({m['failed']} failed)" if m.get("failed") else ""))
    t = report.get("targets") or {}
    if t:
        lines.append(f"goodput targets: TTFT <= {t['ttft_s']:.3f} s, TPOT <= {t['tpot_s']:.4f} s")
    nz = report.get("noise")
    lines.append(f"noise (run-to-run spread of fixed configs over {report.get('repeats', 1)} repeats): "
                 + (f"{nz:.0%}" if nz is not None else "unknown (use --repeats 2 or more)"))
    for name, r in report.get("regret", {}).items():
        lines.append(f"{name} / best fixed per phase:")
        for ph, row in zip(report["phases"], r["per_phase"]):
            lines.append("  " + f"{ph['name']:<5} " + ", ".join(
                f"{label} x{row[k]['ratio']:.2f} (vs {row[k]['best_fixed']})"
                for k, label in (("throughput_tok_s", "tok/s"), ("goodput_tok_s", "goodput"),
                                 ("ttft_mean_s", "TTFT"), ("e2e_mean_s", "e2e"))
                if row[k]["ratio"] is not None))
        lines.append(f"{name} / each fixed overall: " + ", ".join(
            f"{n}: tok/s x{v['throughput_tok_s']:.2f} e2e x{v['e2e_mean_s']:.2f}"
            for n, v in r["overall_vs"].items() if v["throughput_tok_s"] and v["e2e_mean_s"]))
    g = goals(report)
    for name in adaptive_names(report["configs"]):
        if name in g:
            x = g[name]
            lines.append(f"goals, {name}: goodput x{_fmt(x['goodput_vs_best_fixed'])} the best fixed "
                         f"(>= 1.15), worst phase x{_fmt(x['worst_phase_goodput_vs_best_fixed'])} its best "
                         f"fixed (>= 0.97), e2e x{_fmt(x['e2e_vs_sd'])} sd's (<= 0.85)")
    if "offload_worst_phase" in g:
        w = g["offload_worst_phase"]
        ratios = f"TTFT x{_fmt(w['ttft_mean_s'])}, e2e x{_fmt(w['e2e_mean_s'])}"
        if w.get("offloads") == 0:
            lines.append(f"offloading, worst phase against not offloading: no offload in any repeat, "
                         f"nothing to compare ({ratios} is the runs' noise)")
        else:
            lines.append(f"offloading, worst phase against not offloading: {ratios} (<= 1)")
    p = report.get("planner") or {}
    if p:
        lines.append(f"planner ({p['config']}, first repeat): {p['switches']} switches, "
                     f"{p['offloads']} offloads, {p['reloads']} reloads")
        for k, weighings in enumerate(p.get("offload_weighings") or [], 1):
            lines += [f"  repeat {k}, an overload weighed for an offload: {_weighing(w)}" for w in weighings]
    return "\n".join(lines)


def _weighing(w: dict) -> str:
    """One sustained overload's weighing (planner.offload_policy.OffloadWeighing) in a line."""
    short = ", ".join(f"{why} {n}" for why, n in w["short"].items() if n) or "nothing"
    left = (f"offloaded {w['paid_after_s']:.2f} s after the first weigh" if w["paid_after_s"] is not None
            else "the drafter stayed")
    if w.get("probed"):
        left = "plain decoding probed settled; " + left
    return (f"{w['weighs']} weighs, predicted gain {_fmt(w['gain_min'])} / {_fmt(w['gain_median'])} / "
            f"{_fmt(w['gain_max'])} (min / median / max), demand / capacity up to "
            f"{_fmt(w['demand_ratio_max'])}; short of: {short}; {left}")


def _fmt(x) -> str:
    return f"{x:.2f}" if x is not None else "-"


def draw(report: dict, path: str) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, (ax1, ax2, ax3) = plt.subplots(3, 1, figsize=(10, 8.5), sharex=False)
    palette = ["tab:red", "tab:blue", "tab:purple", "tab:brown", "tab:olive", "tab:cyan"]
    colours = {n: palette[k % len(palette)] for k, n in enumerate(adaptive_names(report["configs"]))}
    for name in colours:
        tl = report["configs"][name].get("timeline", [])
        if not tl:
            continue
        xs = [e["t"] for e in tl]
        ax1.step(xs, [e["gamma"] if e["mode"] != "psd" else -e["gamma"] for e in tl], where="post",
                 label=f"{name}: gamma (negative: psd)", color=colours[name], lw=0.8, alpha=0.8)
        ax2.step(xs, [e["running"] for e in tl], where="post", color=colours[name], lw=0.8,
                 label=f"{name}: running requests")
        ax2.step(xs, [e["waiting"] for e in tl], where="post", color=colours[name], lw=0.8, ls=":",
                 label=f"{name}: waiting requests")
        if any("kv_blocks" in e for e in tl):
            ax2.step(xs, [e.get("kv_blocks", 0) for e in tl], where="post", color=colours[name],
                     ls="--", lw=1.0, label=f"{name}: target KV blocks")
    for e in (report.get("planner") or {}).get("events", []):
        ax1.axvline(e["t"], color={"offload": "red", "reload_start": "orange"}.get(e["kind"], "green"),
                    ls=":", lw=1)
    for ax in (ax1, ax2):
        for ph in report["phases"]:
            ax.axvspan(ph["start_s"], ph["end_s"], alpha=0.06 if ph["name"] == "low" else 0.15, color="grey")
    ax1.set_ylabel("gamma")
    ax1.set_title("planner decisions (dotted: red offload, orange reload start, green reload done)")
    ax1.legend(fontsize=7, loc="upper right")
    ax2.set_ylabel("count")
    ax2.set_xlabel("seconds")
    ax2.legend(fontsize=7, loc="upper right")
    names = list(report["configs"])
    labels = [p["name"] for p in report["phases"]] + ["overall"]
    width = 0.8 / max(len(names), 1)
    for k, name in enumerate(names):
        res = report["configs"][name]
        vals = [p["e2e_mean_s"] for p in res["phases"]] + [res["overall"]["e2e_mean_s"]]
        ax3.bar([i + (k - (len(names) - 1) / 2) * width for i in range(len(labels))], vals,
                width=width, label=name)
    ax3.set_xticks(range(len(labels)), [f"{i + 1}: {n}" if n != "overall" else n
                                        for i, n in enumerate(labels)])
    ax3.set_ylabel("mean e2e latency (s)")
    ax3.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _mean(xs):
    return statistics.fmean(xs) if xs else 0.0


def _pct(xs, q):
    """The nearest-rank percentile: the smallest value with at least q of the values at or below."""
    return sorted(xs)[max(math.ceil(q * len(xs)) - 1, 0)] if xs else 0.0


def _p99(xs):
    return _pct(xs, 0.99)
