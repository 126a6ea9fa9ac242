"""Per mode and prompt length: each side's median time to first token over every round's
requests (new over base), and the per-round ratios of the two sides' medians."""
import glob, json, re, statistics, sys
from collections import defaultdict
every = defaultdict(list)          # (side, key) -> seconds over all rounds
by_round = {}                      # (side, key, round) -> that round's median
for f in sorted(glob.glob(sys.argv[1] + "/*.json")):
    side, mode, rnd = re.match(r".*/(base|new)-(\w+)-(\d+)\.json", f).groups()
    for key, v in json.load(open(f)).items():
        every[(side, key)] += v
        by_round[(side, key, rnd)] = statistics.median(v)
keys = sorted({k[1] for k in every}, key=lambda k: (k.split()[0], int(k.split()[1])))
rounds = sorted({k[2] for k in by_round})
for key in keys:
    b, w = (1e3 * statistics.median(every[(s, key)]) for s in ("base", "new"))
    ratios = [by_round[("new", key, r)] / by_round[("base", key, r)] for r in rounds]
    mode, n = key.split()
    print(f"{mode:3s} {n:>4s} tokens: base {b:6.2f} ms, new {w:6.2f} ms, new / base {w / b:.2f} "
          f"(by round {' '.join(f'{x:.2f}' for x in ratios)})")
