"""`nightdraft bench profile` of an earlier commit and of this checkout, interleaved, with the
medians and ranges of each row: the executor's before/after figures in docs/benchmarks.md.

    .venv/bin/python scripts/profile_before_after.py BEFORE_COMMIT [--repeats 2] [--out DIR]

The earlier commit is checked out in a git worktree and run with this checkout's virtual
environment (its code first on PYTHONPATH); each repeat runs the earlier commit, then this one.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NIGHTDRAFT = ROOT / ".venv" / "bin" / "nightdraft"


def run_profile(tree: Path, out: Path) -> None:
    env = os.environ | {"PYTHONPATH": str(tree)}
    print(f"bench profile in {tree} -> {out}", file=sys.stderr, flush=True)
    subprocess.run([str(NIGHTDRAFT), "bench", "profile", "--json", str(out)], cwd=tree, env=env, check=True,
                   stdout=subprocess.DEVNULL)


def summary(before: list[Path], after: list[Path]) -> str:
    def rows(paths):
        got: dict[tuple, list[dict]] = {}
        for p in paths:
            for r in json.loads(p.read_text())["rows"]:
                got.setdefault((r["config"], r["concurrency"]), []).append(r)
        return got

    def med(rs, key):
        v = [r[key] for r in rs if r.get(key) is not None]
        return f"{statistics.median(v):.2f} ({min(v):.2f}-{max(v):.2f})" if v else ""

    b, a = rows(before), rows(after)
    lines = ["| mode | c | tok/s before | tok/s after | after / before | step/floor before | step/floor after "
             "| step/(floor + K/V) after | drafter step/floor before | drafter step/floor after "
             "| overlap before | overlap after |", "|" + "---|" * 12]
    for key in a:
        ratios = [x["tokens_per_s"] / y["tokens_per_s"] for x, y in zip(a[key], b[key])]
        tb = statistics.median(r["tokens_per_s"] for r in b[key])
        ta = statistics.median(r["tokens_per_s"] for r in a[key])
        lines.append(f"| {key[0]} | {key[1]} | {tb:.0f} | {ta:.0f} | {statistics.median(ratios):.2f} "
                     f"({min(ratios):.2f}-{max(ratios):.2f}) | {med(b[key], 'step_over_floor')} "
                     f"| {med(a[key], 'step_over_floor')} | {med(a[key], 'step_over_full_floor')} "
                     f"| {med(b[key], 'drafter_step_over_floor')} | {med(a[key], 'drafter_step_over_floor')} "
                     f"| {med(b[key], 'overlap')} | {med(a[key], 'overlap')} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("before", help="the earlier commit")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "profile-before-after"))
    args = ap.parse_args()
    out = Path(args.out).resolve()     # the earlier commit runs in its own tree
    out.mkdir(parents=True, exist_ok=True)
    tree = Path(os.environ.get("TMPDIR", "/tmp")) / f"nightdraft-{args.before[:12]}"
    if not tree.exists():
        subprocess.run(["git", "worktree", "add", "--detach", str(tree), args.before], cwd=ROOT, check=True)
    before, after = [], []
    for r in range(1, args.repeats + 1):
        before.append(out / f"before-{r}.json")
        run_profile(tree, before[-1])
        after.append(out / f"after-{r}.json")
        run_profile(ROOT, after[-1])
    table = summary(before, after)
    (out / "summary.md").write_text(f"before: {args.before}\n\n{table}\n")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
