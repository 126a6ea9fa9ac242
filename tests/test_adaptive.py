"""mode = "auto": the planner switches gamma and mode, and offloads the drafter, losslessly."""
import time

import pytest

from backend.engine.engine import Engine
from backend.engine.config import ConfigError, EngineConfig
from backend.mode import Mode
from backend.sampling.params import SamplingParams
from helpers.arms import force_arms
from helpers.engines import block_bytes
from model_factory import TINY_DRAFTER, TINY_TARGET

GREEDY = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
PROMPT_CUTS = (24, 20, 29, 250)      # the conftest's `prompts` and `ar_outputs`


def eager_offload_engine() -> Engine:
    """A tight pool and an eager offload policy (offload on sustained pressure alone, reload as
    soon as the load fits): a run offloads under load (many requests at once) and reloads when
    speculation is chosen again."""
    return Engine(EngineConfig(
        target=str(TINY_TARGET), drafter=str(TINY_DRAFTER), mode="auto", gamma_max=4,
        kv_cache_bytes=30 * block_bytes(),
        planner={"offload_after_steps": 3, "offload_after_s": 0.0, "kv_pressure": 0.5,
                 "offload_gain": 0.0, "offload_demand_ratio": 0.0, "reload_after_s": 0.0}))


def test_auto_is_lossless_through_switches_offloads_and_reloads(prompts, ar_outputs):
    engine = eager_offload_engine()
    try:
        burst = engine.generate(prompts[:16], GREEDY)                         # high load
        # Low load, speculating (scripted: whether the planner turns speculation back on within
        # four requests is this machine's timing, and the reload is what this run must cross).
        force_arms(engine, [("sd", 4), ("sd", 2)])
        trickle = engine.generate(prompts[16:], GREEDY, max_concurrency=1)
        assert [c.output_ids for c in burst + trickle] == ar_outputs
        stats = engine.stats()
        assert stats.drafted_tokens > 0, "the planner never speculated"
        assert engine.planner.stats()["arm_counts"], "the planner made no decisions"
        assert stats.planner_switches > 0, "the planner never switched"
        assert stats.offloads >= 1, "the burst did not offload the drafter"
        assert stats.reloads >= 1, "the trickle did not bring the drafter back"
        assert engine.drafter.state == "on_device" and engine.kv.num_blocks == 30
        assert engine.kv.num_free_blocks == engine.kv.num_blocks
        assert engine.drafter.stats().num_sequences == 0
    finally:
        engine.close()


def test_offload_then_reload_under_auto(prompts, ar_outputs):
    engine = Engine(EngineConfig(
        target=str(TINY_TARGET), drafter=str(TINY_DRAFTER), mode="auto", gamma_max=4,
        kv_cache_bytes=24 * block_bytes(),
        planner={"offload_after_steps": 2, "offload_after_s": 0.0, "kv_pressure": 0.3,
                 "modes": ("ar",)}))
    try:
        # Only plain decoding allowed: a sustained gamma = 0 under pressure must offload.
        out = engine.generate(prompts[:12], GREEDY)
        assert [c.output_ids for c in out] == ar_outputs[:12]
        assert engine.stats().offloads == 1
        assert engine.drafter.state == "offloaded"
        assert engine.kv.num_blocks > 24, "the freed drafter bytes did not grow the target pool"
        assert engine.kv.num_free_blocks == engine.kv.num_blocks
        # Then speculation is chosen (scripted: this planner may only decode plainly): the
        # controller starts the reload, decodes plainly until the weights are back, then drafts.
        force_arms(engine, [("sd", 4)])
        drafted = engine.stats().drafted_tokens
        out = engine.generate(prompts[12:16], GREEDY, max_concurrency=1)
        assert [c.output_ids for c in out] == ar_outputs[12:16]
        st = engine.stats()
        assert st.reloads == 1 and engine.drafter.state == "on_device", "the drafter did not come back"
        assert engine.kv.num_blocks == 24, "the lent blocks did not go back to the drafter"
        assert st.drafted_tokens > drafted, "no drafts after the reload"
        assert engine.kv.num_free_blocks == engine.kv.num_blocks
    finally:
        engine.close()


@pytest.mark.parametrize("pool_blocks, offloads", [(None, False), (12, True)],
                         ids=["ample-pool", "tight-pool"])
