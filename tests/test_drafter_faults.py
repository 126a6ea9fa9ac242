"""Fault injection: the drafter worker killed or stopped at each phase of its protocol, in sd, psd
and auto modes. Every request completes, greedy output equals plain decoding, the target's KV
pool and the drafter agree on who holds the drafter's memory, and a new worker comes up.

The worker is a real process; the test only chooses the moment (by wrapping the engine-side
`RemoteDrafter` methods that talk to it) and then kills it with SIGKILL or stops it with SIGSTOP.
A stopped worker is the harder case: it is alive, so only deadlines (on sends as well as on
receives) notice it. To make a send block as a long resync would, the test fills the socket's
buffer first.
"""
from __future__ import annotations

import errno
import os
import signal
import socket
import threading
import time

import pytest

from backend.speculation.worker import RemoteDrafter
from backend.engine.engine import Engine
from backend.engine.config import EngineConfig
from backend.sampling.params import SamplingParams
from helpers.arms import force_arms
from helpers.engines import block_bytes
from model_factory import TINY_DRAFTER, TINY_TARGET

pytestmark = pytest.mark.slow   # worker processes

GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
SCENARIO_TIMEOUT_S = 90
BASE_BLOCKS = 40
PROMPT_CUTS = (8, 40, 53, 250)      # the conftest's `prompts` and `ar_outputs`


def make_engine(mode: str) -> Engine:
    planner = None
    if mode == "auto":   # eager: offloads under the burst, reloads once the load drops
        planner = {"offload_after_steps": 3, "offload_after_s": 0.0, "offload_gain": 0.0,
                   "offload_demand_ratio": 0.0,
                   "reload_after_s": 0.0, "kv_pressure": 0.5}
    return Engine(EngineConfig(
        target=str(TINY_TARGET), drafter=str(TINY_DRAFTER), mode=mode, gamma=3, gamma_max=4,
        drafter_device="cpu", kv_cache_bytes=BASE_BLOCKS * block_bytes(), planner=planner,
        drafter_timeout_s=1.0, drafter_restart_s=0.2, drafter_reload_timeout_s=2.0,
        # The drafter's cores stay with it: lent to plain decoding, two cores of plain decoding
        # can beat SD at the trickle, and the planner then rightly never reloads the drafter;
        # these tests need every phase of the protocol to happen.
        lend_drafter_cores=False))


# ---- how a fault is delivered ---------------------------------------------------------------------

def kill(rd: RemoteDrafter) -> None:
    rd._proc.kill()
    rd._proc.join(5)


def stop(rd: RemoteDrafter) -> None:
    """SIGSTOP the worker: alive, silent (a process hung in a driver call looks the same)."""
    os.kill(rd._proc.pid, signal.SIGSTOP)


def stop_and_jam(rd: RemoteDrafter) -> None:
    """SIGSTOP the worker and fill its socket until a send would block (as a resync bigger than
    the free buffer does): only a deadline on sends can notice now."""
    os.kill(rd._proc.pid, signal.SIGSTOP)
    with socket.socket(fileno=os.dup(rd._conn.fileno())) as s:
        s.setblocking(False)
        try:
            while True:
                s.send(b"\0" * 4096)
        except OSError as e:
            assert e.errno in (errno.EAGAIN, errno.EWOULDBLOCK)


class Fault:
    """Deliver `action` to the worker the `nth` time the engine reaches `phase`."""

    def __init__(self, phase: str, action, nth: int = 1):
        self.phase, self.action, self.nth = phase, action, nth
        self.seen = 0
        self.fired_pid: int | None = None

    def reached(self, rd: RemoteDrafter) -> None:
        self.seen += 1
        if self.seen == self.nth and self.fired_pid is None:
            self.fired_pid = rd._proc.pid
            self.action(rd)

    def arm(self, monkeypatch) -> None:
        fault = self
        send, collect = RemoteDrafter._send, RemoteDrafter._collect

        def _send(rd, msg, timeout_s=None):
            if fault.phase == "before_propose" and msg[0] == "propose":
                fault.reached(rd)            # the worker is stopped before this send
            send(rd, msg, timeout_s)
            if msg[0] == {"propose_in_flight": "propose", "offload": "offload",
                          "reload": "reload"}.get(fault.phase):
                fault.reached(rd)            # sent; the reply is still owed

        def _collect(rd, call_id):
            out = collect(rd, call_id)
            if fault.phase == "proposals_collected":
                fault.reached(rd)
            return out

        monkeypatch.setattr(RemoteDrafter, "_send", _send)
        monkeypatch.setattr(RemoteDrafter, "_collect", _collect)


