import time, statistics, torch, sys
from backend.model.kv_cache import PagedKVCache
from backend.model.loader import load_model
from backend.model.captured import CompiledStep
from decode_batch import decode_batch
torch.set_num_threads(1)
path, freeze = sys.argv[1], sys.argv[2] == "1"
m = load_model(path, attention="paged")
kv = PagedKVCache.for_model(m.config, 16 << 20, block_size=16)
with torch.inference_mode():
    step = CompiledStep(m, 9, freeze=freeze)
    step.warm_up(kv)
    for B in (1, 4, 16):
        ids, meta, it, idx = decode_batch(m, kv, B)
        ref = step(it, meta, kv.kv, idx)
        res = {}
        for rnd in range(6):
            for unsafe in ((False, True) if rnd % 2 else (True, False)):
                with torch.compiler.set_stance("default", skip_guard_eval_unsafe=unsafe):
                    ts = []
                    for r in range(100):
                        t0 = time.perf_counter(); out = step(it, meta, kv.kv, idx); ts.append(time.perf_counter() - t0)
                    assert torch.equal(out, ref)
                res.setdefault(unsafe, []).extend(ts[10:])
        a, b = (1e3 * statistics.median(res[u]) for u in (False, True))
        print(f"{path} B={B}: guards {a:.3f} ms, skipped {b:.3f} ms, {b/a:.2f}")
        for s in ids: kv.free(s)
