"""The drafter: a small model with its own paged KV cache that proposes tokens, in process
(a :class:`~backend.speculation.proposer.Proposer`; the worker runs one in its own process).

It keeps its own copy of every sequence's tokens, keeps the K/V of its previous proposals that
turned out to be accepted, and catches up on the rest (after gamma = 0 steps, or for a new
sequence) with one ragged forward before drafting.

A request the drafter cannot serve (its sampling state, a desynchronised sequence, a forward
that raises for it) gets an empty proposal with `error` set and is forgotten; every other
request in the call is drafted as if it had been alone. Speculation is optional, so that request
simply decodes without drafts.
"""
from __future__ import annotations

import contextlib
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

import torch

from backend.model.kv_cache import PagedKVCache, release_cached_memory
from backend.model.linear import drop_packed, pack_linears
from backend.model.loader import load_model
from backend.model.llama import CausalLM
from backend.model.runner import ModelRunner, capture_for
from backend.sampling.grammar import GrammarCompiler, Matcher, mask_rows
from backend.sampling.processors import Context, Row, process_logits
from backend.sampling.sampler import make_generator, processed_probs
from backend.sampling.verification import check_drawn, draw_uniforms, sample_rows
from backend.sampling.params import SamplingParams
from backend.speculation.draft_ahead import AheadStats, PreDraft
from backend.speculation.proposer import (Desynchronised, Done, DraftRequest, Proposal, ProposerStats,
                                          common_prefix_len)


@dataclass
class _SeqState:
    tokens: list[int] = field(default_factory=list)
    kv_len: int = 0                # tokens whose K/V are cached (may include a speculative tail)
    spec_tail: list[int] = field(default_factory=list)   # cached drafts not yet confirmed
    generator: torch.Generator | None = None
    num_prompt: int = 0            # tokens[:num_prompt] are the prompt (for the penalties)
    grammar: Matcher | None = None   # structured outputs: where the committed tokens took it


