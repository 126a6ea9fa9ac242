import time, statistics, torch, sys
import torch._inductor.config as ic
from backend.model.kv_cache import PagedKVCache
from backend.model.loader import load_model
from backend.model.captured import CompiledStep
from decode_batch import decode_batch
torch.set_num_threads(1)
path, freeze, wrap = sys.argv[1], sys.argv[2] == "1", sys.argv[3] == "1"
ic.cpp_wrapper = wrap
m = load_model(path, attention="paged")
kv = PagedKVCache.for_model(m.config, 16 << 20, block_size=16)
with torch.inference_mode():
    step = CompiledStep(m, 9, freeze=freeze)
    t0 = time.perf_counter(); step.warm_up(kv); print("compile s %.1f" % (time.perf_counter() - t0))
    res = {}
    for B in (1, 4, 16):
        ids, meta, it, idx = decode_batch(m, kv, B)
        ref = m(it, meta, kv.kv, idx)
        out = step(it, meta, kv.kv, idx)
        ts = []
        for r in range(300):
            t0 = time.perf_counter(); step(it, meta, kv.kv, idx); ts.append(time.perf_counter() - t0)
        print(f"B={B} step median {1e3*statistics.median(ts[50:]):.3f} ms, max diff {(out-ref).abs().max().item():.1e}")
        for s in ids: kv.free(s)
