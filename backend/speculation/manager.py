"""Owns the engine's drafter: builds it (in-process or as a worker on its own device), keeps
track of what each sequence has sent it, notices when it fails, degrades to plain decoding
meanwhile, and brings a fresh drafter up in the background.

Whatever the drafter does wrong (a worker that dies, hangs or answers out of turn, or whose
weights do not come back within `drafter_reload_timeout_s`; an in-process drafter that raises)
is a failure of the drafter, never of the engine's step: the step goes on without drafts, and a
replacement comes up after `drafter_restart_s`. A drafter that fails again before it has served
(one that cannot load, or dies at once) is retried after twice the wait, and twice that, up to
`drafter_restart_max_s`: a broken drafter costs a restart now and then, not one every few
seconds forever. Its state says where it is: "failed" while it waits for the next attempt,
"restarting" while one is under way. A replacement starts in the memory state of the drafter it
replaces: if the weights had been offloaded (their device memory lent to the target's KV pool),
it starts offloaded too, so the pool and the drafter never both claim that memory.
"""
from __future__ import annotations

import functools
import logging
import threading
import time

import torch

from backend.batching.sequence import Sequence
from backend.errors import ConfigError
from backend.model.config import ModelConfig
from backend.model.kv_cache import PagedKVCache
from backend.speculation.drafter import Drafter
from backend.speculation.ngram import NgramProposer
from backend.mode import ProposerKind
from backend.speculation.proposer import DeviceResident, DraftRequest, Proposal, Proposer, ProposerStats, Remote
from backend.speculation.worker import DrafterFailed, RemoteDrafter, WorkerSpec

log = logging.getLogger("nightdraft.drafter")


class Backoff:
    """When to try a failed drafter again: `drafter_restart_s` after a failure, doubled for each
    failure since a drafter last served, at most `drafter_restart_max_s`."""

    def __init__(self, restart_s: float, restart_max_s: float):
        self.restart_s, self.restart_max_s = restart_s, restart_max_s
        # Failures (of the drafter, or of an attempt to restart it) since a drafter last served.
        self.consecutive_failures = 0
        self.failed_at: float | None = None
        self.up_since = time.monotonic()    # when the drafter in use came up

    @property
    def delay_s(self) -> float:
        doublings = min(max(self.consecutive_failures - 1, 0), 32)
        return min(self.restart_s * 2 ** doublings, max(self.restart_max_s, self.restart_s))

    def failed(self) -> None:
        self.consecutive_failures += 1
        self.failed_at = time.monotonic()

    def served(self) -> None:
        """The drafter served. The backoff starts over only once it has stayed up as long as the
        wait that preceded it: a drafter that serves once and dies again (killed every few
        seconds, out of memory on its second batch) keeps backing off."""
        if time.monotonic() - self.up_since >= self.delay_s:
            self.consecutive_failures = 0

    def wait_left_s(self) -> float | None:
        """Seconds until the next attempt is due (None before any failure)."""
        if self.failed_at is None:
            return None
        return max(0.0, self.failed_at + self.delay_s - time.monotonic())


def shares_target_memory(config) -> bool:
    """Does the drafter share the target's memory? Then offloading it can grow the target's KV
    pool. In-process it does; a worker on another GPU does not; a CPU worker has cores of its
    own but shares the host's RAM (one budget) with the target."""
    dd, td = config.drafter_device, config.device
    if dd is None or dd == td:
        return True
    return dd.startswith("cpu") and td.startswith("cpu")


