#!/usr/bin/env python3
"""`nightdraft bench levels` with mode auto's planner logged step by step: for every step it
observes, what was issued and what ran, the batch, the tokens committed, the wall time, the
prompt tokens fed, the drafter's catch-up, the acceptance estimate, and the bandit's view of
the step's bin (each arm's estimated mean loss in ms a token, its evidence, and the noise its
confidence bound uses), in the arms' order (`arms`).

    .venv/bin/python scripts/planner_log_levels.py --log PATH [bench levels arguments]

e.g. ``--log /tmp/c1.json --configs auto --paths in-process --concurrency 1 --repeats 1``. The
log covers the engine's whole life (the warm-ups included), in order; ``per_context`` (and
``policy_check``) are the planner's own record at the end. With several configurations of mode
auto (``auto,auto@KEY=VALUE``) each writes its own file, PATH with ``.NAME`` before the suffix.

Through the server (``--paths server``) the engine runs in tritonserver's process, out of this
one's reach step by step: what its planner wrote at unload (``Planner.stats()``: its counters,
each bin's plays and mean losses, the timeline of its decisions) is written to PATH with
``.server`` before the suffix, one entry per configuration.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import client.bench_compare as bench_compare  # noqa: E402
import client.bench_levels as bench_levels    # noqa: E402
import client.dynamic_server as dynamic_server  # noqa: E402


def logged(planner, log: list) -> None:
    """Wrap `planner.observe` so that every step appends its entry to `log`."""
    observe, bandit = planner.observe, planner.bandit

    def observe_and_log(issued, o):
        observe(issued, o)
        entry = {"issued": str(issued), "ran": str(o.ran) if o.ran is not None else None,
                 "batch": o.batch_size, "tokens": o.tokens_committed, "wall_ms": o.step_wall_s * 1e3,
                 "prefill_tokens": o.prefill_tokens, "catchup_ms": o.drafter_rebuild_s * 1e3,
                 "decoded": o.decoded, "alpha": planner.alpha_estimate()}
        ctx = planner._ctx                    # the bin of the step's decision
        if ctx in bandit._bins:
            means, counts, sigma, _ = bandit._estimates(ctx, bandit._bins[ctx])
            sigmas = sigma if isinstance(sigma, list) else [sigma] * len(means)
            entry.update(bin=str(ctx), mean_ms=[round(m * 1e3, 3) for m in means],
                         evidence=[round(c, 1) for c in counts],
                         noise_ms=[round(s * 1e3, 3) for s in sigmas])
        log.append(entry)

    planner.observe = observe_and_log


def main() -> int:
    ap = argparse.ArgumentParser(add_help=False)
    ap.add_argument("--log", required=True)
    args, rest = ap.parse_known_args()
    logs: dict[str, list] = {}
    build = bench_compare.build_engines

    def build_logged(bench_args, names):
        engines = build(bench_args, names)
        planned = [name for name, (engine, _) in engines.items() if engine.planner is not None]
        for name, (engine, _) in engines.items():
            if engine.planner is None:
                continue
            log = logs[name] = []
            logged(engine.planner, log)
            close = engine.close
            # one planner: PATH; several (auto beside its variants): PATH with .NAME before the suffix
            path = Path(args.log)
            if len(planned) > 1:
                path = path.with_name(f"{path.stem}.{name}{path.suffix}")

            def close_and_write(close=close, engine=engine, name=name, log=log, path=path):
                stats = engine.planner.stats()
                path.write_text(json.dumps({
                    "config": name, "arms": [str(a) for a in engine.planner.arms],
                    "per_context": stats["per_context"], "policy_check": stats["policy_check"],
                    "log": log}, default=str) + "\n")
                close()
            engine.close = close_and_write
        return engines

    bench_levels.build_engines = build_logged
    server_summaries: dict[str, dict] = {}
    serve = dynamic_server.serving

    @contextlib.contextmanager
    def serving_and_summary(engine_config, *rest):
        with serve(engine_config, *rest) as served:
            yield served
        if served.planner_summary:
            name = f"{engine_config.get('mode', 'ar')}-{len(server_summaries)}"
            server_summaries[name] = served.planner_summary
            path = Path(args.log)
            path.with_name(f"{path.stem}.server{path.suffix}").write_text(
                json.dumps(server_summaries, default=str) + "\n")

    dynamic_server.serving = serving_and_summary
    from client.cli import main as cli
    return cli(["bench", "levels", *rest])


if __name__ == "__main__":
    sys.exit(main())
