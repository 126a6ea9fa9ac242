import cProfile, pstats, time, statistics, torch, sys
from backend.speculation.drafter import Drafter
from backend.speculation.proposer import DraftRequest
from backend.sampling.params import SamplingParams

torch.set_num_threads(1)
d = Drafter.load("models/tiny-drafter", device="cpu", dtype=torch.float32, kv_cache_bytes=16 << 20,
                 block_size=16, seed=0, attention="paged", compile="auto", max_query_len=9)
p = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
def run(n_rounds, prof=None):
    times = []
    for s in range(4):
        sid = f"s{s}"
        toks = list(range(10, 40))
        req = DraftRequest(sid, toks, 4, p, start=0, num_prompt_tokens=30)
        length = 0
        for r in range(n_rounds):
            t0 = time.perf_counter()
            if prof: prof.enable()
            out = d.propose([req])[0]
            if prof: prof.disable()
            times.append(time.perf_counter() - t0)
            length += len(req.new_tokens)
            new = out.tokens[:2] + [7]          # two accepted and a bonus token
            req = DraftRequest(sid, new, 4, p, start=length, num_prompt_tokens=30)
        d.free(sid)
    return times
run(10)
t = run(40)
print("propose median ms %.3f" % (1e3 * statistics.median(t)))
prof = cProfile.Profile()
run(40, prof)
pstats.Stats(prof).sort_stats("tottime").print_stats(18)
