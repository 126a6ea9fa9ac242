#!/usr/bin/env python3
"""Build nightdraft's bundled tiny model pair: a ~7M-parameter Llama *target* and a ~1.4M-parameter
Llama *drafter* that share one byte-level BPE tokenizer, for speculative decoding on a CPU.

    make tiny-models          # == .venv/bin/python scripts/make_tiny_models.py --out models

Phases (each a function below, each timed into the manifest):
  1. corpus     the Python standard library's own .py files (no test folders), sorted by path;
                every 25th file is held out, whole, for evaluation
  2. tokenizer  byte-level BPE, 4096 tokens, <|endoftext|> = EOS and file separator
  3. target     LlamaForCausalLM, hidden 256 x 8 layers, GQA 8q/4kv heads, trained on 256-token windows
  4. drafter    LlamaForCausalLM, hidden 128 x 2 layers, trained briefly on the data, then distilled
                (forward KL) from the *saved* target, so it learns to agree with the model it drafts for
  5. evaluate   both checkpoints re-loaded from disk in float32 (the figures describe what is saved):
                acceptance, tokens per target call, drafter/target cost, sample continuations
  6. manifest   models/manifest.json and models/README.md

Everything is seeded and runs with a fixed thread count; on the same CPU and torch build the same
corpus gives the same weights. Nothing is downloaded: the corpus is on disk, models start from scratch.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import shutil
import statistics
import sys
import sysconfig
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

# Never reach for the model hub: every from_pretrained below reads a local directory.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

EOS = "<|endoftext|>"
VOCAB_SIZE = 4096
SEQ_LEN = 256            # training / evaluation window
MAX_POSITIONS = 1024
HOLDOUT_EVERY = 25       # every 25th file (by sorted path) is held out
EXCLUDED_DIRS = {"test", "tests", "idle_test", "site-packages"}  # test/, */tests, idlelib/idle_test, ...
LOOP_NGRAM = 8           # a position is "repeated" if its token completes an 8-gram seen earlier in the window
GAMMA = 4                # draft length the figures are quoted at

COMMON_CONFIG = dict(
    vocab_size=VOCAB_SIZE,
    max_position_embeddings=MAX_POSITIONS,
    rope_theta=10000.0,
    rms_norm_eps=1e-6,
    hidden_act="silu",
    attention_bias=False,
    mlp_bias=False,
    initializer_range=0.02,
)
# Target: 6.85M parameters with tied embeddings (untied would be 7.9M, past the 6-7M brief).
TARGET_ARCH = dict(hidden_size=256, intermediate_size=688, num_hidden_layers=8,
                   num_attention_heads=8, num_key_value_heads=4, head_dim=32, tie_word_embeddings=True)
# Drafter: 2 layers keep its per-token cost low; an untied LM head is only +0.5M parameters and gives
# the shallow model an output embedding free to differ from its input one.
DRAFTER_ARCH = dict(hidden_size=128, intermediate_size=344, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=False)


def log(msg: str) -> None:
    print(msg, flush=True)


class Clock:
    """Wall time since start, and per phase (for the manifest)."""

    def __init__(self) -> None:
        self.t0 = time.time()
        self.phases: dict[str, float] = {}

    def elapsed(self) -> float:
        return time.time() - self.t0

    @contextmanager
    def phase(self, name: str):
        start = time.time()
        log(f"\n=== {name} (t={self.elapsed():.0f}s) ===")
        yield
        self.phases[name] = round(time.time() - start, 1)
        log(f"=== {name} done in {self.phases[name]:.1f}s ===")


def sha256_file(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# --------------------------------------------------------------------------------------------------
# 1. corpus
# --------------------------------------------------------------------------------------------------
@dataclass
class Corpus:
    paths: list[str]                 # relative to the stdlib dir, '/'-separated, sorted
    texts: list[str]
    heldout: list[int]               # indices into paths
    sha256: str                      # of all files' bytes concatenated in sorted-path order
    n_bytes: int
    stdlib_dir: str

    @property
    def train_texts(self) -> list[str]:
        held = set(self.heldout)
        return [t for i, t in enumerate(self.texts) if i not in held]


def collect_corpus() -> Corpus:
    root = Path(sysconfig.get_paths()["stdlib"])
    rels = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        rel_dir = Path(dirpath).relative_to(root)
        if EXCLUDED_DIRS & set(rel_dir.parts):
            continue
        rels += [(rel_dir / f).as_posix() for f in filenames if f.endswith(".py")]
    rels.sort()  # by relative path: the order (and so the held-out split) is the same everywhere
    digest, texts, n_bytes = hashlib.sha256(), [], 0
    for rel in rels:
        raw = (root / rel).read_bytes()
        digest.update(raw)
        n_bytes += len(raw)
        texts.append(raw.decode("utf-8", errors="replace"))  # the stdlib is all UTF-8 today
    heldout = [i for i in range(len(rels)) if i % HOLDOUT_EVERY == HOLDOUT_EVERY - 1]
    return Corpus(rels, texts, heldout, digest.hexdigest(), n_bytes, str(root))


def is_generated_table(rel: str, text: str) -> bool:
    """Machine-generated data files (charmap codec tables, pydoc topic dump): very repetitive, so
    their positions are reported separately from the ordinary code ones."""
    return (rel.startswith("encodings/") and "Python Character Mapping Codec" in text) or \
        rel.startswith("pydoc_data/")


# --------------------------------------------------------------------------------------------------
# 2. tokenizer
# --------------------------------------------------------------------------------------------------
def train_tokenizer(train_texts: list[str]):
    """Byte-level BPE (GPT-2 style pre-tokenisation, no added prefix space) so that any string
    round-trips: decode(encode(x)) == x. Trained on the training files only. The trainer's merges
    are a deterministic function of the input order (checked: same sha256 across processes)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=[EOS],                                 # id 0
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # all 256 bytes: nothing is unknown
        show_progress=False,
    )
    tok.train_from_iterator(train_texts, trainer, length=len(train_texts))
    assert tok.get_vocab_size() == VOCAB_SIZE, tok.get_vocab_size()
    for probe in ["  x\t= 1\r\n", "héllo wörld 🙂 日本語\n", " def f(a, *b):\n    return a  # ok\n", ""]:
        assert tok.decode(tok.encode(probe).ids) == probe, repr(probe)
    return tok