# ---- the scenario ---------------------------------------------------------------------------------

def drive(engine: Engine, prompts, fault: Fault, offload_at: int | None, reload_at: int | None):
    """Requests in a burst, then one by one; fixed modes lend and take back the drafter's
    memory at the given steps (mode auto's planner does it by itself). Returns tokens per prompt."""
    tokens = {i: [] for i in range(len(prompts))}
    reasons = {}
    pending = list(range(len(prompts)))
    burst, step = pending[:6], 0
    for i in burst:
        engine.add_request(str(i), prompts[i], GREEDY)
    rest = pending[6:]
    while engine.has_unfinished() or rest:
        if not engine.has_unfinished():       # the trickle: low load, so auto reloads
            # Idle between requests, as the engine loop is: mode auto brings an offloaded
            # drafter back here (reload_after_s is 0), whatever its bandit would choose next.
            engine.poll_background()
            i = rest.pop(0)
            engine.add_request(str(i), prompts[i], GREEDY)
        if step == offload_at:
            engine.set_gamma(0)
            engine.memory.offload()
        if step == reload_at:
            engine.memory.start_reload()
        if reload_at is not None and step > reload_at and engine.drafter.state == "on_device":
            engine.set_gamma(3)
        for o in engine.step():
            tokens[int(o.request_id)] += o.new_token_ids
            if o.finished:
                reasons[int(o.request_id)] = o.finish_reason
        assert engine.memory.agrees(), (f"step {step}: pool {engine.kv.num_blocks} blocks "
                                        f"(base {engine.memory.base_blocks}), drafter {engine.drafter.state}")
        step += 1
    return tokens, reasons