class DrafterManager:
    def __init__(self, config, *, vocab_size: int, kv_cache_bytes: int,
                 max_rows: int, dtype: torch.dtype, cores: list[int] | None = None):
        self.config = config
        self.cores = cores
        self.remote = config.drafter_device is not None
        self.colocated = shares_target_memory(config)
        self._vocab_size = vocab_size
        self._kv_cache_bytes = kv_cache_bytes
        self._max_rows = max_rows
        self._dtype = dtype
        self.failures = 0
        self.restarts = 0
        self.restart_failures = 0           # restart attempts that did not bring a drafter up
        self.backoff = Backoff(config.drafter_restart_s, config.drafter_restart_max_s)
        self.request_failures = 0           # requests the drafter could not serve (isolated)
        self.last_failure: str | None = None
        self._replacement: Proposer | None = None
        self._restarting = False
        self._closed = False
        self._lock = threading.Lock()
        self.offloaded = False
        self._reload = None                 # a future while weights travel back
        self._reload_deadline = 0.0         # time.monotonic() by which they must be back
        self.last_reload_s = 0.0
        # What drafters that failed had counted (catch-up tokens, their worker's CPU seconds): the
        # engine's totals add it, so that they never go back on a restart.
        self.retired = ProposerStats()
        # seq id -> how many of its tokens the drafter has been sent (its sync offset)
        self._synced: dict[str, int] = {}
        self.drafter: Proposer | None = self._build()

    # -- construction ----------------------------------------------------------------------------

    @classmethod
    def for_target(cls, config, target_config: ModelConfig, target_kv_blocks: int, dtype: torch.dtype,
                   cores: list[int] | None = None) -> "DrafterManager":
        """The manager of an engine's proposer: an n-gram one holds nothing; a drafter model must
        share the target's tokenizer, and its KV pool holds as many tokens as the target's
        (unless ``drafter_kv_cache_bytes`` says otherwise)."""
        if config.proposer is ProposerKind.NGRAM:
            return cls(config, vocab_size=target_config.vocab_size, kv_cache_bytes=0, max_rows=0, dtype=dtype)
        dcfg = ModelConfig.from_pretrained(config.drafter)
        if dcfg.vocab_size != target_config.vocab_size:
            raise ConfigError(f"drafter vocab ({dcfg.vocab_size}) differs from the target's "
                              f"({target_config.vocab_size}); they must share a tokenizer")
        budget = config.drafter_kv_cache_bytes
        if budget is None:
            budget = target_kv_blocks * PagedKVCache.bytes_per_block(dcfg, config.block_size, dtype)
        return cls(config, vocab_size=dcfg.vocab_size, kv_cache_bytes=budget,
                   max_rows=config.max_num_seqs * config.gamma_max, dtype=dtype, cores=cores)

    def _build(self, offloaded: bool = False):
        cfg = self.config
        if cfg.proposer is ProposerKind.NGRAM:
            return NgramProposer(self._vocab_size, cfg.ngram_min, cfg.ngram_max, device=cfg.device)
        if not self.remote:
            return Drafter.load(cfg.drafter, device=cfg.device, dtype=self._dtype,
                                kv_cache_bytes=self._kv_cache_bytes, block_size=cfg.block_size,
                                seed=cfg.seed, offloaded=offloaded, pack=cfg.linear_kernels == "auto",
                                attention=cfg.attention, compile=cfg.compile, max_query_len=cfg.gamma_max + 1)
        spec = WorkerSpec(path=cfg.drafter, device=cfg.drafter_device,
                          dtype=str(self._dtype).removeprefix("torch."),
                          kv_cache_bytes=self._kv_cache_bytes, block_size=cfg.block_size,
                          seed=cfg.seed, cores=self.cores, probs_transport=cfg.drafter_probs_transport,
                          start_offloaded=offloaded, pack_linears=cfg.linear_kernels == "auto",
                          attention=cfg.attention, compile=cfg.compile, max_query_len=cfg.gamma_max + 1)
        return RemoteDrafter(spec, vocab_size=self._vocab_size, max_rows=self._max_rows,
                             timeout_s=cfg.drafter_timeout_s, reload_timeout_s=cfg.drafter_reload_timeout_s)

    # -- state -----------------------------------------------------------------------------------

    @property
    def available(self) -> bool:
        """Ready to propose: alive, weights on its device."""
        return self.drafter is not None and not self.offloaded

    @property
    def state(self) -> str:
        if self.drafter is None:
            return "restarting" if self._restarting or self._replacement is not None else "failed"
        if self._reload is not None:
            return "reloading"
        return "offloaded" if self.offloaded else "on_device"

    @property
    def next_restart_in_s(self) -> float | None:
        """Seconds until the next restart attempt while the drafter is down and waiting; None
        otherwise."""
        return self.backoff.wait_left_s() if self.state == "failed" else None

    def stats(self, refresh: bool = False) -> ProposerStats:
        """The proposer's own report (zeros while there is none). `refresh`: ask a worker now
        rather than take what its last reply said."""
        d = self.drafter
        if refresh and isinstance(d, Remote):
            try:
                d.refresh_stats()
            except Exception as e:  # noqa: BLE001 - any failure of the drafter is the drafter's
                self._failed(e)
        return self.drafter.stats() if self.drafter is not None else ProposerStats()

    def lag_tokens(self, seqs: list[Sequence]) -> int:
        """Tokens of these sequences the drafter has not been sent yet (its catch-up work)."""
        return sum(len(s) - self._synced.get(s.request_id, 0) for s in seqs)

    # -- elastic memory (a drafter model's; an n-gram proposer holds none) -----------------------

    def device_bytes(self) -> int:
        """Bytes the drafter holds on its device now (weights + KV pool); 0 when offloaded."""
        d = self.drafter
        return d.loaded_bytes() if _device_resident(type(d)) and not self.offloaded else 0

    def offload(self) -> int:
        """Drafter weights to host memory and its KV pool released; bytes freed on its device."""
        if not _device_resident(type(self.drafter)) or self.offloaded:
            return 0
        try:
            freed = self.drafter.offload()
        except Exception as e:  # noqa: BLE001 - any failure of the drafter is the drafter's
            self._failed(e)
            return 0
        self.offloaded = True
        return freed

    def start_reload(self) -> None:
        """Bring the weights back without blocking decoding; `poll_reload` says when."""
        if self.state != "offloaded":      # not offloaded, already coming back, or down
            return
        try:
            self._reload = self.drafter.reload_async()
            self._reload_deadline = time.monotonic() + self.config.drafter_reload_timeout_s
        except Exception as e:  # noqa: BLE001
            self._failed(e)

    def poll_reload(self) -> float | None:
        """Seconds the reload took, once it has just finished; None otherwise."""
        if self._reload is None:
            return None
        try:
            if not self._reload.done():
                if time.monotonic() > self._reload_deadline:
                    raise DrafterFailed(f"the drafter's weights did not come back within "
                                        f"{self.config.drafter_reload_timeout_s:g}s (drafter_reload_timeout_s)")
                return None
            seconds = self._reload.result()
        except Exception as e:  # noqa: BLE001 - a failed (or hung) reload is a failed drafter
            self._failed(e)
            return None
        self._reload = None
        self.offloaded = False
        self.last_reload_s = seconds
        self.backoff.served()
        return seconds

    # -- the protocol, failure-tolerant ----------------------------------------------------------

    def propose_async(self, wanted: list[tuple[Sequence, int]], ahead: bool = False):
        """Drafts for (sequence, gamma) pairs on their way (`collect` them), or None when the
        drafter is unavailable. `ahead`: the drafter may then pre-draft the next round (see
        ``draft_ahead``)."""
        if not self.available or not wanted:
            return None
        requests = []
        for seq, gamma in wanted:       # each sends what the drafter has not seen of it
            start = self._synced.get(seq.request_id, 0)
            self._synced[seq.request_id] = len(seq)
            requests.append(DraftRequest(seq.request_id, seq.token_ids[start:], gamma, seq.params, start,
                                         ahead, seq.num_prompt_tokens))
        try:
            return self.drafter.propose_async(requests)
        except Exception as e:  # noqa: BLE001
            self._failed(e)
            return None

    def collect(self, pending) -> list[Proposal] | None:
        if pending is None or self.drafter is None:
            return None
        try:
            proposals = pending.result()
        except Exception as e:  # noqa: BLE001
            self._failed(e)
            return None
        self.backoff.served()
        for req, p in zip(pending.requests, proposals):
            if p.error is not None or p.resync:   # the drafter forgot it: resend it whole next time
                self._synced.pop(req.seq_id, None)
            if p.error is not None:
                self.request_failures += 1
                log.warning("drafter could not serve request %s (%s); it decodes without drafts",
                            req.seq_id, p.error)
        return proposals

    def free(self, seq_id: str) -> None:
        self._synced.pop(seq_id, None)
        if self.drafter is None:
            return
        try:
            self.drafter.free(seq_id)
        except Exception as e:  # noqa: BLE001
            self._failed(e)

    def _failed(self, error: Exception) -> None:
        self.failures += 1
        self.backoff.failed()
        self.last_failure = f"{type(error).__name__}: {error}"
        log.error("drafter failed (%s); decoding without speculation until a new one is up "
                  "(next attempt in %.1fs)", self.last_failure, self.backoff.delay_s)
        dead, self.drafter = self.drafter, None
        if dead is not None:
            try:
                last = dead.stats()       # a worker's: as its last reply had them (no call)
            except Exception:  # noqa: BLE001 - a broken drafter's counts are lost, nothing else
                last = ProposerStats()
            self.retired = ProposerStats(catchup_tokens=self.retired.catchup_tokens + last.catchup_tokens,
                                         cpu_s=self.retired.cpu_s + last.cpu_s)
        if self._reload is not None:
            # The target pool shrank back before the reload began: a replacement may load
            # onto the device. Otherwise `offloaded` stays: that memory is still lent.
            self.offloaded = False
        self._reload = None
        self._synced.clear()
        if isinstance(dead, Remote):
            try:
                dead.close(timeout_s=1.0)
            except Exception:  # noqa: BLE001 - it is already broken; nothing more to report
                pass

    # -- restarts --------------------------------------------------------------------------------

    def poll(self) -> bool:
        """Called every step: start a replacement after a failure, swap it in once ready.
        True when a new drafter just came in (it knows no sequences yet)."""
        if self.drafter is not None:
            return False
        with self._lock:
            ready, self._replacement = self._replacement, None
        if ready is not None:
            self.drafter = ready
            self.backoff.up_since = time.monotonic()
            self.restarts += 1
            log.info("drafter restarted%s; speculation resumes%s",
                     f" (pid {ready.pid})" if getattr(ready, "pid", None) else "",
                     " once its weights are back" if self.offloaded else "")
            return True
        if not self._restarting and self.backoff.wait_left_s() == 0.0:
            self._restarting = True
            threading.Thread(target=self._restart, args=(self.offloaded,),
                             name="nightdraft-drafter-restart", daemon=True).start()
        return False

    def _restart(self, offloaded: bool) -> None:
        try:
            fresh = self._build(offloaded=offloaded)
            with self._lock:
                if not self._closed:
                    self._replacement, fresh = fresh, None
            if isinstance(fresh, Remote):     # the engine closed meanwhile
                fresh.close(timeout_s=1.0)
        except Exception as e:  # noqa: BLE001 - a failed restart is retried later
            self.restart_failures += 1
            self.backoff.failed()
            self.last_failure = f"restart: {type(e).__name__}: {e}"
            log.error("drafter restart failed (%s); next attempt in %.1fs", e, self.backoff.delay_s)
        finally:
            self._restarting = False

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the worker (and a replacement that came up meanwhile) within `timeout_s` each."""
        with self._lock:
            self._closed = True
            spare, self._replacement = self._replacement, None
        for d in (self.drafter, spare):
            if isinstance(d, Remote):
                d.close(timeout_s=timeout_s)
        self.drafter = None


@functools.lru_cache(maxsize=None)
def _device_resident(cls: type) -> bool:
    """Do a proposer class's instances hold device memory (:class:`DeviceResident`)? Asked of the
    class once: the protocol's ``isinstance`` inspects every member on every call (12 µs on a
    CPU, and the load snapshot asks on every step)."""
    return issubclass(cls, DeviceResident)