def write_tokenizer_files(tok, out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    eos_id = tok.token_to_id(EOS)
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": EOS,
        "bos_token": EOS,
        "model_max_length": MAX_POSITIONS,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,  # would break the exact round trip
        "added_tokens_decoder": {
            str(eos_id): {"content": EOS, "lstrip": False, "normalized": False, "rstrip": False,
                          "single_word": False, "special": True},
        },
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2) + "\n")


def encode_docs(tok, texts: list[str]) -> list[np.ndarray]:
    return [np.asarray(e.ids, dtype=np.int64) for e in tok.encode_batch(texts, add_special_tokens=False)]


def make_stream(docs: list[np.ndarray], eos_id: int) -> torch.Tensor:
    """One long token stream: every file preceded by <|endoftext|>, as a served prompt after EOS."""
    parts = []
    for d in docs:
        parts += [np.asarray([eos_id]), d]
    return torch.from_numpy(np.concatenate(parts))


# --------------------------------------------------------------------------------------------------
# 3./4. models and training
# --------------------------------------------------------------------------------------------------
def build_model(arch: dict, eos_id: int, seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**COMMON_CONFIG, **arch, bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=None)
    torch.manual_seed(seed)  # the initial weights depend on this seed only
    model = LlamaForCausalLM._from_config(cfg, attn_implementation="sdpa")
    return model.float()


def n_params(model) -> int:
    return sum(p.numel() for p in model.parameters())  # tied weights are counted once


def sample_batch(stream: torch.Tensor, batch: int, seq: int, gen: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, len(stream) - seq - 1, (batch,), generator=gen)
    return torch.stack([stream[s:s + seq + 1] for s in starts.tolist()])