def wait_for_new_worker(engine: Engine, old_pid: int, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        engine.step()           # idle steps poll the manager, which swaps the replacement in
        d = engine.drafter.drafter
        if d is not None and d.pid != old_pid and engine.drafter.state in ("on_device", "offloaded"):
            return
        time.sleep(0.05)
    raise AssertionError(f"no new worker after {timeout_s} s (state {engine.drafter.state})")


PHASES = {
    # phase: (action, nth time, fixed modes' offload/reload steps)
    "propose_in_flight": (kill, 4, (None, None)),
    "proposals_collected": (kill, 4, (None, None)),
    "stopped_before_propose": (stop_and_jam, 4, (None, None)),
    "offload": (kill, 1, (5, None)),
    "while_offloaded": (kill, 1, (5, None)),
    "reload": (kill, 1, (5, 12)),
    # hangs while its weights come back: only the reload deadline notices
    "stopped_during_reload": (stop, 1, (5, 12)),
}


@pytest.mark.parametrize("mode", ["sd", "psd", "auto"])
@pytest.mark.parametrize("phase", list(PHASES))
def test_worker_faults_lose_nothing(mode, phase, prompts, ar_outputs, monkeypatch):
    action, nth, (offload_at, reload_at) = PHASES[phase]
    if mode == "auto":
        offload_at = reload_at = None          # the planner lends and takes back by itself
    wire = {"stopped_before_propose": "before_propose", "while_offloaded": "proposals_collected",
            "stopped_during_reload": "reload"}
    fault = Fault(wire.get(phase, phase), action, nth)
    engine = make_engine(mode)
    if phase == "while_offloaded":    # the worker dies while its memory is lent to the pool
        fault = Fault("never", action)
        orig = engine.memory.offload

        def offload_then_die():
            orig()
            if engine.drafter.offloaded and fault.fired_pid is None:
                fault.reached(engine.drafter.drafter)
        engine.memory.offload = offload_then_die
    fault.arm(monkeypatch)
    result: dict = {}

    def scenario():
        try:
            result["out"] = drive(engine, prompts, fault, offload_at, reload_at)
        except BaseException as e:   # noqa: BLE001 - reported below
            result["error"] = e
    t = threading.Thread(target=scenario, daemon=True)
    t.start()
    t.join(SCENARIO_TIMEOUT_S)
    try:
        assert not t.is_alive(), f"{mode}/{phase}: the engine hung (a send or receive without a deadline)"
        if "error" in result:
            raise result["error"]
        tokens, reasons = result["out"]
        if mode == "auto" and phase in ("offload", "while_offloaded", "reload", "stopped_during_reload") \
                and fault.fired_pid is None:
            pytest.fail(f"auto: the planner never reached phase {phase} (offloads "
                        f"{engine.memory.offloads}, reloads {engine.memory.reloads})")
        assert fault.fired_pid is not None, f"phase {phase} was never reached"
        assert engine.stats().drafted_tokens > 0, f"{mode}: nothing was ever drafted"
        assert set(reasons.values()) == {"length"} and len(reasons) == len(prompts)
        assert [tokens[i] for i in range(len(prompts))] == ar_outputs
        if phase == "stopped_during_reload":     # only the reload's deadline notices it
            deadline = time.monotonic() + 30
            while engine.drafter.failures == 0 and time.monotonic() < deadline:
                engine.step()
                time.sleep(0.05)
            assert engine.drafter.failures >= 1, f"the drafter is still {engine.drafter.state!r}"
        assert engine.drafter.failures >= 1
        wait_for_new_worker(engine, fault.fired_pid)
        assert engine.memory.agrees()
        assert engine.kv.num_free_blocks == engine.kv.num_blocks
        held = engine.drafter.stats(refresh=True)
        assert held.num_sequences == 0 and held.kv_usage == 0.0
        # and it drafts again: one more request with speculation on
        if engine.drafter.offloaded:
            engine.memory.start_reload()
            while engine.drafter.state != "on_device":
                engine.step()
                time.sleep(0.01)
        engine.set_gamma(3)
        if mode == "auto":          # its planner might choose plain decoding for one request
            force_arms(engine, [("sd", 3)])
        before = engine.stats().drafted_tokens
        engine.generate([prompts[0]], GREEDY)
        assert engine.stats().drafted_tokens > before, "the new worker does not draft"
    finally:
        with_stopped = [p for p in (fault.fired_pid,) if p]
        for pid in with_stopped:     # never leave a stopped process behind
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        engine.close()


def test_close_returns_while_the_worker_is_stopped():
    engine = make_engine("psd")
    rd = engine.drafter.drafter
    stop_and_jam(rd)
    t0 = time.monotonic()
    try:
        engine.drafter.close(timeout_s=1.0)
        assert time.monotonic() - t0 < 5.0, "close() waited on a stopped worker"
        assert not rd._proc.is_alive()
    finally:
        try:
            os.kill(rd._proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        engine.close()


def test_a_step_that_fails_between_drafting_and_collecting_leaves_the_protocol_in_step(prompts, ar_outputs):
    """A failure of the step itself (not of one request) while the other sub-batch's proposal
    is in flight: the proposal is still collected, so the next steps run normally."""
    engine = make_engine("psd")
    run = engine.target_pass.run
    calls = {"n": 0}
    in_flight_at_failure = []

    def fails_once(batch, counts):
        calls["n"] += 1
        owed = engine.drafter.drafter._in_flight      # the call id of a proposal not yet collected
        if calls["n"] >= 6 and not in_flight_at_failure and owed is not None:
            in_flight_at_failure.append(owed)
            raise RuntimeError("injected: the step fails after drafting began")
        return run(batch, counts)
    engine.target_pass.run = fails_once
    try:
        tokens = {i: [] for i in range(len(prompts))}
        for i, p in enumerate(prompts):
            engine.add_request(str(i), p, GREEDY)
        failures = 0
        while engine.has_unfinished():
            try:
                outs = engine.step()
            except RuntimeError as e:
                assert "injected" in str(e), f"a later step failed too: {e}"
                assert engine.drafter.drafter._in_flight is None, "the proposal in flight was left uncollected"
                failures += 1
                continue
            for o in outs:
                tokens[int(o.request_id)] += o.new_token_ids
        assert in_flight_at_failure, "no step ran while a proposal was in flight"
        assert failures == 1 and engine.stats().psd_overlapped_steps > 0
        assert engine.drafter.failures == 0, "the worker was blamed for the engine's failure"
        assert [tokens[i] for i in range(len(prompts))] == ar_outputs
    finally:
        engine.close()


def test_a_drafter_that_cannot_load_is_retried_with_growing_waits_up_to_a_cap(tmp_path, prompts, ar_outputs, monkeypatch):
    """The checkpoint goes missing under a running server and the worker dies: every new worker
    fails to load. Attempts come at growing intervals (0.2 s, 0.4 s, then the 0.8 s cap), not
    every 0.2 s forever, the state says so, and once the checkpoint is back the next attempt
    brings a drafter that drafts (and the wait is back at its base once it has served for as long as
    the wait before it)."""
    import shutil
    from backend.speculation.manager import DrafterManager
    drafter_dir = shutil.copytree(TINY_DRAFTER, tmp_path / "drafter")
    engine = Engine(EngineConfig(
        target=str(TINY_TARGET), drafter=str(drafter_dir), mode="sd", gamma=3, drafter_device="cpu",
        kv_cache_bytes=BASE_BLOCKS * block_bytes(), drafter_timeout_s=5.0,
        drafter_restart_s=0.2, drafter_restart_max_s=0.8, lend_drafter_cores=False))
    attempts: list[tuple[float, float, bool]] = []      # (start, end, came up) per restart attempt
    build = DrafterManager._build

    def recorded_build(manager, offloaded=False):
        t0 = time.monotonic()
        try:
            d = build(manager, offloaded)
        except BaseException:
            attempts.append((t0, time.monotonic(), False))
            raise
        attempts.append((t0, time.monotonic(), True))
        return d
    monkeypatch.setattr(DrafterManager, "_build", recorded_build)
    weights = drafter_dir / "model.safetensors"
    try:
        weights.rename(tmp_path / "moved.safetensors")
        old_pid = engine.drafter.drafter.pid
        engine.drafter.drafter.kill()
        out = engine.generate(prompts[:2], GREEDY)         # the dead worker is noticed here
        assert [c.output_ids for c in out] == ar_outputs[:2]
        assert engine.drafter.failures == 1
        deadline = time.monotonic() + 60
        states = set()
        while sum(not ok for *_, ok in attempts) < 3 and time.monotonic() < deadline:
            engine.step()
            states.add(engine.stats().drafter_state)
            time.sleep(0.02)
        assert len(attempts) >= 3, f"{len(attempts)} attempts in 60 s"
        # each wait at least the doubled one, and the doubling stops at the cap
        waits = [nxt[0] - prev[1] for prev, nxt in zip(attempts, attempts[1:])]
        assert waits[0] >= 0.4 and waits[1] >= 0.8, f"waits between attempts: {waits}"
        st = engine.stats()
        assert st.drafter_restart_failures >= 3 and states <= {"failed", "restarting"}
        assert {"failed", "restarting"} <= states
        assert engine.drafter.backoff.delay_s == 0.8
        assert st.drafter_next_restart_s is None or 0.0 <= st.drafter_next_restart_s <= 0.8

        (tmp_path / "moved.safetensors").rename(weights)
        wait_for_new_worker(engine, old_pid)
        assert attempts[-1][2]
        before = engine.stats().drafted_tokens
        out = engine.generate(prompts[:2], GREEDY)
        assert [c.output_ids for c in out] == ar_outputs[:2]
        assert engine.stats().drafted_tokens > before, "the new worker does not draft"
        # The wait starts over once the new drafter has served for as long as the wait before it.
        time.sleep(max(0.0, engine.drafter.backoff.up_since + 0.8 - time.monotonic()))
        engine.generate(prompts[:1], GREEDY)
        assert engine.drafter.backoff.delay_s == 0.2, "the wait did not go back to its base"
    finally:
        if not weights.exists():
            (tmp_path / "moved.safetensors").rename(weights)
        engine.close()