def test_only_requests_admission_turned_away_are_memory_pressure(prompts, ar_outputs,
                                                                 pool_blocks, offloads):
    """In a closed loop each finished request's successor waits for one step before admission
    takes it, with the pool nearly empty: that is not a queue, and offloading on it moved the
    drafter to host memory at the start of a burst. With a pool too small for the burst,
    admission turns requests away and the same settings offload."""
    kw = {"kv_cache_bytes": pool_blocks * block_bytes()} if pool_blocks else {}
    engine = Engine(EngineConfig(
        target=str(TINY_TARGET), drafter=str(TINY_DRAFTER), mode="auto", gamma_max=4, **kw,
        planner={"offload_after_steps": 2, "offload_after_s": 0.0, "kv_pressure": 1.0,
                 "offload_demand_ratio": 0.0, "modes": ("ar",)}))
    turned_away = []
    try:
        out = engine.generate(prompts[:12], GREEDY, max_concurrency=None if pool_blocks else 3,
                              on_step=lambda _o: turned_away.append(engine.scheduler.num_left_waiting))
        assert [c.output_ids for c in out] == ar_outputs[:12]
        assert (max(turned_away) > 0) == offloads, turned_away
        assert (engine.stats().offloads > 0) == offloads
    finally:
        engine.close()


def test_planner_settings_are_validated():
    with pytest.raises(ConfigError, match="unknown setting"):
        EngineConfig(target=str(TINY_TARGET), drafter=str(TINY_DRAFTER), mode="auto",
                     planner={"offload_after_stepz": 3})


def test_auto_lends_the_drafter_memory_under_pressure_then_takes_it_back(prompts, ar_outputs):
    # offload_gain 0, offload_demand_ratio 0: offload on sustained pressure alone (the gain
    # estimate and the demand gate are tested on synthetic costs in test_planner.py); the rest is the real policy: plain decoding is held while the
    # load needs the grown pool, and speculation comes back once it fits the drafter-on pool.
    engine = Engine(EngineConfig(
        target=str(TINY_TARGET), drafter=str(TINY_DRAFTER), mode="auto", gamma_max=4,
        kv_cache_bytes=24 * block_bytes(),
        planner={"offload_after_steps": 3, "offload_after_s": 0.0, "offload_gain": 0.0,
                 "offload_demand_ratio": 0.0, "reload_after_s": 0.0}))
    base = engine.kv.num_blocks
    trace = []

    def record(_outs):
        st = engine.stats()
        trace.append((st.drafter_state, st.last_step.drafted if st.last_step else 0,
                      engine.kv.num_blocks, engine.kv.num_used_blocks))
    try:
        burst = engine.generate(prompts[:16], GREEDY, on_step=record)
        assert engine.stats().offloads >= 1
        offloaded = [t for t in trace if t[0] == "offloaded"]
        assert offloaded and max(t[2] for t in offloaded) > base, "the pool did not grow"
        assert max(t[3] for t in offloaded) > base, "the grown pool was not used"
        assert all(t[1] == 0 for t in offloaded), "drafted while the drafter was offloaded"
        n_burst = len(trace)
        trickle = engine.generate(prompts[16:], GREEDY, max_concurrency=1, on_step=record)
        st = engine.stats()
        assert st.reloads == st.offloads and engine.drafter.state == "on_device", \
            "the drafter did not come back at low load"
        back = [t for t in trace[n_burst:] if t[0] == "on_device"]
        assert any(t[1] > 0 for t in back), "speculation did not resume after the reload"
        assert engine.kv.num_blocks == base and engine.memory.preempted_for_reload == 0
        assert [c.output_ids for c in burst + trickle] == ar_outputs
        assert engine.kv.num_free_blocks == engine.kv.num_blocks
        assert engine.drafter.stats().num_sequences == 0
    finally:
        engine.close()


def test_the_step_after_an_offload_reports_the_memory_moved(prompts):
    """The offload (and the KV pool's growth) runs before a step; the planner is told how long it
    took, so that the step's arm is not charged it (planner/outcome.py's ``memory_s``)."""
    engine = eager_offload_engine()
    seen = []       # each step's outcome, then what the serving path's cost was told of it
    real_observe, real_serving = engine.planner.observe, engine.planner.observe_serving
    engine.planner.observe = lambda issued, o: (seen.append([o, None]), real_observe(issued, o))

    def serving(seconds, responses):
        seen[-1][1] = seconds       # the last step observed, now complete
        real_serving(seconds, responses)
    engine.planner.observe_serving = serving
    real_offload = engine.memory.offload

    def slow_offload():         # a slower host: the move's time stands out of the steps' noise
        time.sleep(0.05)
        real_offload()
    engine.memory.offload = slow_offload
    try:
        engine.generate(prompts[:16], GREEDY)
        offloads = engine.stats().offloads
        assert offloads >= 1, "the burst did not offload the drafter"
        moved = [(o, s) for o, s in seen if o.memory_s > 0]
        assert len(moved) >= offloads, "an offload's time was not reported"
        assert all(o.memory_s <= o.step_wall_s for o, _ in moved), "more was reported than the step took"
        # nor is it the serving path's cost of that step
        assert all(o.memory_s >= 0.05 and (s is None or s < 0.05) for o, s in moved)
    finally:
        engine.close()