def lr_at(step: int, total: int, peak: float, warmup: int, floor: float = 0.1) -> float:
    """Linear warm-up, then cosine decay to floor*peak."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))


def train_phase(name: str, model, stream: torch.Tensor, steps: int, *, peak_lr: float, warmup: int,
                seed: int, batch: int, clock: Clock, teacher=None, log_every: int = 25) -> dict:
    """AdamW on random 256-token windows, bf16 autocast (about 2x fp32 speed on this CPU; the master
    weights and the optimiser state stay fp32). Without a teacher the loss is next-token cross-entropy;
    with one it is KL(teacher || student) over the whole vocabulary, i.e. the student is pulled towards
    the target's full next-token distribution, which is what speculative acceptance measures."""
    gen = torch.Generator().manual_seed(seed)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=peak_lr, betas=(0.9, 0.95), eps=1e-8)
    model.train()
    t_start, ema, losses, step_times, loads = time.time(), None, [], [], []
    for step in range(steps):
        t_step = time.time()
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, peak_lr, warmup)
        x = sample_batch(stream, batch, SEQ_LEN, gen)
        inputs, labels = x[:, :-1], x[:, 1:]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            if teacher is not None:
                with torch.no_grad():
                    t_logits = teacher(input_ids=inputs).logits
            logits = model(input_ids=inputs).logits
        logits = logits.float().reshape(-1, VOCAB_SIZE)
        if teacher is None:
            loss = F.cross_entropy(logits, labels.reshape(-1))
        else:
            loss = F.kl_div(F.log_softmax(logits, -1), F.log_softmax(t_logits.float().reshape(-1, VOCAB_SIZE), -1),
                            log_target=True, reduction="batchmean")
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        value = loss.item()
        losses.append(value)
        step_times.append(time.time() - t_step)
        ema = value if ema is None else 0.95 * ema + 0.05 * value
        if (step + 1) % log_every == 0 or step + 1 == steps:
            spent = time.time() - t_start
            per = spent / (step + 1)
            loads.append(os.getloadavg()[0])  # other jobs on the machine slow every step down
            log(f"[{name}] step {step + 1:5d}/{steps} loss {value:.3f} (ema {ema:.3f}) "
                f"lr {opt.param_groups[0]['lr']:.2e}  {per:.2f}s/step  phase {spent:.0f}s "
                f"eta {per * (steps - step - 1):.0f}s  total {clock.elapsed():.0f}s  load {loads[-1]:.1f}")
    model.eval()
    tail = losses[-max(1, min(50, len(losses) // 5)):]
    return {"steps": steps, "peak_lr": peak_lr, "warmup": warmup, "batch": batch, "seq_len": SEQ_LEN,
            "seed": seed, "final_loss_mean_last": round(float(np.mean(tail)), 4),
            # wall seconds per step; the 10th percentile is the speed of an unshared CPU
            "step_s_median": round(float(np.median(step_times)), 3),
            "step_s_p10": round(float(np.percentile(step_times, 10)), 3),
            "load_avg_mean": round(float(np.mean(loads)), 2),
            "loss": "kl(target||drafter)" if teacher is not None else "cross_entropy"}


def save_checkpoint(model, out_dir: Path, tok) -> None:
    """bfloat16 safetensors + config.json (with torch_dtype for transformers-4 era readers, rope_theta
    at top level too) + the shared tokenizer files. Written into a sibling staging directory and then
    swapped in, so a server or benchmark reading out_dir never sees a half-written checkpoint."""
    stage = out_dir.with_name(out_dir.name + ".new")
    shutil.rmtree(stage, ignore_errors=True)
    model = model.to(torch.bfloat16)
    model.save_pretrained(stage, safe_serialization=True)
    (stage / "model.safetensors").chmod(0o644)  # written 0600 via a temp file; make it world-readable
    cfg_path = stage / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["torch_dtype"] = "bfloat16"
    cfg["dtype"] = "bfloat16"
    cfg.setdefault("rope_theta", cfg.get("rope_parameters", {}).get("rope_theta", 10000.0))
    assert cfg["eos_token_id"] == tok.token_to_id(EOS) and cfg["bos_token_id"] == tok.token_to_id(EOS)
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    write_tokenizer_files(tok, stage)
    old = out_dir.with_name(out_dir.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if out_dir.exists():
        out_dir.rename(old)
    stage.rename(out_dir)
    shutil.rmtree(old, ignore_errors=True)


def load_checkpoint(path: Path, dtype=torch.float32):
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(str(path), dtype=dtype, attn_implementation="sdpa").eval()


# --------------------------------------------------------------------------------------------------
# 5. evaluation (on the saved checkpoints, float32)
# --------------------------------------------------------------------------------------------------
def repeated_positions(window: list[int], n: int = LOOP_NGRAM) -> list[bool]:
    """flag[e] is True when token e completes an n-gram that already ended earlier in the window:
    verbatim-repeated spans (tables, boilerplate, loops) a model can copy from its context."""
    seen, flags = set(), [False] * len(window)
    for e in range(n - 1, len(window)):
        gram = tuple(window[e - n + 1:e + 1])
        flags[e] = gram in seen
        seen.add(gram)
    return flags


@torch.no_grad()
def eval_teacher_forced(target, drafter, corpus: Corpus, heldout_docs: list[np.ndarray], eos_id: int,
                        max_windows_per_doc: int | None = None) -> dict:
    """Every held-out file as (EOS + file) cut into 256-token windows; at every position both models
    see the same true prefix. Reports, per subset of positions:
      greedy   fraction where argmax drafter == argmax target (greedy speculative acceptance)
      sampling mean over positions of sum_x min(p(x), q(x)) at temperature 1 (acceptance of
               speculative sampling, Leviathan et al. / Chen et al.)
      plus each model's cross-entropy on the true next token."""
    subsets = ("all", "code_only", "loop_free", "code_loop_free")
    acc = {s: dict(n=0, greedy=0.0, sampling=0.0, ce_t=0.0, ce_d=0.0, top1_t=0.0) for s in subsets}
    for doc_i, ids in zip(corpus.heldout, heldout_docs):
        rel, text = corpus.paths[doc_i], corpus.texts[doc_i]
        is_code = not is_generated_table(rel, text)
        seq = [eos_id] + ids.tolist()
        windows = [seq[s:s + SEQ_LEN + 1] for s in range(0, len(seq) - 1, SEQ_LEN)]
        windows = [w for w in windows if len(w) >= 2][:max_windows_per_doc]
        full = [w for w in windows if len(w) == SEQ_LEN + 1]
        groups = [full[i:i + 16] for i in range(0, len(full), 16)] + [[w] for w in windows if len(w) < SEQ_LEN + 1]
        for group in groups:
            x = torch.tensor(group)
            inputs, labels = x[:, :-1], x[:, 1:]
            lt = target(input_ids=inputs).logits.float()
            ld = drafter(input_ids=inputs).logits.float()
            lpt, lpd = F.log_softmax(lt, -1), F.log_softmax(ld, -1)
            greedy = (lt.argmax(-1) == ld.argmax(-1)).double()
            overlap = torch.minimum(lpt.exp(), lpd.exp()).sum(-1).double()
            ce_t = -lpt.gather(-1, labels[..., None])[..., 0].double()
            ce_d = -lpd.gather(-1, labels[..., None])[..., 0].double()
            top1_t = (lt.argmax(-1) == labels).double()
            rep = torch.tensor([repeated_positions(w)[1:] for w in group])  # flag of the predicted token
            masks = {"all": torch.ones_like(rep), "loop_free": ~rep}
            masks["code_only"] = masks["all"] if is_code else torch.zeros_like(rep)
            masks["code_loop_free"] = masks["loop_free"] if is_code else torch.zeros_like(rep)
            for s, m in masks.items():
                a = acc[s]
                a["n"] += int(m.sum())
                for key, v in (("greedy", greedy), ("sampling", overlap), ("ce_t", ce_t), ("ce_d", ce_d),
                               ("top1_t", top1_t)):
                    a[key] += float(v[m].sum())
    out = {}
    for s, a in acc.items():
        n = max(1, a["n"])
        out[s] = {"positions": a["n"],
                  "greedy_acceptance": round(a["greedy"] / n, 4),
                  "sampling_acceptance_t1": round(a["sampling"] / n, 4),
                  "target_ce": round(a["ce_t"] / n, 4), "drafter_ce": round(a["ce_d"] / n, 4),
                  "target_top1": round(a["top1_t"] / n, 4)}
    return out


def expected_tokens_per_call(alpha: float, gamma: int = GAMMA) -> float:
    """E[tokens per target forward] with i.i.d. per-token acceptance alpha (Leviathan et al. 2023)."""
    if alpha >= 1.0:
        return gamma + 1.0
    return (1 - alpha ** (gamma + 1)) / (1 - alpha)


@torch.no_grad()
def simulate_greedy_sd(target, drafter, prompts: list[list[int]], max_new: int, gamma: int = GAMMA) -> dict:
    """Greedy speculative decoding with KV caches: the drafter proposes gamma tokens, one target
    forward scores them all, the longest agreeing prefix plus the target's own next token are kept,
    and both caches are cropped back to the kept sequence. Also checks the output against plain
    target greedy decoding (it can differ only by float rounding between chunked and 1-token steps)."""
    from transformers import DynamicCache

    calls, produced, identical = 0, 0, 0
    for prompt in prompts:
        seq = list(prompt)
        t_cache, d_cache = DynamicCache(config=target.config), DynamicCache(config=drafter.config)
        while len(seq) - len(prompt) < max_new:
            inp, draft = seq[d_cache.get_seq_length():], []   # feed what the drafter has not seen
            for _ in range(gamma):
                logits = drafter(input_ids=torch.tensor([inp]), cache=d_cache, use_cache=True).logits[0, -1]
                draft.append(int(logits.argmax()))
                inp = draft[-1:]
            fed = seq[t_cache.get_seq_length():] + draft
            logits = target(input_ids=torch.tensor([fed]), cache=t_cache, use_cache=True).logits[0, -(gamma + 1):]
            choice = logits.argmax(-1).tolist()   # the target's token after each draft prefix
            n_ok = 0
            while n_ok < gamma and draft[n_ok] == choice[n_ok]:
                n_ok += 1
            seq += draft[:n_ok] + [choice[n_ok]]
            calls += 1
            keep = len(seq) - 1                   # the newest token has not been fed to either model
            for cache in (t_cache, d_cache):
                extra = cache.get_seq_length() - keep
                if extra > 0:
                    cache.crop(-extra)            # drop the rejected draft tokens
        produced += len(seq) - len(prompt)
        ref = generate(target, prompt, max_new, eos_id=None)
        identical += int(ref == seq[len(prompt):len(prompt) + max_new])
    return {"prompts": len(prompts), "max_new_tokens": max_new, "gamma": gamma, "target_calls": calls,
            "tokens_per_target_call": round(produced / calls, 3),
            "outputs_identical_to_target_greedy": f"{identical}/{len(prompts)}"}


@torch.no_grad()
def measure_cost_ratio(target, drafter, batches=(1, 8, 32), context: int = 128, reps: int = 100) -> dict:
    """Decode-like step: one new token per sequence on top of a `context`-token KV cache
    (transformers DynamicCache), float32. The cache is cropped back after each call so every timed
    call is identical; target and drafter calls alternate.

    Two clocks, because the build machine is usually shared:
      wall  best (minimum) wall time of `reps` calls at the script's thread count. Best, not median:
            an OpenMP team that loses a core to another job stalls a call 10-100x, so medians on a
            busy machine measure the neighbours. Still inflated if the machine never goes quiet.
      cpu1  median CPU time of the calling thread with torch limited to 1 thread: the work itself,
            insensitive to other jobs (time descheduled is not counted, and one thread never waits
            on a descheduled sibling)."""
    from transformers import DynamicCache

    def prepared(model, b):
        gen = torch.Generator().manual_seed(b)
        cache = DynamicCache(config=model.config)
        model(input_ids=torch.randint(0, VOCAB_SIZE, (b, context), generator=gen), cache=cache, use_cache=True)
        nxt = torch.randint(0, VOCAB_SIZE, (b, 1), generator=gen)
        pos = torch.full((b, 1), context)
        return lambda: (model(input_ids=nxt, cache=cache, use_cache=True, position_ids=pos), cache.crop(-1))

    def timed(fns, clock, n):
        times = [[] for _ in fns]
        for r in range(n + 5):
            for fn, ts in zip(fns, times):
                t0 = clock()
                fn()
                ts.append(clock() - t0)
        return [ts[5:] for ts in times]

    threads = torch.get_num_threads()
    out = {"load_avg_1min_before": round(os.getloadavg()[0], 2), "cpus": os.cpu_count()}
    for b in batches:
        fns = (prepared(target, b), prepared(drafter, b))
        tt, td = timed(fns, time.perf_counter, reps)
        torch.set_num_threads(1)
        ct, cd = timed(fns, time.thread_time, max(10, reps // 3))
        torch.set_num_threads(threads)
        out[f"batch_{b}"] = {
            "target_ms": round(min(tt) * 1e3, 3), "drafter_ms": round(min(td) * 1e3, 3),
            "ratio": round(min(td) / min(tt), 3),
            "target_ms_median": round(statistics.median(tt) * 1e3, 3),
            "drafter_ms_median": round(statistics.median(td) * 1e3, 3),
            "target_cpu1_ms": round(statistics.median(ct) * 1e3, 3),
            "drafter_cpu1_ms": round(statistics.median(cd) * 1e3, 3),
            "ratio_cpu1": round(statistics.median(cd) / statistics.median(ct), 3)}
    out["load_avg_1min_after"] = round(os.getloadavg()[0], 2)
    return out


def batch_items(cost: dict) -> list[tuple[str, dict]]:
    """The per-batch entries of measure_cost_ratio's result."""
    return [(k, v) for k, v in cost.items() if k.startswith("batch_")]


def flops_per_token(model) -> int:
    """2 x (weights touched per token): every matrix except the input embedding lookup."""
    emb = model.get_input_embeddings().weight.numel()
    tied = model.config.tie_word_embeddings
    return 2 * (n_params(model) - (0 if tied else emb))


@torch.no_grad()
def generate(model, prompt: list[int], max_new: int, eos_id: int | None, temperature: float = 0.0,
             seed: int = 0) -> list[int]:
    """Plain autoregressive decoding with a KV cache; greedy when temperature == 0; stops after
    eos_id unless it is None."""
    from transformers import DynamicCache

    gen = torch.Generator().manual_seed(seed)
    cache = DynamicCache(config=model.config)
    logits = model(input_ids=torch.tensor([prompt]), cache=cache, use_cache=True).logits[0, -1]
    out = []
    for _ in range(max_new):
        if temperature == 0.0:
            tok = int(logits.argmax())
        else:
            tok = int(torch.multinomial(F.softmax(logits / temperature, -1), 1, generator=gen))
        out.append(tok)
        if eos_id is not None and tok == eos_id:
            break
        logits = model(input_ids=torch.tensor([[tok]]), cache=cache, use_cache=True).logits[0, -1]
    return out


def code_prompts(corpus: Corpus, count: int, context_chars: int = 500) -> list[tuple[str, str]]:
    """Prompts from held-out code files: ~500 characters of context ending with a `def ...:` line,
    taken from the second half of the file. Files spread over the held-out list."""
    found = []
    for i in corpus.heldout:
        rel, text = corpus.paths[i], corpus.texts[i]
        if is_generated_table(rel, text):
            continue
        lines, pos, offsets = text.splitlines(keepends=True), 0, []
        for line in lines:
            offsets.append(pos)
            pos += len(line)
        for li, line in enumerate(lines):
            if offsets[li] >= len(text) // 2 and line.lstrip().startswith("def ") and line.rstrip().endswith(":"):
                # End at the colon, not after the newline: the tokenizer merges a newline with the next
                # line's indentation, so a prompt ending in a bare "\n" says "the next line is unindented".
                end = offsets[li] + len(line.rstrip())
                start = max(0, end - context_chars)
                start = text.rfind("\n", 0, start) + 1 if start > 0 else 0  # begin on a line boundary
                found.append((rel, text[start:end]))
                break
    if len(found) <= count:
        return found
    step = len(found) / count
    return [found[int(k * step)] for k in range(count)]


# --------------------------------------------------------------------------------------------------
# 6. manifest / README
# --------------------------------------------------------------------------------------------------
def write_readme(out: Path, m: dict) -> None:
    f = m["figures"]
    ta, da = m["models"]["tiny-target"]["config"], m["models"]["tiny-drafter"]["config"]
    tf = f["teacher_forced"]
    cost = f["cost_ratio_decode"]

    def arch_row(name, c, params):
        return (f"| {name} | {params / 1e6:.2f} M | {c['hidden_size']} | {c['num_hidden_layers']} | "
                f"{c['num_attention_heads']} / {c['num_key_value_heads']} | {c['head_dim']} | "
                f"{c['intermediate_size']} | {c['tie_word_embeddings']} |")

    rows = []
    for s, label in (("all", "all held-out positions"), ("code_only", "code files only (no generated tables)"),
                     ("loop_free", f"loop-free positions (no repeated {LOOP_NGRAM}-gram)"),
                     ("code_loop_free", "code files, loop-free")):
        r = tf[s]
        rows.append(f"| {label} | {r['positions']} | {r['greedy_acceptance']:.3f} | "
                    f"{r['sampling_acceptance_t1']:.3f} | {expected_tokens_per_call(r['greedy_acceptance']):.2f} | "
                    f"{r['target_ce']:.3f} | {r['drafter_ce']:.3f} |")
    cost_rows = [f"| {b.split('_')[1]} | {v['target_cpu1_ms']:.2f} | {v['drafter_cpu1_ms']:.2f} | "
                 f"**{v['ratio_cpu1']:.3f}** | {v['target_ms']:.2f} | {v['drafter_ms']:.2f} | {v['ratio']:.3f} |"
                 for b, v in batch_items(cost)]
    load = max(cost.get("load_avg_1min_before", 0.0), cost.get("load_avg_1min_after", 0.0))
    cpus = cost.get("cpus") or os.cpu_count()
    if "load_avg_1min_before" not in cost:
        load_note = ""
    elif load > 0.75 * cpus:
        load_note = (f" During this measurement the machine was busy (1-minute load average up to {load:.1f} "
                     f"on {cpus} CPUs), so the wall-clock columns are unreliable; the CPU-time columns are not.")
    else:
        load_note = f" 1-minute load average during the measurement: up to {load:.1f} on {cpus} CPUs."
    sim = f["greedy_sd_simulation"]
    wt = m["wall_time_s"]
    wall = f"{wt['total'] / 60:.1f} minutes"
    phases = ", ".join(f"{k} {v / 60:.1f} min" for k, v in wt.items() if k != "total")
    tr = m["training"]
    if all("step_s_p10" in tr[k] for k in ("target", "drafter_data", "drafter_distill")):
        est = sum(tr[k]["steps"] * tr[k]["step_s_p10"] for k in ("target", "drafter_data", "drafter_distill"))
        speed = (f" Training steps at their fastest-decile speed (an unshared CPU) add up to "
                 f"{est / 60:.1f} minutes.")
        if "load_avg_mean" in tr["target"]:
            speed += (f" Mean 1-minute load average while the target trained: {tr['target']['load_avg_mean']:.1f} "
                      f"on {os.cpu_count()} CPUs.")
    else:
        speed = ""
    ba = tr["drafter_distill"].get("heldout_subset_before_after")
    distill_gain = (f" On a held-out subset ({ba['before']['positions']} positions) distillation took greedy "
                    f"acceptance from {ba['before']['greedy_acceptance']:.3f} to {ba['after']['greedy_acceptance']:.3f} "
                    f"and sampling acceptance from {ba['before']['sampling_acceptance_t1']:.3f} to "
                    f"{ba['after']['sampling_acceptance_t1']:.3f}." if ba else "")
    text = f"""# Bundled tiny models

`tiny-target/` and `tiny-drafter/` are a speculative-decoding pair small enough to commit and to
serve on a CPU (`make serve`). They are made from scratch, without downloads, by

```
make tiny-models        # .venv/bin/python scripts/make_tiny_models.py --out models
```

which rewrites both directories, this README and `manifest.json` (seeds, step counts, hashes,
timings, all figures). The same corpus, torch build, thread count and CPU give the same weights.
This build took {wall} on {m['build']['threads']} CPU threads (wall clock; phases: {phases}).{speed}
`--quick` is a one-minute smoke test of the whole script; `--eval-only` re-measures the figures of
the checkpoints in place.

**Corpus**: the Python {platform.python_version()} standard library's own `.py` files
({m['corpus']['files']} files, {m['corpus']['bytes'] / 1e6:.1f} MB; no `test/`, `tests/`, `idlelib/idle_test`,
`site-packages`), sorted by path; every {HOLDOUT_EVERY}th file ({m['corpus']['heldout_files']} files) is held out
for the figures below. **Tokenizer**: byte-level BPE, {VOCAB_SIZE} tokens, `{EOS}` (id {m['tokenizer']['eos_id']})
is EOS, BOS and the separator between files; no prefix space, so `decode(encode(x)) == x`. Both
directories hold the same `tokenizer.json` / `tokenizer_config.json`.

**Training**: target {m['training']['target']['steps']} steps of next-token cross-entropy on random {SEQ_LEN}-token windows,
batch {m['training']['target']['batch']}, AdamW, warm-up + cosine LR, bf16 autocast. Drafter
{m['training']['drafter_data']['steps']} steps of cross-entropy, then {m['training']['drafter_distill']['steps']} steps of distillation:
KL(target || drafter) over the full vocabulary against the saved target, on training windows.{distill_gain}
Weights are stored in bfloat16; every figure below comes from the saved files re-loaded in float32.

| model | params | hidden | layers | heads q / kv | head dim | MLP | tied emb. |
|---|---|---|---|---|---|---|---|
{arch_row('tiny-target', ta, m['models']['tiny-target']['params'])}
{arch_row('tiny-drafter', da, m['models']['tiny-drafter']['params'])}

Both: `LlamaForCausalLM`, vocab {VOCAB_SIZE}, RoPE theta 10000, max positions {MAX_POSITIONS}, SwiGLU, RMSNorm.

## Figures (held-out files, teacher-forced {SEQ_LEN}-token windows)

Greedy acceptance: fraction of positions where the drafter's argmax equals the target's given the
same prefix. Sampling acceptance: mean over positions of sum_x min(p(x), q(x)) at temperature 1.
Tokens per target call at gamma = {GAMMA}: (1 - a^{GAMMA + 1}) / (1 - a) from the greedy acceptance a.
CE: cross-entropy (nats/token) of the true next token.

| positions | count | greedy acc. | sampling acc. (T=1) | tokens / target call | target CE | drafter CE |
|---|---|---|---|---|---|---|
{chr(10).join(rows)}

Simulated greedy speculative decoding (gamma {sim['gamma']}, {sim['prompts']} held-out prompts, {sim['max_new_tokens']} new
tokens each): **{sim['tokens_per_target_call']:.2f} tokens per target call**; outputs identical to plain target
greedy decoding: {sim['outputs_identical_to_target_greedy']}.

## Drafter / target cost

One decode step: one new token per sequence on a {f['cost_context_tokens']}-token KV cache, transformers
`DynamicCache`, float32. "CPU, 1 thread": median CPU time of the calling thread with torch on one
thread, which other jobs on the machine do not disturb. "Wall": best of repeated alternating calls at
{m['build']['threads']} threads (medians are in `manifest.json`).{load_note}

| batch | target ms (CPU, 1 thread) | drafter ms (CPU, 1 thread) | ratio (CPU, 1 thread) | target ms (wall) | drafter ms (wall) | ratio (wall) |
|---|---|---|---|---|---|---|
{chr(10).join(cost_rows)}

By arithmetic (2 x weights touched per token, attention excluded) the drafter costs
{f['flops_ratio']:.3f} of the target; at small batch the measured ratio is higher because a step of
these tiny models is mostly per-layer framework overhead, which scales with layer count, not width.

Sample continuations of held-out prompts are in `manifest.json` (`figures.samples`). They are
Python-shaped but not good Python: this is a 7M-parameter model trained for minutes.

Prompting note: the tokenizer merges a newline with the indentation that follows it, so a prompt
that ends in a bare newline tells the model the next line starts at column 0. End prompts before
the newline (e.g. at the `:` of a `def` line) to get an indented body.
"""
    (out / "README.md").write_text(text)


# --------------------------------------------------------------------------------------------------
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="models", help="output directory (gets tiny-target/, tiny-drafter/, manifest.json)")
    p.add_argument("--target-steps", type=int, default=None, help="target training steps (default 1000)")
    p.add_argument("--drafter-steps", type=int, default=None, help="drafter cross-entropy steps (default 300)")
    p.add_argument("--distill-steps", type=int, default=None, help="drafter distillation steps (default 700)")
    p.add_argument("--batch", type=int, default=16, help="windows per training step")
    p.add_argument("--threads", type=int, default=2, help="torch / tokenizers threads (results depend on it)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--quick", action="store_true", help="smoke test: a few steps of everything (~1 minute)")
    p.add_argument("--eval-only", action="store_true",
                   help="re-measure the figures of the checkpoints already in --out (same corpus and tokenizer "
                        "required), keeping the manifest's training records")
    args = p.parse_args(argv)
    full = dict(target_steps=1000, drafter_steps=300, distill_steps=700)
    quick = dict(target_steps=12, drafter_steps=8, distill_steps=8)
    for k, v in (quick if args.quick else full).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    return args


def train_pair(args, corpus: Corpus, tok, train_stream, heldout_docs, seeds: dict, clock: Clock,
               target_dir: Path, drafter_dir: Path) -> dict:
    """Phases 3-4: train and save the target, then the drafter (data, then distillation)."""
    eos_id = tok.token_to_id(EOS)
    training = {}
    with clock.phase("target"):
        target = build_model(TARGET_ARCH, eos_id, seeds["target_init"])
        log(f"target: {n_params(target):,} parameters")
        training["target"] = train_phase("target", target, train_stream, args.target_steps, peak_lr=2e-3,
                                         warmup=min(60, max(1, args.target_steps // 10)),
                                         seed=seeds["target_data"], batch=args.batch, clock=clock)
        save_checkpoint(target, target_dir, tok)
        del target

    with clock.phase("drafter"):
        drafter = build_model(DRAFTER_ARCH, eos_id, seeds["drafter_init"])
        log(f"drafter: {n_params(drafter):,} parameters")
        training["drafter_data"] = train_phase("drafter", drafter, train_stream, args.drafter_steps, peak_lr=3e-3,
                                               warmup=min(30, max(1, args.drafter_steps // 10)),
                                               seed=seeds["drafter_data"], batch=args.batch, clock=clock)

    with clock.phase("distill"):
        # The teacher is the target as saved (bf16 weights), so the drafter learns the model it will
        # actually be verified against.
        teacher = load_checkpoint(target_dir)
        for p in teacher.parameters():
            p.requires_grad_(False)
        # Acceptance on a small held-out subset before and after distillation (same subset), to show
        # what the distillation buys.
        subset = dict(max_windows_per_doc=1 if args.quick else 3)
        before = eval_teacher_forced(teacher, drafter, corpus, heldout_docs, eos_id, **subset)["all"]
        log(f"  before distillation (subset, n={before['positions']}): greedy acc {before['greedy_acceptance']:.3f}, "
            f"sampling acc {before['sampling_acceptance_t1']:.3f}")
        training["drafter_distill"] = train_phase("distill", drafter, train_stream, args.distill_steps, peak_lr=2e-3,
                                                  warmup=min(30, max(1, args.distill_steps // 10)),
                                                  seed=seeds["distill_data"], batch=args.batch, clock=clock,
                                                  teacher=teacher)
        after = eval_teacher_forced(teacher, drafter, corpus, heldout_docs, eos_id, **subset)["all"]
        log(f"  after distillation (subset, n={after['positions']}): greedy acc {after['greedy_acceptance']:.3f}, "
            f"sampling acc {after['sampling_acceptance_t1']:.3f}  (fp32 master weights, before bf16 rounding)")
        training["drafter_distill"]["heldout_subset_before_after"] = {"before": before, "after": after}
        save_checkpoint(drafter, drafter_dir, tok)
        del teacher, drafter
    return training


def evaluate_pair(args, corpus: Corpus, tok, heldout_docs, seeds: dict, target, drafter) -> dict:
    """Phase 5, on the checkpoints as saved, re-loaded in float32."""
    eos_id = tok.token_to_id(EOS)
    figures = {}
    figures["teacher_forced"] = tf = eval_teacher_forced(
        target, drafter, corpus, heldout_docs, eos_id, max_windows_per_doc=2 if args.quick else None)
    for s, r in tf.items():
        log(f"  {s:15s} n={r['positions']:6d} greedy acc {r['greedy_acceptance']:.3f}  "
            f"sampling acc {r['sampling_acceptance_t1']:.3f}  tokens/call@{GAMMA} "
            f"{expected_tokens_per_call(r['greedy_acceptance']):.2f}  CE target {r['target_ce']:.3f} "
            f"drafter {r['drafter_ce']:.3f}")
    figures["expected_tokens_per_call_gamma4"] = {
        "from_greedy_acceptance": round(expected_tokens_per_call(tf["all"]["greedy_acceptance"]), 3),
        "from_sampling_acceptance": round(expected_tokens_per_call(tf["all"]["sampling_acceptance_t1"]), 3)}

    # Greedy speculative decoding on 64-token prompts cut from the held-out stream at fixed strides.
    n_prompts, max_new = (2, 16) if args.quick else (16, 128)
    stream = torch.cat([torch.tensor([eos_id] + d.tolist()) for d in heldout_docs])
    stride = (len(stream) - 200) // n_prompts
    prompts = [stream[k * stride:k * stride + 64].tolist() for k in range(n_prompts)]
    figures["greedy_sd_simulation"] = sim = simulate_greedy_sd(target, drafter, prompts, max_new)
    log(f"  greedy SD simulation: {sim}")

    figures["cost_context_tokens"] = 128
    figures["cost_ratio_decode"] = cost = measure_cost_ratio(target, drafter, reps=10 if args.quick else 100)
    figures["flops_ratio"] = round(flops_per_token(drafter) / flops_per_token(target), 4)
    for b, v in batch_items(cost):
        log(f"  cost {b}: wall best target {v['target_ms']:.2f} ms, drafter {v['drafter_ms']:.2f} ms, "
            f"ratio {v['ratio']:.3f} (medians {v['target_ms_median']:.2f} / {v['drafter_ms_median']:.2f} ms); "
            f"1-thread CPU time {v['target_cpu1_ms']:.2f} / {v['drafter_cpu1_ms']:.2f} ms, ratio {v['ratio_cpu1']:.3f}")
    log(f"  per-token FLOPs ratio (weights only): {figures['flops_ratio']:.3f}")

    samples = []
    for k, (rel, prompt_text) in enumerate(code_prompts(corpus, 3)):
        ids = tok.encode(prompt_text).ids
        n_new = 24 if args.quick else 96
        g = tok.decode(generate(target, ids, n_new, eos_id))
        s = tok.decode(generate(target, ids, n_new, eos_id, temperature=0.8, seed=seeds["samples"] + k))
        dg = tok.decode(generate(drafter, ids, n_new, eos_id))
        samples.append({"file": rel, "prompt_tail": prompt_text[-300:], "target_greedy": g,
                        "target_sampled_t0.8": s, "drafter_greedy": dg})
        log(f"\n--- sample {k + 1}: held-out {rel}; prompt ends:\n{prompt_text[-200:]}"
            f"\n--- target greedy:\n{g}\n--- target sampled (T=0.8):\n{s}\n--- drafter greedy:\n{dg}\n---")
    figures["samples"] = samples
    return figures


def main(argv=None) -> int:
    args = parse_args(argv)
    import tokenizers
    import transformers

    transformers.utils.logging.disable_progress_bar()  # keep the log to our own progress lines

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    target_dir, drafter_dir = out / "tiny-target", out / "tiny-drafter"
    # Fixed thread counts: results (and float summation order) depend on them.
    torch.set_num_threads(args.threads)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:  # already set in this process (main() called twice)
        pass
    os.environ["RAYON_NUM_THREADS"] = str(args.threads)  # tokenizers' pool, read at first use
    seeds = {"target_init": args.seed, "target_data": args.seed + 1, "drafter_init": args.seed + 2,
             "drafter_data": args.seed + 3, "distill_data": args.seed + 4, "samples": args.seed + 5}
    old = None
    if args.eval_only:
        old = json.loads((out / "manifest.json").read_text())
        seeds = old["seeds"]
    clock = Clock()
    command = " ".join([Path(sys.argv[0]).name] + (sys.argv[1:] if argv is None else list(argv)))
    log(f"make_tiny_models: out={out} threads={args.threads} seed={args.seed} quick={args.quick} "
        f"eval_only={args.eval_only} steps target={args.target_steps} drafter={args.drafter_steps} "
        f"distill={args.distill_steps}")

    with clock.phase("corpus"):
        corpus = collect_corpus()
        log(f"{len(corpus.paths)} files, {corpus.n_bytes / 1e6:.2f} MB, {len(corpus.heldout)} held out; "
            f"sha256 {corpus.sha256}")
        if old and old["corpus"]["sha256_concatenated"] != corpus.sha256:
            raise SystemExit("--eval-only: this Python's stdlib differs from the corpus the checkpoints were built on")

    with clock.phase("tokenizer"):
        if old:
            from tokenizers import Tokenizer
            tok = Tokenizer.from_file(str(target_dir / "tokenizer.json"))
        else:
            tok = train_tokenizer(corpus.train_texts)
            write_tokenizer_files(tok, out / ".tokenizer-tmp")  # hashed exactly as it will be saved
        tok_file = target_dir / "tokenizer.json" if old else out / ".tokenizer-tmp" / "tokenizer.json"
        tok_sha = sha256_file(tok_file)
        shutil.rmtree(out / ".tokenizer-tmp", ignore_errors=True)
        if old and old["tokenizer"]["tokenizer_json_sha256"] != tok_sha:
            raise SystemExit("--eval-only: tokenizer.json differs from the manifest's")
        eos_id = tok.token_to_id(EOS)
        docs = encode_docs(tok, corpus.texts)
        held = set(corpus.heldout)
        train_stream = make_stream([d for i, d in enumerate(docs) if i not in held], eos_id)
        heldout_docs = [docs[i] for i in corpus.heldout]
        log(f"vocab {tok.get_vocab_size()}, eos id {eos_id}, train tokens {len(train_stream)}, "
            f"held-out tokens {sum(len(d) for d in heldout_docs)}, "
            f"{corpus.n_bytes / sum(len(d) for d in docs):.2f} bytes/token; tokenizer.json sha256 {tok_sha}")

    if old:
        training = old["training"]
    else:
        training = train_pair(args, corpus, tok, train_stream, heldout_docs, seeds, clock, target_dir, drafter_dir)

    with clock.phase("evaluate"):
        target, drafter = load_checkpoint(target_dir), load_checkpoint(drafter_dir)
        assert next(target.parameters()).dtype == torch.float32
        figures = evaluate_pair(args, corpus, tok, heldout_docs, seeds, target, drafter)

    def model_entry(path: Path, model) -> dict:
        cfg = json.loads((path / "config.json").read_text())
        keep = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "vocab_size", "max_position_embeddings", "rope_parameters",
                "rms_norm_eps", "tie_word_embeddings", "bos_token_id", "eos_token_id", "torch_dtype")
        return {"params": n_params(model), "config": {k: cfg.get(k) for k in keep},
                "files": {f.name: {"bytes": f.stat().st_size, "sha256": sha256_file(f)}
                          for f in sorted(path.iterdir()) if f.is_file()}}

    manifest = {
        "quick": old["quick"] if old else args.quick,
        "command": old["command"] if old else command,
        "corpus": {"source": "python stdlib .py files", "stdlib_dir": corpus.stdlib_dir,
                   "python": platform.python_version(), "excluded_dirs": sorted(EXCLUDED_DIRS),
                   "files": len(corpus.paths), "bytes": corpus.n_bytes,
                   "heldout_rule": f"index % {HOLDOUT_EVERY} == {HOLDOUT_EVERY - 1} in sorted-path order",
                   "heldout_files": len(corpus.heldout), "heldout_paths": [corpus.paths[i] for i in corpus.heldout],
                   "sha256_concatenated": corpus.sha256,
                   "train_tokens": len(train_stream), "heldout_tokens": int(sum(len(d) for d in heldout_docs))},
        "tokenizer": {"type": "byte-level BPE", "vocab_size": VOCAB_SIZE, "eos_token": EOS, "eos_id": eos_id,
                      "tokenizer_json_sha256": tok_sha},
        "models": {"tiny-target": model_entry(target_dir, target), "tiny-drafter": model_entry(drafter_dir, drafter)},
        "training": training,
        "seeds": seeds,
        "build": {"threads": args.threads, "torch": torch.__version__, "transformers": transformers.__version__,
                  "tokenizers": tokenizers.__version__, "numpy": np.__version__, "python": platform.python_version(),
                  "cpu": platform.processor() or platform.machine(), "autocast": "bfloat16 (training)",
                  "storage_dtype": "bfloat16", "eval_dtype": "float32"},
        "figures": figures,
        "figure_definitions": {
            "greedy_acceptance": "teacher-forced, fraction of positions with argmax drafter == argmax target",
            "sampling_acceptance_t1": "mean over positions of sum_x min(p_target(x), p_drafter(x)), T=1",
            "loop_free": f"positions whose true next token does not complete a {LOOP_NGRAM}-gram already seen "
                         f"earlier in the same {SEQ_LEN}-token window",
            "code_only": "held-out files minus machine-generated tables (charmap codecs, pydoc_data)",
            "tokens_per_target_call": f"(1 - a^{GAMMA + 1}) / (1 - a) at gamma {GAMMA}",
            "greedy_sd_simulation": "greedy speculative decoding with KV caches on held-out prompts; "
                                    "tokens produced / target forward calls",
            "cost_ratio_decode": "drafter/target time of one decode step (1 token/seq on a 128-token "
                                 "DynamicCache), float32: ratio = best wall time of N calls at the build's "
                                 "thread count (medians alongside); ratio_cpu1 = median thread CPU time "
                                 "with torch on 1 thread",
            "flops_ratio": "drafter/target 2*(matrix weights touched per token), attention excluded",
        },
    }
    if old:
        # Training phases keep the build's times; evaluation is this run's.
        phases = {k: v for k, v in old["wall_time_s"].items() if k not in ("evaluate", "total")}
        phases["evaluate"] = clock.phases["evaluate"]
        phases["total"] = round(sum(phases.values()), 1)
        manifest["wall_time_s"] = phases
        manifest["evaluation"] = {"command": command, "note": "figures re-measured with --eval-only on the "
                                  "unchanged checkpoints; training phase times are the build's"}
    else:
        clock.phases["total"] = round(clock.elapsed(), 1)
        manifest["wall_time_s"] = clock.phases
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    write_readme(out, manifest)

    tf, sim, cost = figures["teacher_forced"], figures["greedy_sd_simulation"], figures["cost_ratio_decode"]
    t = tf["all"]
    log(f"\nDONE in {clock.elapsed() / 60:.1f} min. target {manifest['models']['tiny-target']['params']:,} params, "
        f"drafter {manifest['models']['tiny-drafter']['params']:,} params; greedy acc {t['greedy_acceptance']:.3f} "
        f"(loop-free {tf['loop_free']['greedy_acceptance']:.3f}), sampling acc {t['sampling_acceptance_t1']:.3f}, "
        f"tokens/call@{GAMMA} {expected_tokens_per_call(t['greedy_acceptance']):.2f} (simulated "
        f"{sim['tokens_per_target_call']:.2f}), cost ratio (1-thread CPU time) "
        + ", ".join(f"batch {k.split('_')[1]}: {v['ratio_cpu1']:.3f}" for k, v in batch_items(cost))
        + " (best wall time) " + ", ".join(f"{k.split('_')[1]}: {v['ratio']:.3f}" for k, v in batch_items(cost)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