class Drafter:
    def __init__(self, model: CausalLM, kv_cache: PagedKVCache, seed: int = 0, runner: ModelRunner | None = None):
        self.model = model
        self.runner = runner if runner is not None else ModelRunner(model, kv_cache)
        self.kv = kv_cache
        self.device = kv_cache.device
        self._kv_blocks = kv_cache.num_blocks
        self._block_size = kv_cache.block_size
        self._kv_dtype = kv_cache.dtype
        # the weights' size does not change when they move: counted once, not on every step
        self._weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        self._seqs: dict[str, _SeqState] = {}
        self._seed_source = make_generator(seed)
        self._host_weights: dict[str, torch.Tensor] | None = None
        self._pack = False                 # re-pack the linear layers after a reload
        self.last_propose_s = 0.0
        self.last_catchup_s = 0.0      # time of the last proposal's catch-up forward
        self.num_catchup_tokens = 0    # tokens re-fed to rebuild the drafter's KV (switching cost)
        self._ahead: dict[str, PreDraft] = {}     # seq id -> its pre-drafted next round
        self.tokenizer_path: str | None = None    # for structured outputs (Drafter.load sets it)
        self._grammars: GrammarCompiler | None = None
        self.ahead_stats = AheadStats()

    @property
    def kv(self) -> PagedKVCache | None:
        """The drafter's KV pool (None while offloaded); its runner writes it."""
        return self.runner.kv

    @kv.setter
    def kv(self, kv: PagedKVCache | None) -> None:
        self.runner.kv = kv

    @classmethod
    def load(cls, path: str, *, device: str, dtype: torch.dtype, kv_cache_bytes: int,
             block_size: int, seed: int = 0, offloaded: bool = False, pack: bool = True,
             attention: str = "auto", compile: str = "off", max_query_len: int = 9) -> "Drafter":
        """`offloaded`: start with the weights in host memory and no KV pool, as a drafter that
        replaces an offloaded one must (its device memory is lent to the target's KV cache).
        `pack`: let the CPU linear layers pick their faster kernel (backend.model.linear).
        `attention`, `compile`: as EngineConfig's (a compiled step covers forwards of up to
        `max_query_len` tokens a sequence)."""
        if not offloaded:
            model = load_model(path, device=device, dtype=dtype, attention=attention)
            kv = PagedKVCache.for_model(model.config, kv_cache_bytes, block_size=block_size,
                                        dtype=dtype, device=device)
            if pack:
                pack_linears(model)
            runner = ModelRunner(model, kv, capture_for(model, kv, compile, "drafter", max_query_len))
            drafter = cls(model, kv, seed=seed, runner=runner)
            drafter._pack = pack
            drafter.tokenizer_path = path
            return drafter
        model = load_model(path, device="cpu", dtype=dtype, attention=attention)
        for module in model.modules():      # buffers (rope table) live on the device regardless
            for name, buf in module.named_buffers(recurse=False):
                module.register_buffer(name, buf.to(device), persistent=False)
        # Sized like the real pool but allocated nowhere ("meta"): reload allocates it.
        kv = PagedKVCache.for_model(model.config, kv_cache_bytes, block_size=block_size,
                                    dtype=dtype, device="meta")
        drafter = cls(model, kv, seed=seed)
        drafter.device = torch.device(device)
        drafter._pack = pack
        drafter.tokenizer_path = path
        drafter.offload()
        return drafter

    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size

    def free(self, seq_id: str) -> None:
        self._seqs.pop(seq_id, None)
        self._ahead.pop(seq_id, None)
        if self.kv is not None:
            self.kv.free(seq_id)

    # -- elastic memory ----------------------------------------------------------------------------

    @property
    def offloaded(self) -> bool:
        return self._host_weights is not None

    @property
    def weight_bytes(self) -> int:
        return self._weight_bytes

    def loaded_bytes(self) -> int:
        """Bytes this drafter holds on its device while its weights are there: weights + KV pool."""
        return self._weight_bytes + self.kv_bytes()

    def kv_bytes(self) -> int:
        return self._kv_blocks * PagedKVCache.bytes_per_block(self.model.config, self._block_size,
                                                              self._kv_dtype)

    def offload(self) -> int:
        """Weights to host memory (pinned on CUDA), KV pool released; returns the bytes freed on
        the device. Sequences are remembered; their K/V is rebuilt by catch-up after reload."""
        if self.offloaded:
            return 0
        freed = self.loaded_bytes()
        drop_packed(self.model)           # packed copies would pin the old weights
        pin = self.device.type == "cuda"
        self._host_weights = {}
        for name, p in self.model.named_parameters():
            host = torch.empty(p.shape, dtype=p.dtype, device="cpu", pin_memory=pin)
            host.copy_(p.data)
            self._host_weights[name] = host
            p.data = torch.empty(0, dtype=p.dtype, device=self.device)
        for st in self._seqs.values():
            st.kv_len, st.spec_tail = 0, []
        self._ahead.clear()
        self.kv = None
        # Freed tensors stay in torch's CUDA cache, this process's only: give them back, so that
        # the target (another process, when this is a worker) can have them.
        release_cached_memory(self.device)
        return freed

    def reload(self) -> None:
        """Weights back onto the device, a fresh KV pool. On CUDA the copy runs on a side stream
        so that the target's work on the default stream goes on meanwhile."""
        if not self.offloaded:
            return
        stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            for name, p in self.model.named_parameters():
                p.data = self._host_weights[name].to(self.device, non_blocking=stream is not None)
        if stream is not None:
            stream.synchronize()
        self._host_weights = None
        if self._pack:
            pack_linears(self.model)
        self.kv = PagedKVCache.for_model(self.model.config, self.kv_bytes(),
                                         block_size=self._block_size, dtype=self._kv_dtype,
                                         device=self.device)

    def reload_async(self) -> Future:
        """Reload on a helper thread (decoding goes on); the future's result is its seconds."""
        pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="nightdraft-reload")
        t0 = time.perf_counter()
        future = pool.submit(lambda: (self.reload(), time.perf_counter() - t0)[1])
        pool.shutdown(wait=False)
        return future

    def stats(self) -> ProposerStats:
        return ProposerStats(last_propose_s=self.last_propose_s, last_catchup_s=self.last_catchup_s,
                             catchup_tokens=self.num_catchup_tokens, num_sequences=len(self._seqs),
                             kv_usage=self.kv.usage() if self.kv is not None else 0.0,
                             ahead=self.ahead_stats.as_dict())

    def propose_async(self, requests: list[DraftRequest]) -> Done:
        return Done(requests, self.propose(requests))

    @torch.inference_mode()
    def propose(self, requests: list[DraftRequest]) -> list[Proposal]:
        if self.offloaded:
            raise RuntimeError("the drafter is offloaded; reload it before proposing")
        t0 = time.perf_counter()
        proposals = [Proposal([], None) for _ in requests]
        active: list[int] = []
        for i, req in enumerate(requests):
            pre = self._ahead.pop(req.seq_id, None)
            if pre is not None and self._use_pre_draft(req, pre, proposals, i):
                continue
            try:
                st = self._sync(req)
            except Desynchronised:
                self.free(req.seq_id)
                proposals[i].resync = True
                continue
            except Exception as e:  # noqa: BLE001 - this request's own state; isolate it
                self._forget(req, proposals, i, e)
                continue
            done = st.grammar is not None and st.grammar.terminated     # nothing may follow
            if req.gamma > 0 and not done and self.kv.ensure_capacity(req.seq_id, len(st.tokens) + req.gamma - 1):
                active.append(i)
            # else: no room in the drafter's cache; this sequence simply isn't speculated on.
        self._draft_isolated(requests, active, proposals, t0)
        self.last_propose_s = time.perf_counter() - t0
        return proposals

    def _use_pre_draft(self, req: DraftRequest, pre: PreDraft, proposals: list[Proposal], i: int) -> bool:
        """Serve `req` from its pre-draft if the verdict is the one it bet on (a hit)."""
        accepted = pre.accepted(req.start, req.new_tokens)
        st = self._seqs.get(req.seq_id)
        hit = st is not None and len(st.tokens) == req.start and pre.matches(req.start, req.new_tokens, req.gamma)
        if accepted is not None:
            self.ahead_stats.record(accepted, hit, pre.seconds)
        if not hit:
            return False
        st.tokens.extend(req.new_tokens)
        st.spec_tail = pre.tokens[:max(st.kv_len - len(st.tokens), 0)]   # K/V written ahead
        proposals[i] = Proposal(pre.tokens[:req.gamma],
                                None if pre.probs is None else pre.probs[:req.gamma])
        return True

    @torch.inference_mode()
    def draft_ahead(self, requests: list[DraftRequest], proposals: list[Proposal],
                    should_stop: Callable[[], bool] | None = None) -> None:
        """Pre-draft the next round of every request that asked for it (``ahead``) and got its
        full gamma, betting on all its drafts accepted and the bonus token being the drafter's
        own next token (:mod:`backend.speculation.draft_ahead`). `should_stop` is asked between
        forwards: the worker stops when the next message arrives."""
        if self.offloaded:
            return
        t0 = time.perf_counter()
        bets, saved = [], []
        for req, p in zip(requests, proposals):
            st = self._seqs.get(req.seq_id)
            g = req.gamma
            # (Not under a grammar: the bet would have to take its matcher along and back.)
            if (not req.ahead or st is None or st.grammar is not None or p.error or p.resync or g == 0
                    or len(p.tokens) != g
                    or st.kv_len != len(st.tokens) + g - 1
                    or len(st.tokens) + 2 * g + 1 > self.model.config.max_position_embeddings
                    or not self.kv.ensure_capacity(req.seq_id, len(st.tokens) + 2 * g)):
                continue
            saved.append((st, len(st.tokens), st.kv_len, list(st.spec_tail)))
            st.tokens.extend(p.tokens)           # as if all accepted: d_gamma is fed next
            st.spec_tail = []
            bets.append(DraftRequest(req.seq_id, [], g + 1, req.params, len(st.tokens)))
        if not bets:
            return
        drafts = [Proposal([], None) for _ in bets]
        try:
            self._draft(bets, list(range(len(bets))), drafts, t0, should_stop=should_stop)
        except Exception:  # noqa: BLE001 - a failed bet costs nothing: undo it, draft in line later
            for (st, n, kv_len, tail), bet in zip(saved, bets):
                del st.tokens[n:]
                st.kv_len, st.spec_tail = kv_len, tail
                self.kv.truncate(bet.seq_id, kv_len)
            return
        seconds = time.perf_counter() - t0
        for (st, n, _, _), bet, d in zip(saved, bets, drafts):
            written = st.tokens[n:] + st.spec_tail      # d_1..d_gamma, then x, e_1, ... as fed
            del st.tokens[n:]
            st.spec_tail = written[:st.kv_len - n]
            if len(d.tokens) < bet.gamma:
                self.ahead_stats.interrupted += 1
                continue
            self._ahead[bet.seq_id] = PreDraft(n, written[:bet.gamma - 1] + d.tokens[:1], d.tokens[1:],
                                               None if d.probs is None else d.probs[1:], seconds)

    def _forget(self, req: DraftRequest, proposals: list[Proposal], i: int, error: Exception) -> None:
        self.free(req.seq_id)
        proposals[i] = Proposal([], None, error=f"{type(error).__name__}: {error}")

    def _draft_isolated(self, requests, active: list[int], proposals: list[Proposal], t0: float) -> None:
        """Draft `active` in one batch; if that raises, undo its effect on the sequences'
        caches and retry each half alone, so only the request(s) that fail alone lose drafts."""
        if not active:
            return
        states = [self._seqs[requests[i].seq_id] for i in active]
        cached = [st.kv_len for st in states]
        try:
            self._draft(requests, active, proposals, t0)
        except Exception as e:  # noqa: BLE001 - bisect to the request(s) at fault
            for i, st, kv_len in zip(active, states, cached):
                st.kv_len, st.spec_tail = kv_len, []     # K/V below kv_len was not touched
                proposals[i] = Proposal([], None)
            if len(active) == 1:
                self._forget(requests[active[0]], proposals, active[0], e)
                return
            half = len(active) // 2
            self._draft_isolated(requests, active[:half], proposals, t0)
            self._draft_isolated(requests, active[half:], proposals, t0)

    def _draft(self, requests, active: list[int], proposals: list[Proposal], t0: float,
               should_stop: Callable[[], bool] | None = None) -> None:
        # Forward 1 feeds each sequence's uncached tail (usually 1-2 tokens); forwards 2..gamma
        # feed the previous draft. A sequence drops out once it has its gamma drafts.
        feed = {i: self._seqs[requests[i].seq_id].tokens[self._seqs[requests[i].seq_id].kv_len:]
                for i in active}
        catchup = sum(max(0, len(f) - 1) for f in feed.values())
        self.num_catchup_tokens += catchup
        step = 0
        rows: list[int] = []            # the previous forward's row of each active sequence
        dists: dict[int, list[torch.Tensor]] = {}     # a sampled request's draft distributions
        in_grammar: dict[str, int] = {}   # drafts a sequence's grammar took (undone at the end)
        try:
            while active and not (step and should_stop is not None and should_stop()):
                seq_ids = [requests[i].seq_id for i in active]
                states = [self._seqs[s] for s in seq_ids]
                num_new = [len(feed[i]) for i in active]
                if step == 0:      # the catch-up tails; then one draft a position, the layout advanced
                    lookahead = max(requests[i].gamma for i in active) - 1
                    logits = self.runner.forward(seq_ids, [st.kv_len for st in states], num_new,
                                                 [t for i in active for t in feed[i]], lookahead=lookahead)
                else:
                    logits = self.runner.advance(rows, [feed[i][0] for i in active])
                tokens, probs = self._draw(logits, [requests[i].params for i in active], states,
                                           [proposals[i].tokens for i in active])
                still: list[int] = []
                rows = []
                for row, i in enumerate(active):
                    st = states[row]
                    st.kv_len += num_new[row]
                    if st.kv_len > len(st.tokens):
                        st.spec_tail.append(feed[i][-1])
                    proposals[i].tokens.append(tokens[row])
                    if probs is not None and not requests[i].params.greedy:
                        dists.setdefault(i, []).append(probs[row])
                    more = len(proposals[i].tokens) < requests[i].gamma
                    if st.grammar is not None:
                        # The grammar follows the drafts (its mask chose them); at its end, or if
                        # it refuses one, drafting this sequence stops.
                        took = st.grammar.accept(tokens[row])
                        if took:
                            in_grammar[seq_ids[row]] = in_grammar.get(seq_ids[row], 0) + 1
                        more = more and took and not st.grammar.terminated
                    if more:
                        feed[i] = [tokens[row]]
                        still.append(i)
                        rows.append(row)
                active = still
                if step == 0:
                    self.last_catchup_s = time.perf_counter() - t0 if catchup else 0.0
                step += 1
        finally:
            for seq_id, n in in_grammar.items():
                self._seqs[seq_id].grammar.rollback(n)
        for i, rows_of_i in dists.items():
            proposals[i].probs = torch.stack(rows_of_i)

    def _sync(self, req: DraftRequest) -> _SeqState:
        """Append newly committed tokens; keep only the cached drafts that were accepted."""
        st = self._seqs.get(req.seq_id)
        if st is not None and req.start == 0:     # sent again from the start: begin afresh
            self.free(req.seq_id)
            st = None
        held = len(st.tokens) if st is not None else 0
        if req.start != held:
            raise Desynchronised(f"sequence {req.seq_id!r}: tokens from position {req.start}, "
                                 f"the drafter holds {held}")
        if st is None:
            # Its own stream of draws, derived from the request's seed (wrapping at 2**64, the
            # largest seed a generator takes) or from the drafter's seed source.
            seed = (req.params.seed + 1) % 2**64 if req.params.seed is not None else \
                int(torch.randint(0, 2**62, (1,), generator=self._seed_source))
            st = self._seqs[req.seq_id] = _SeqState(generator=make_generator(seed, self.device),
                                                    num_prompt=req.num_prompt_tokens,
                                                    grammar=self._matcher(req.params))
        base = len(st.tokens)
        matched = common_prefix_len(st.spec_tail, req.new_tokens)
        st.tokens.extend(req.new_tokens)
        if st.grammar is not None:
            for tok in st.tokens[max(base, st.num_prompt):]:
                if not st.grammar.accept(tok):      # out of step with the target's: draft freely
                    st.grammar = None
                    break
        st.kv_len = min(st.kv_len, base + matched, len(st.tokens) - 1)
        st.spec_tail = []
        if base:   # a new sequence owns no blocks yet
            self.kv.truncate(req.seq_id, st.kv_len)
        return st

    def _matcher(self, params: SamplingParams) -> Matcher | None:
        """A request's grammar, compiled here from the drafter's own tokenizer (the target's: they
        share it) and cached per form; None without structured outputs (or without a tokenizer)."""
        if params.structured_outputs is None or self.tokenizer_path is None:
            return None
        if self._grammars is None:
            from backend.model.tokenizer import Tokenizer
            tok = Tokenizer.from_pretrained(self.tokenizer_path, eos_token_ids=self.model.config.eos_token_ids)
            self._grammars = GrammarCompiler(tok, self.vocab_size)
        return self._grammars.matcher(params.structured_outputs)

    def _draw(self, logits: torch.Tensor, params: list[SamplingParams], states: list[_SeqState],
              drafted: list[list[int]]):
        """Each row's draft: the argmax for greedy requests, a draw from its processed
        distribution (each sequence's own generator) for sampled ones; one transfer to the host.
        A request's logits processors see its tokens followed by what it `drafted` so far, as the
        target's verification will at that position: drafts then follow the distribution they are
        checked against, and acceptance stays what it is without processors."""
        constrained = [row for row, st in enumerate(states) if st.grammar is not None]
        if constrained:     # structured outputs: only what the grammar allows, as the target will
            mask_rows(logits, constrained, [states[r].grammar for r in constrained])
        procs = [row for row, p in enumerate(params) if p.processes_logits]
        if procs:
            contexts = [Context(params[r], states[r].tokens, states[r].num_prompt) for r in procs]
            process_logits(logits, procs, contexts, [Row(k, drafted[r]) for k, r in enumerate(procs)])
        if all(p.greedy for p in params):
            return logits.argmax(dim=-1).tolist(), None
        probs = processed_probs(logits, params)
        sampled = [row for row, p in enumerate(params) if not p.greedy]
        drawn = sample_rows(probs[sampled], draw_uniforms([1] * len(sampled), [states[r].generator for r in sampled],
                                                          probs.device))
        tokens = logits.argmax(dim=-1)
        tokens[torch.as_tensor(sampled, device=tokens.device)] = drawn
        return check_drawn(tokens.tolist()), probs
