"""Prints, from step_time.txt and memory.txt (this folder), each round's step time with one
graph for every token count over the two-graph step's, the medians, and the memory figures:

    python benchmarks/results/one-token-graph/ratios.py
"""
import re
import statistics
from pathlib import Path

HERE = Path(__file__).parent


def rounds(text: str) -> dict:
    """{(round, side): {shape: ms}} and compile seconds from step_time.txt."""
    out, key = {}, None
    for line in text.splitlines():
        if m := re.match(r"== (\d+) (\w+)", line):
            key = (int(m[1]), m[2])
            out[key] = {}
        elif m := re.match(r"compiled (\d+) graph\(s\) in ([\d.]+) s", line):
            out[key]["graphs"], out[key]["compile_s"] = int(m[1]), float(m[2])
        elif line.startswith("b1q1"):
            out[key] |= {s: float(v) for s, v in re.findall(r"(b\d+q\d+) ([\d.]+)", line)}
    return out


if __name__ == "__main__":
    runs = rounds((HERE / "step_time.txt").read_text())
    shapes = [s for s in runs[(1, "base")] if s.startswith("b")]
    print("new / base step time by round:")
    ratios = {s: [] for s in shapes}
    for r in sorted({r for r, _ in runs}):
        line = []
        for s in shapes:
            ratios[s].append(runs[(r, "new")][s] / runs[(r, "base")][s])
            line.append(f"{s} {ratios[s][-1]:.3f}")
        print(f"  round {r}: " + "  ".join(line))
    print("medians: " + "  ".join(f"{s} {statistics.median(v):.3f} ({min(v):.2f}-{max(v):.2f})"
                                  for s, v in ratios.items()))
    for side in ("base", "new"):
        fresh = runs[(1, side)]["compile_s"]
        warm = statistics.median(v["compile_s"] for (r, s), v in runs.items() if s == side and r > 1)
        print(f"{side}: {runs[(1, side)]['graphs']} graph(s) at one thread; compiled in {fresh:.1f} s "
              f"(fresh cache), median {warm:.1f} s (warm)")
    for line in (HERE / "memory.txt").read_text().splitlines():
        if line.startswith("=="):
            print(line[3:], end=": ")
        else:
            print(line)
