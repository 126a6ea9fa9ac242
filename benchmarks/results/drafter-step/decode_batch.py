"""One decode forward's inputs at batch B (sequences of 90 cached tokens feeding one each), shared
by this folder's step timings."""
import torch


def decode_batch(model, kv, batch: int):
    """(ids, metadata, tokens, logits rows) for `batch` fresh sequences in `kv`; free the ids after."""
    ids = [f"s{i}" for i in range(batch)]
    for s in ids:
        assert kv.ensure_capacity(s, 100)
    meta = model.prepare(kv, ids, [90] * batch, [1] * batch, 0)
    return ids, meta, torch.full((batch,), 5), meta.last_token_indices
