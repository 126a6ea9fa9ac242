import statistics, sys
from backend.engine.config import EngineConfig
from backend.engine.engine import Engine
from backend.sampling.params import SamplingParams

def main():
    e = Engine(EngineConfig(target="models/tiny-target", drafter="models/tiny-drafter", mode="sd", gamma=4,
                            **({"drafter_device": sys.argv[1]} if sys.argv[1] != "inproc" else {})))
    eng, wrk = [], []
    def on_step(_):
        s = e.stats().last_step
        if s.drafted and s.t_draft_s > 0:
            eng.append(s.t_draft_s); wrk.append(e.drafter.stats().last_propose_s)
    p = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    try:
        for _ in range(2):
            e.generate(["def add(a, b):\n", "import os\n", "class Stack:\n"], p, max_concurrency=1, on_step=on_step)
    finally:
        e.close()
    print(sys.argv[1], "steps", len(eng), "engine-side draft ms %.3f, worker-side propose ms %.3f, gap %.3f" % (
        1e3 * statistics.median(eng), 1e3 * statistics.median(wrk), 1e3 * statistics.median([a - b for a, b in zip(eng, wrk)])))

if __name__ == "__main__":
    main()
