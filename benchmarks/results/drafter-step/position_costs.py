import time, statistics, torch, sys
from backend.model.kv_cache import PagedKVCache
from backend.model.loader import load_model
from backend.model.runner import ModelRunner, capture_for
from backend.model.captured import step_tensors
torch.set_num_threads(1)
m = load_model("models/tiny-drafter", attention="paged")
print(m.config)
kv = PagedKVCache.for_model(m.config, 16 << 20, block_size=16)
with torch.inference_mode():
    step = capture_for(m, kv, "on", "drafter", 9)
    r = ModelRunner(m, kv, step)
    B = int(sys.argv[1]) if len(sys.argv) > 1 else 1
    ids = [f"s{i}" for i in range(B)]
    T = {k: [] for k in ("forward_first", "advance", "argmax", "layout", "graph_call", "eager_call")}
    for rnd in range(30):
        for s in ids: assert kv.ensure_capacity(s, 100 + 8)
        t0 = time.perf_counter()
        logits = r.forward(ids, [90] * B, [1] * B, [5] * B, lookahead=3)
        T["forward_first"].append(time.perf_counter() - t0)
        rows = list(range(B))
        for g in range(3):
            t0 = time.perf_counter()
            tok = logits.argmax(-1).tolist()
            t1 = time.perf_counter()
            logits = r.advance(rows, tok)
            t2 = time.perf_counter()
            T["argmax"].append(t1 - t0); T["advance"].append(t2 - t1)
        # pieces of an advance
        meta = m.attention.advance(kv, r._meta, rows)
        t0 = time.perf_counter(); meta = m.attention.advance(kv, r._meta, rows); t1 = time.perf_counter()
        it = torch.tensor(tok); idx = meta.last_token_indices
        t2 = time.perf_counter(); step(it, meta, kv.kv, idx); t3 = time.perf_counter()
        m(it, meta, kv.kv, idx); t4 = time.perf_counter()
        T["layout"].append(t1 - t0); T["graph_call"].append(t3 - t2); T["eager_call"].append(t4 - t3)
        for s in ids: kv.free(s)
for k, v in T.items():
    print(f"{k:14s} median {1e3*statistics.median(v[5:]):.3f} ms")
