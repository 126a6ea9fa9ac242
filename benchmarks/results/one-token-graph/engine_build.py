"""What one graph per token count saves an engine: builds mode auto beside a CPU drafter with
its core lent to plain decoding (the target's step compiled at one thread and again on the lent
cores, the drafter's in its worker), compile on, the cost profile off (no calibration), and
prints the build's seconds, the graphs compiled in this process, and the process's anonymous
memory gained. Run from the checkout to measure, in a fresh process:

    cd CHECKOUT && TORCHINDUCTOR_CACHE_DIR=DIR PYTHONPATH=$PWD python $REPO/benchmarks/results/one-token-graph/engine_build.py
"""
import time

from backend.engine.config import EngineConfig
from backend.engine.engine import Engine
from backend.model.captured import compiled_graphs
from memory import anonymous_mib        # this folder's memory.py (the script's folder is on the path)


if __name__ == "__main__":
    before = anonymous_mib()
    t0 = time.perf_counter()
    engine = Engine(EngineConfig(target="models/tiny-target", drafter="models/tiny-drafter", mode="auto",
                                 drafter_device="cpu", num_threads=1, kv_cache_bytes=16 << 20, compile="on",
                                 planner_cost_profile="off", lend_drafter_cores=True))
    try:
        print(f"built in {time.perf_counter() - t0:.1f} s; graphs in this process {compiled_graphs()}; "
              f"+{anonymous_mib() - before:.0f} MiB")
    finally:
        engine.close()
