"""Time to first token of one request at a time (max_tokens 1: the prompt's forward and one
token), plain decoding and fixed SD, compile auto, prompts of several lengths; medians of rounds."""
import json, statistics, sys, time
from backend.engine.config import EngineConfig
from backend.engine.engine import Engine
from backend.sampling.params import SamplingParams
from backend.model.tokenizer import Tokenizer

def main():
  text = open("README.md").read()
  tok = Tokenizer.from_pretrained("models/tiny-target")
  ids = tok.encode(text)
  LENGTHS = [20, 60, 200, 500]
  prompts = {n: tok.decode(ids[1000:1000 + n]) for n in LENGTHS}
  one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
  out = {}
  for mode in sys.argv[2].split(","):
      kw = dict(drafter="models/tiny-drafter", drafter_device="cpu", gamma=4) if mode == "sd" else {}
      e = Engine(EngineConfig(target="models/tiny-target", mode=mode, **kw))
      try:
          for n, p in prompts.items():
              e.generate([p], one)
          for rnd in range(8):
              for n, p in prompts.items():
                  t0 = time.perf_counter()
                  e.generate([p], one)
                  out.setdefault(f"{mode} {n}", []).append(time.perf_counter() - t0)
      finally:
          e.close()
  json.dump(out, open(sys.argv[1], "w"))
  for k, v in out.items():
      print(k, f"{1e3 * statistics.median(v):.2f} ms")


if __name__ == "__main__":
    main()