def test_the_drafters_first_drafts_after_an_idle_engine_are_a_turn_ons_catch_up():
    """Speculation ran, the batch emptied, a new prompt came (a step that fed only prompts): the
    planner now takes plain decoding as current and prices speculating on the new prompt as a
    turn-on, so the drafter's prefill of it in the first drafting step is reported as that
    turn-on's catch-up (taken off the arm's loss, measured for the switch's price), not left in
    the gamma that happened to run it; drafting steps in a run of them report none."""
    engine = Engine(EngineConfig(target=str(TINY_TARGET), drafter=str(TINY_DRAFTER), mode="auto",
                                 gamma=2, gamma_max=2, planner={"modes": ["sd"]}, planner_cost_profile="off"))
    seen = []
    real_observe = engine.planner.observe
    engine.planner.observe = lambda issued, o: (seen.append(o), real_observe(issued, o))
    try:
        engine.add_request("first", "def add(a, b):\n", GREEDY)
        while not (seen and seen[-1].decoded and seen[-1].ran is None):    # until a step drafted
            engine.step()
        engine.step()                  # and drafted again: within a run, no catch-up
        assert seen[-1].ran is None and seen[-1].drafter_rebuild_s == 0.0
        engine.abort("first")          # the batch empties right after drafting: no plain step
        engine.step()
        assert not engine.has_unfinished()
        first_wave = len(seen)
        engine.add_request("second", "import os\n" * 8, GREEDY)
        while not (len(seen) > first_wave and seen[-1].decoded):
            engine.step()
        prompts_only, first_drafts = seen[first_wave:]
        assert not prompts_only.decoded
        assert first_drafts.ran is None, "the second request's first decoding step did not draft"
        assert 0.0 < first_drafts.drafter_rebuild_s < first_drafts.step_wall_s
    finally:
        engine.close()


def test_steady_plain_decoding_skips_the_snapshot_until_the_batch_leaves_its_bin(prompts, ar_outputs):
    """One request decoding plainly: once the planner's block grants steady steps, the engine
    runs them without a snapshot or a decision (Planner.decide_held); a second request (batch
    2, another bin) ends that at once, the next step deciding on a snapshot; the outputs are
    plain decoding's."""
    engine = Engine(EngineConfig(target=str(TINY_TARGET), drafter=str(TINY_DRAFTER), mode="auto",
                                 gamma_max=4, planner={"modes": ["ar"]}))
    planner = engine.planner
    decided = []
    real_decide = planner.decide
    planner.decide = lambda signals: (decided.append(signals), real_decide(signals))[1]
    tokens = {"a": [], "b": []}

    def step():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
    try:
        engine.add_request("a", prompts[0], GREEDY)
        while planner.held_steps < 4 or engine.adaptive._steady_left == 0:   # within a grant
            step()
        steps, held = planner.steps, planner.held_steps
        assert len(decided) == steps - held, "a held step took a snapshot and decided"
        engine.add_request("b", prompts[1], GREEDY)
        before = len(decided)
        step()
        assert len(decided) == before + 1 and decided[-1].batch_size + decided[-1].waiting == 2
        while engine.has_unfinished():
            step()
        assert [tokens["a"], tokens["b"]] == ar_outputs[:2]
        assert planner.held_steps > held, "the two requests' steady steps were not held"
    finally:
        engine.close()


def test_batch_parallel_steps_that_drafted_in_line_are_scored_to_the_psd_arm(prompts, ar_outputs):
    """Batch-parallel SD issued, a step with a sequence that had nothing drafted for it (a new
    request's first decoding step) drafts it in line and runs as sequential SD: the planner is
    told PSD ran (its arm pays those steps, as a fixed PSD run does), not the SD arm; the
    outputs are plain decoding's."""
    engine = Engine(EngineConfig(target=str(TINY_TARGET), drafter=str(TINY_DRAFTER), mode="auto",
                                 drafter_device="cpu", gamma=2, gamma_max=2, planner={"modes": ["psd"]}))
    planner = engine.adaptive.planner
    steps = []                        # (the mode the step ran, what the planner was told ran)
    real_engine_observe, real_observe = engine.adaptive.observe, planner.observe

    def engine_observe(plan, step, reload_s):
        steps.append([step.mode, step.drafted, None])
        real_engine_observe(plan, step, reload_s)

    def observe(issued, o):
        steps[-1][2] = (issued, o.ran if o.ran is not None else issued)
        real_observe(issued, o)
    engine.adaptive.observe, planner.observe = engine_observe, observe
    try:
        outputs = engine.generate(prompts, GREEDY)
        assert [c.output_ids for c in outputs] == ar_outputs
        in_line = [told for mode, drafted, told in steps
                   if mode is Mode.SD and drafted and told[0].mode is Mode.PSD]
        assert in_line, "no batch-parallel step drafted in line"
        assert all(ran == issued for issued, ran in in_line), in_line
    finally:
        engine.close()
