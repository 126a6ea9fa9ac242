"""Time to first token of one request at a time (max_tokens 1: the prompt's forward and one
token), plain decoding or fixed SD (drafter a CPU worker), compile auto, prompts of several
lengths; eight rounds after one untimed pass, written as JSON and printed as medians.

    cd CHECKOUT && PYTHONPATH=$PWD python benchmarks/results/captured-prompts/ttft.py OUT.json ar|sd
"""
import json
import statistics
import sys
import time

from backend.engine.config import EngineConfig
from backend.engine.engine import Engine
from backend.model.tokenizer import Tokenizer
from backend.sampling.params import SamplingParams

LENGTHS = [20, 60, 200, 500]


def main():
    out_path, modes = sys.argv[1], sys.argv[2].split(",")
    tok = Tokenizer.from_pretrained("models/tiny-target")
    ids = tok.encode(open("README.md").read())
    prompts = {n: tok.decode(ids[1000:1000 + n]) for n in LENGTHS}
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    out = {}
    for mode in modes:
        kw = dict(drafter="models/tiny-drafter", drafter_device="cpu", gamma=4) if mode == "sd" else {}
        engine = Engine(EngineConfig(target="models/tiny-target", mode=mode, **kw))
        try:
            for p in prompts.values():
                engine.generate([p], one)
            for _ in range(8):
                for n, p in prompts.items():
                    t0 = time.perf_counter()
                    engine.generate([p], one)
                    out.setdefault(f"{mode} {n}", []).append(time.perf_counter() - t0)
        finally:
            engine.close()
    json.dump(out, open(out_path, "w"))
    for key, seconds in out.items():
        print(key, f"{1e3 * statistics.median(seconds):.2f} ms")


if __name__ == "__main__":
    main()
