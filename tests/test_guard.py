"""The step guard's schedule and verdict (lossless_hc.training.guard); its DDP run is in
tests/test_planner_mp.py (guard_dense, guard_plan)."""
import math

import pytest

from lossless_hc.training.guard import RECHECK, VERDICT_CODES, WINDOWS, WINDOWS_WITH_POWERSGD, step_guard
from lossless_hc.training.guard import StepGuard as _StepGuard


def StepGuard(block=1, **options):
    """The schedule tests below alternate single steps (``block=1``); blocks have tests of their own."""
    return _StepGuard(block=block, **options)


def plan_dense(guard):
    """The medians (seconds) of the plan and dense windows at the guard's last look."""
    return guard.medians["plan"], guard.medians["dense"]


def drive(guard, cost, steps, worth_from=0):
    """Drive the guard as auto_hook does for ``steps`` steps: time step s-1 at the start of step s
    (``cost(phases, s - 1)``: its seconds, given the phases so far), then ask its phase. Returns the phase
    of every step."""
    phases = []
    for step in range(steps):
        if step:
            guard.record(step - 1, cost(phases, step - 1))
        phase = guard.phase(step, step >= worth_from)
        if phase == "decide":
            guard.settle(*guard.decide())
            phase = guard.phase(step, step >= worth_from)
        phases.append(phase)
    return phases


def run(guard, plan_s, dense_s, steps=30, worth_from=0):
    """:func:`drive` with every plan step taking ``plan_s`` and every dense step ``dense_s``."""
    return drive(guard, lambda phases, step: plan_s if phases[step] == "plan" else dense_s, steps, worth_from)


def test_schedule_plan_and_dense_steps_alternate_then_verdict():
    g = StepGuard(steps=3, start=4)
    phases = run(g, plan_s=2.0, dense_s=1.0, steps=16, worth_from=6)
    # nothing to check before step 6 (all plans dense); the trial opens there
    assert phases[:6] == ["plan"] * 6
    assert phases[6:12] == ["plan", "dense"] * 3
    assert phases[12:] == ["dense"] * 4   # plans measured slower: dense from the verdict on
    st = g.stats()
    assert {k: st[k] for k in ("verdict", "plan_ms", "dense_ms", "window", "steps", "rounds", "trials", "block")} == {
        "verdict": "dense", "plan_ms": 2000.0, "dense_ms": 1000.0, "window": 6, "steps": 3, "rounds": 1, "trials": 1,
        "block": 1}


def test_faster_plans_are_kept_after_a_confirmation_round():
    g = StepGuard(steps=2, start=0)
    phases = run(g, plan_s=0.6, dense_s=1.0, steps=12)
    # the first look (step 4) favours the plans: two more of each, then the verdict (step 8)
    assert phases == ["plan", "dense"] * 4 + ["plan"] * 4
    assert g.verdict == "plan" and plan_dense(g) == (0.6, 1.0) and g.stats()["rounds"] == 2
    g = StepGuard(steps=2, start=0, confirm=0)   # no confirmation: the first look is the verdict
    assert run(g, plan_s=0.6, dense_s=1.0, steps=10) == ["plan", "dense"] * 2 + ["plan"] * 6


def test_a_decisive_first_look_is_the_verdict_for_the_plans_at_once():
    """Plans at most ``decisive`` (0.5) times the dense window's median need no confirmation round: the
    verdict at the first look (step 4), so the trial's dense blocks end after one round; just above it,
    or with decisive 0, the confirmation runs; a look for dense is unaffected."""
    g = StepGuard(steps=2, start=0)
    assert g.decisive == 0.5
    assert run(g, plan_s=0.5, dense_s=1.0, steps=10) == ["plan", "dense"] * 2 + ["plan"] * 6
    assert g.verdict == "plan" and g.stats()["rounds"] == 1 and plan_dense(g) == (0.5, 1.0)
    for guard in (StepGuard(steps=2, start=0), StepGuard(steps=2, start=0, decisive=0)):
        plan_s = 0.51 if guard.decisive else 0.01
        assert run(guard, plan_s=plan_s, dense_s=1.0, steps=12) == ["plan", "dense"] * 4 + ["plan"] * 4
        assert guard.stats()["rounds"] == 2
    g = StepGuard(steps=2, start=0, decisive=1e6, margin=0.9)   # decisive, but the margin rules first
    assert run(g, plan_s=0.5, dense_s=1.0, steps=10) == ["plan", "dense"] * 2 + ["dense"] * 6


def test_decisive_is_read_when_the_guard_is_built(monkeypatch):
    import lossless_hc.training.guard as guard_module
    monkeypatch.setattr(guard_module, "GUARD_DECISIVE", 0.0)
    g = StepGuard(steps=1, start=0)
    assert g.decisive == 0.0 and step_guard(1, 0).decisive == 0.0
    for bad in (-0.1, float("nan"), float("inf"), "0.5", True):
        with pytest.raises(ValueError, match="decisive"):
            StepGuard(decisive=bad)


def test_a_first_look_for_the_plans_that_the_confirmation_round_overturns_goes_dense():
    """Plans that looked faster on the first 3 steps of each window (noise) and measure slower on the
    next 3: the verdict, on the medians of all 6 per window, is dense."""
    g = StepGuard(steps=3, start=0)
    plan_times = iter([0.80, 0.82, 0.84, 1.30, 1.25, 1.20])
    phases = []
    for step in range(16):
        if step:
            g.record(step - 1, next(plan_times) if phases[-1] == "plan" else 1.0)
        phase = g.phase(step, True)
        if phase == "decide":
            g.settle(*g.decide())
            phase = g.phase(step, True)
        phases.append(phase)
    assert phases[:12] == ["plan", "dense"] * 6 and phases[12:] == ["dense"] * 4
    assert g.verdict == "dense" and plan_dense(g) == (pytest.approx(1.02), 1.0)


def test_the_confirmation_pools_both_rounds():
    """A first look for the plans and a second round slightly slower: pooled, the plans still win."""
    g = StepGuard(steps=2, start=0, margin=0.0)
    g.phase(0, True)
    for s, t in enumerate([0.5, 1.0, 0.6, 1.0]):
        g.record(s, t)
    g.settle(*g.decide())
    assert g.verdict is None and g.phase(4, True) == "plan"   # the confirmation round
    for s, t in zip(range(4, 8), [0.9, 1.0, 0.95, 1.0]):
        g.record(s, t)
    assert g.phase(8, True) == "decide" and g.decide()[:3] == (True, 0.75, 1.0)


def test_a_replan_after_a_verdict_for_the_plans_opens_a_new_trial():
    # The trial measured plans A (faster than dense) and kept them; a re-plan at step 12 moves to plans B,
    # which measure slower: a second trial runs B against dense and goes back to dense.
    g = StepGuard(steps=2, start=0)
    phases = []
    for step in range(20):
        plans = "A" if step < 12 else "B"
        if step:
            slow = 1.5 if plans == "B" else 0.6
            g.record(step - 1, slow if phases[-1] == "plan" else 1.0)
        phase = g.phase(step, True, plans)
        if phase == "decide":
            g.settle(*g.decide())
            phase = g.phase(step, True, plans)
        phases.append(phase)
    assert phases[:12] == ["plan", "dense"] * 4 + ["plan"] * 4   # A kept (after its confirmation round)
    assert phases[12:16] == ["plan", "dense", "plan", "dense"]                 # B on trial
    assert phases[16:] == ["dense"] * 4
    assert g.stats()["trials"] == 2 and g.stats()["window"] == 12 and plan_dense(g) == (1.5, 1.0)


def test_the_same_plans_and_a_dense_verdict_open_no_new_trial():
    g = StepGuard(steps=2, start=0)
    phases = [g.phase(0, True, "A")]
    for step in range(1, 12):
        g.record(step - 1, 0.5 if phases[-1] == "plan" else 1.0)
        phase = g.phase(step, True, "A")
        if phase == "decide":
            g.settle(*g.decide())
            phase = g.phase(step, True, "A")
        phases.append(phase)
    assert g.verdict == "plan" and g.stats()["trials"] == 1
    g.settle(False, 2.0, 1.0)   # a dense verdict: the aggregators sit out, their plans stand still
    assert g.phase(12, True, "B") == "dense" and g.stats()["trials"] == 1


@pytest.mark.parametrize("plan_s, margin, keep", [
    (0.97, 0.03, True),     # exactly (1 - m) T_d: kept
    (0.971, 0.03, False),   # a tie within the margin goes to dense
    (1.0, 0.0, True),
    (1.4, -0.5, True),      # a negative margin tolerates plans up to 1 / (1 - m) = 1.5x slower
    (1.6, -0.5, False),
])
def test_verdict_rule(plan_s, margin, keep):
    g = StepGuard(steps=1, start=0, margin=margin)
    g.phase(0, True)
    g.record(0, plan_s)
    g.record(1, 1.0)
    assert g.decide()[:3] == (keep, plan_s, 1.0)


def test_medians_resist_an_outlier_step():
    g = StepGuard(steps=5, start=0)
    g.phase(0, True)
    for s, t in enumerate([0.5, 1.0, 9.0, 1.0, 0.5, 0.1, 0.5, 1.0, 0.5, 1.0]):   # plan, dense, plan, ...
        g.record(s, t)
    assert g.decide()[:3] == (True, 0.5, 1.0)


def test_a_drift_over_the_trial_weighs_on_both_windows():
    """Steps slowing down by 10% per step over the trial, the plans 5% faster than dense: back-to-back
    windows (plans first) would see the plans ~1.4x faster; alternating, within 10% of the truth."""
    g = StepGuard(steps=5, start=0, margin=0.0)
    g.phase(0, True)
    for s in range(10):
        g.record(s, (0.95 if s % 2 == 0 else 1.0) * 1.1 ** s)
    keep, tp, td = g.decide()[:3]
    assert 0.85 < tp / td < 1.0


def test_times_outside_the_windows_are_ignored():
    g = StepGuard(steps=2, start=3)
    g.record(0, 5.0)                 # before the trial opened
    assert g.phase(3, True) == "plan"
    for s in (1, 2, 7, 8):
        g.record(s, 5.0)             # before the plan window, after the dense window
    assert g.times == {"plan": [], "dense": []}
    assert g.decide()[0] == VERDICT_CODES["plan"] and math.isnan(g.decide()[1])   # nothing measured: plans kept


def test_bad_options():
    with pytest.raises(ValueError, match="steps"):
        StepGuard(steps=0)
    with pytest.raises(ValueError, match="start"):
        StepGuard(start=-1)
    with pytest.raises(ValueError, match="margin"):
        StepGuard(margin=1.0)
    with pytest.raises(ValueError, match="block"):
        StepGuard(block=0)
    for margin in (float("nan"), -math.inf, True, "0.1"):
        with pytest.raises(ValueError, match="margin"):
            StepGuard(margin=margin)
    # Not truncated: 2.5 steps ran a trial of 2 on one rank's say-so.
    for bad in (dict(steps=2.5), dict(start=1.5), dict(block=True), dict(confirm=0.5)):
        with pytest.raises(TypeError, match="guard"):
            StepGuard(**bad)


def test_step_guard_from_the_adapters_options():
    """step_guard, the one check of every adapter's guard_steps: 0 is off, an int >= 1 a guard."""
    assert step_guard(0) is None
    g = step_guard(3, 4, 0.1)
    assert (g.steps, g.start, g.margin) == (3, 4, 0.1)
    with pytest.raises(ValueError, match="guard_steps must be an integer >= 0"):
        step_guard(-1)
    for bad in (2.5, True, "5", None):
        with pytest.raises(TypeError, match="guard_steps"):
            step_guard(bad)
    # the other options are checked with the guard off too (they were ignored, whatever they were)
    with pytest.raises(ValueError, match="guard start"):
        step_guard(0, -5)
    with pytest.raises(ValueError, match="margin"):
        step_guard(0, 8, "x")


def test_the_default_guard_opens_at_step_8_and_times_5_steps_a_window_with_a_3_percent_margin():
    """The documented defaults (docs/DESIGN.md: ``guard_steps=5, guard_start=8, guard_margin=0.03``; the
    module doc: blocks of 2, one confirmation round), built directly and as the adapters build them: plans
    exactly ``1 - 0.03`` times dense open the trial at step 8, run 5 blocks of each window, look at step 28,
    survive the confirmation round and are kept at step 48; a hair slower, dense from step 28."""
    for build in (_StepGuard, lambda: step_guard(5)):
        g = build()
        phases = run(g, plan_s=0.97, dense_s=1.0, steps=50)
        assert phases[:8] == ["plan"] * 8
        assert phases[8:48] == ["plan", "plan", "dense", "dense"] * 10 and phases[48:] == ["plan"] * 2
        assert g.verdict == "plan" and g.stats()["window"] == 8 and g.stats()["rounds"] == 2
        g = build()
        phases = run(g, plan_s=0.971, dense_s=1.0, steps=30)
        assert phases[8:28] == ["plan", "plan", "dense", "dense"] * 5 and phases[28:] == ["dense"] * 2
        assert g.verdict == "dense" and plan_dense(g) == (0.971, 1.0)


def test_one_guard_step_is_a_trial_of_one_timed_block_per_window():
    """``step_guard(1)``: W = 1, the guard on with its shortest trial: one block of each window (2 steps at
    the default block), the look at the step after."""
    g = step_guard(1, 0)
    assert run(g, plan_s=2.0, dense_s=1.0, steps=6) == ["plan", "plan", "dense", "dense", "dense", "dense"]
    assert g.verdict == "dense" and g.stats()["steps"] == 1 and plan_dense(g) == (2.0, 1.0)


def test_untracked_plans_open_no_new_trial_after_a_verdict_for_the_plans():
    """``plans`` None is "not tracked" (:meth:`StepGuard.phase`): after a verdict for the plans measured as
    ``"A"``, steps that name no plans keep them without a new trial; a different value opens one."""
    g = StepGuard(steps=1, start=0, confirm=0)
    assert g.phase(0, True, "A") == "plan"
    g.record(0, 0.6)   # not decisive: a re-plan opens a whole trial (a decisive look's re-plan: a recheck, below)
    assert g.phase(1, True, "A") == "dense"
    g.record(1, 1.0)
    assert g.phase(2, True, "A") == "decide"
    g.settle(*g.decide())
    assert [g.phase(s, True, None) for s in (2, 3, 4)] == ["plan"] * 3
    assert g.verdict == "plan" and g.stats()["trials"] == 1 and g.stats()["window"] == 0
    assert [g.phase(s, True, "B") for s in (5, 6)] == ["plan", "dense"]
    assert g.stats()["trials"] == 2 and g.stats()["window"] == 5


def test_a_plan_window_left_untimed_keeps_the_plans():
    """A window with no time recorded keeps the plans (:meth:`StepGuard.decide`), the plan window too: a
    clock reset (a restored state) during the plan window's one step leaves it untimed while the dense
    window's step is timed; the look keeps the plans, with no medians."""
    def plans():
        return ("allgather",)

    def share(mine):
        return mine
    g = StepGuard(steps=1, start=0, confirm=0)
    assert g.begin_step(0, 10.0, plans, share) == "plan"
    g.clock = None                                           # as DDP's restored state does
    assert g.begin_step(1, 50.0, plans, share) == "dense"   # step 0 untimed
    assert g.begin_step(2, 51.0, plans, share) == "plan"    # step 1 (dense) took 1 s, nothing against it
    st = g.stats()
    assert g.verdict == "plan" and math.isnan(st["plan_ms"]) and math.isnan(st["dense_ms"])


def test_a_decisive_look_is_a_fraction_of_the_dense_median_whatever_its_scale():
    """``T_p <= d T_d`` in seconds (module doc), not only at ``T_d`` = 1 s: plans of 1 s against dense steps
    of 2 s are exactly ``d`` = 0.5 of them, the verdict at the first look; 1.01 s needs the confirmation."""
    g = StepGuard(steps=2, start=0)
    assert run(g, plan_s=1.0, dense_s=2.0, steps=10) == ["plan", "dense"] * 2 + ["plan"] * 6
    assert g.verdict == "plan" and g.stats()["rounds"] == 1 and plan_dense(g) == (1.0, 2.0)
    g = StepGuard(steps=2, start=0)
    assert run(g, plan_s=1.01, dense_s=2.0, steps=12) == ["plan", "dense"] * 4 + ["plan"] * 4
    assert g.verdict == "plan" and g.stats()["rounds"] == 2


def test_stats_report_the_medians_in_milliseconds():
    """:meth:`StepGuard.stats`: rank 0's medians at the last look, timed and untimed steps, in milliseconds
    (exact here: 0.25 s and 2 s)."""
    g = _StepGuard(steps=1, start=0, confirm=0)   # blocks of 2: each window's first step untimed
    assert run(g, plan_s=0.25, dense_s=2.0, steps=5) == ["plan", "plan", "dense", "dense", "plan"]
    st = g.stats()
    assert (st["plan_ms"], st["dense_ms"], st["lead_plan_ms"], st["lead_dense_ms"]) == (250.0, 2000.0, 250.0, 2000.0)


def test_plans_all_dense_are_not_worth_a_trial():
    """:meth:`StepGuard.next_phase`: steps whose dense gradients' plans are all ``"dense"`` open no trial,
    however many; the first step with another plan opens it."""
    def share(mine):
        raise AssertionError("no look without a trial")
    g = StepGuard(steps=1, start=0)
    assert [g.next_phase(s, ("dense", "dense"), share) for s in range(4)] == ["plan"] * 4
    assert g.stats()["trials"] == 0 and g.stats()["window"] is None
    assert [g.next_phase(s, ("dense", "allgather"), share) for s in (4, 5)] == ["plan", "dense"]
    assert g.stats()["trials"] == 1 and g.stats()["window"] == 4


def transition_costs(phases, step):
    """Step ``step``'s time: plans 1.1 s, dense 1.0 s in steady state, and a step that follows the other
    window's step pays a switch (an engine renegotiating its tensors, allocator and caches changing
    hands): +0.4 s into the dense window, +0.05 s into the plans'."""
    phase = phases[step]
    t = 1.1 if phase == "plan" else 1.0
    if step and phases[step - 1] != phase:
        t += 0.4 if phase == "dense" else 0.05
    return t


def test_blocks_time_only_their_last_step_so_switching_costs_stay_out_of_the_verdict():
    """Blocks of two steps per window (the default): plan, plan, dense, dense, ...; only each block's
    second step is timed, so what a switch of window costs (on the step after it) weighs on neither
    median. Alternating single steps, every step pays a switch, and plans 10% slower in steady state
    measure faster than dense when the switch to dense costs more than the switch back."""
    g = _StepGuard(steps=2, start=0, confirm=0)
    assert g.block == 2 and g.span() == 8
    phases = drive(g, transition_costs, 11)
    assert phases == ["plan", "plan", "dense", "dense"] * 2 + ["dense"] * 3
    assert g.verdict == "dense" and plan_dense(g) == (1.1, 1.0)
    st = g.stats()   # the untimed steps: 1.1 (step 0, nothing before it) and 1.15; 1.4 twice
    assert st["lead_plan_ms"] == pytest.approx(1125.0) and st["lead_dense_ms"] == pytest.approx(1400.0)
    single = _StepGuard(steps=2, start=0, confirm=0, block=1)
    drive(single, transition_costs, 11)
    assert single.verdict == "plan" and plan_dense(single) == (pytest.approx(1.125), pytest.approx(1.4))


def test_blocks_with_a_confirmation_round_pool_every_timed_step():
    g = _StepGuard(steps=2, start=3, block=3)
    phases = run(g, plan_s=0.6, dense_s=1.0, steps=3 + 24 + 3)
    window = ["plan"] * 3 + ["dense"] * 3
    assert phases[:3] == ["plan"] * 3 and phases[3:27] == window * 4 and phases[27:] == ["plan"] * 3
    assert g.stats()["rounds"] == 2 and len(g.times["plan"]) == len(g.times["dense"]) == 4
    assert len(g.lead["plan"]) == len(g.lead["dense"]) == 8


def test_next_phase_adopts_the_shared_verdict_not_its_own():
    """At the decision step every rank adopts what ``share`` returns (rank 0's), whatever its own windows
    say; before and after it, the schedule of :meth:`StepGuard.phase`."""
    g = StepGuard(steps=1, start=0, confirm=0)
    asked = []

    def share(mine):
        asked.append(mine)
        return (0.0, 2.0, 1.0)   # rank 0 measured the plans 2x slower

    assert g.next_phase(0, ("allgather",), share) == "plan"
    g.record(0, 0.5)
    assert g.next_phase(1, ("allgather",), share) == "dense"
    g.record(1, 1.0)
    assert g.next_phase(2, ("allgather",), share) == "dense" and g.verdict == "dense"
    assert [a[:3] for a in asked] == [(True, 0.5, 1.0)] and plan_dense(g) == (2.0, 1.0)   # this rank's look, rank 0's verdict
    assert StepGuard(steps=1, start=0).next_phase(0, ("dense",), share) == "plan"   # nothing to check


def test_begin_step_times_the_step_before_from_its_own_clock():
    """The engines' one entry: each step's start times the step before it; a reset clock (a restored
    state) times nothing; after a dense verdict the plans are not read."""
    reads = []

    def plans():
        reads.append(1)
        return ("allgather",)

    def share(mine):
        return mine
    g = StepGuard(steps=1, start=0, confirm=0)
    assert g.begin_step(0, 10.0, plans, share) == "plan"
    assert g.begin_step(1, 10.5, plans, share) == "dense"   # step 0 (plans) took 0.5 s
    g.clock = None                                           # as DDP's restored state does
    assert g.begin_step(2, 99.0, plans, share) == "plan"    # step 1 untimed: nothing against the plans, kept
    assert g.times == {"plan": [0.5], "dense": []} and g.verdict == "plan"
    g = StepGuard(steps=1, start=0, confirm=0, margin=0.99)
    assert [g.begin_step(s, float(s), plans, share) for s in range(3)] == ["plan", "dense", "dense"]
    assert g.verdict == "dense" and g.times == {"plan": [1.0], "dense": [1.0]}
    n = len(reads)
    assert g.begin_step(3, 3.0, plans, share) == "dense" and len(reads) == n   # a dense verdict: plans unread


def test_the_dense_window_sends_what_the_engine_s_own_hook_sends():
    """Each tensor's plain step in the dense window (AutoAggregator.guard_alternative): exact plans weigh
    against the float32 allreduce; with lossy, a float32 gradient against the half-precision one the engine
    ships, bf16 first (DDP's bf16_compress_hook), fp16 where only it is allowed (Horovod's Compression.fp16),
    small ones too (those hooks cast a whole bucket; lossy_min_bytes keeps them out of the lossy plans only);
    sparse, float64 and half-precision gradients stay as they are. Its plain step sends that dtype (2 bytes
    a coordinate), and a strategy with no plain step is refused."""
    import torch

    from lossless_hc.training.auto import guard_stats
    from lossless_hc.training.planner import Calibration, CostModel
    from lossless_hc.training.strategies import AutoAggregator

    model = CostModel(Calibration.default(1e9))

    def agg(numel=1 << 15, dtype=torch.float32, **kw):
        return AutoAggregator("w", (numel,), dtype, 2, 0, model, **kw)

    assert agg().guard_alternative() == "dense"                       # exact
    assert agg(lossy=True).guard_alternative() == "bf16"
    assert agg(lossy=True, allowed=("topk", "fp16")).guard_alternative() == "fp16"
    assert agg(lossy=True, allowed=("topk",)).guard_alternative() == "dense"
    small = agg(1 << 10, lossy=True)   # 4 KiB < lossy_min_bytes: no lossy plan, the hook's cast all the same
    assert small.guard_alternative() == "bf16" and small.allowed == ("dense", "allgather", "two_phase", "sketch")
    assert agg(lossy=True, dtype=torch.float64).guard_alternative() == "dense"
    assert agg(lossy=True, dtype=torch.float16).guard_alternative() == "dense"
    assert agg(lossy=True, sparse=True).guard_alternative() == "dense"
    # one rank, or no coordinate: nothing crosses the wire, so nothing is worth rounding
    assert AutoAggregator("w", (1 << 15,), torch.float32, 1, 0, model, lossy=True).guard_alternative() == "dense"
    assert agg(0, lossy=True).guard_alternative() == "dense"
    a = agg(lossy=True)
    x = torch.randn(1 << 15)
    payload, ctx = a.encode_plain(x, a.guard_alternative())
    assert payload.dtype == torch.bfloat16 and torch.equal(payload, x.to(torch.bfloat16)) and ctx.plain
    assert torch.equal(a.decode(payload.float() * 2, ctx).value, (x.to(torch.bfloat16).float() * 2))
    with pytest.raises(ValueError, match="plain step"):
        a.encode_plain(x, "topk")
    stats = guard_stats(step_guard(5), [a, agg(), agg(lossy=True, sparse=True)])
    assert stats["alternative"] == {"bf16": 1, "dense": 1} and stats["verdict"] is None
    assert guard_stats(None, [a]) is None


def test_the_dense_window_s_half_allreduce_casts_as_the_engine_s_hooks(gloo_world_of_one):
    """allreduce_half on a 1-rank Gloo group, told n = 4 ranks: the buffer comes back as DDP's hooks send it,
    averaged or (FSDP2's replica all-reduce, which divides later) summed: bf16 rounded to bfloat16, then
    divided in float32 (bf16_compress_hook); fp16 x / n rounded to float16 (fp16_compress_hook), a SUM
    multiplied back by n in float32."""
    import torch

    from lossless_hc.plugins._ddp_bucket import allreduce_half

    x = torch.randn(100, generator=torch.Generator().manual_seed(3)) * 1000
    for half, average in (("bf16", True), ("bf16", False), ("fp16", True), ("fp16", False)):
        buffer = x.clone()
        assert allreduce_half(buffer, 4, None, half, average).wait() is buffer
        if half == "bf16":
            want = x.to(torch.bfloat16).float() / (4 if average else 1)
        else:
            want = (x.to(torch.float16) / 4).float() * (1 if average else 4)
        assert torch.equal(buffer, want), (half, average)


def test_guard_half_is_the_one_half_strategy_of_a_float32_bucket():
    """The half precision the step guard's dense window sends a bucket in: the one half strategy its tensors
    go to (dense ones go with it), none where every tensor stays dense, two of them disagree, or the bucket
    is not float32."""
    from types import SimpleNamespace

    import torch

    from lossless_hc.training.auto import guard_half

    def bucket(*kinds):
        return [SimpleNamespace(guard_alternative=lambda k=k: k) for k in kinds]
    assert guard_half(bucket("dense", "bf16", "bf16"), torch.float32) == "bf16"
    assert guard_half(bucket("dense", "dense"), torch.float32) is None
    assert guard_half(bucket("fp16", "bf16"), torch.float32) is None
    assert guard_half(bucket("bf16"), torch.float16) is None


def test_the_horovod_guard_compares_plans_in_name_order():
    """AutoCompressorAdapter's step guard compares the dense tensors' plans in name order: ranks whose engine
    met the parameters in other orders (Horovod calls the compressor as gradients become ready) hold the same
    tuple."""
    import torch

    from lossless_hc.training.auto import AutoCompressorAdapter, AutoSpec
    from lossless_hc.training.planner import Calibration
    spec = AutoSpec(lossy=True, calibration=Calibration.default(), first="fp16", lossy_min_bytes=0)

    def plans(order):
        adapter = AutoCompressorAdapter(spec)
        for name, first in order:
            agg = adapter.aggregator(name, name, torch.zeros(4096), 2, 0)
            agg.strategy = first
        return adapter._dense_plans()
    order = [("a", "fp16"), ("b", "dense"), ("c", "bf16")]
    assert plans(order) == plans(order[::-1]) == ("fp16", "dense", "bf16")


# -- a re-plan after a decisive look for the plans: the new plans rechecked alone -------------------------------

def drive_replan(guard, seconds, steps, replan_at, windows=WINDOWS_WITH_POWERSGD):
    """Drive the guard through :meth:`StepGuard.next_phase` (as the DDP hook calls it; drive3 in
    tests/test_guard_powersgd_window.py) with the plans "A" before step ``replan_at`` and "B" from it;
    ``seconds[(plans, phase)]`` (or ``seconds[phase]``) is a step's time, the verdict shared as rank 0's own."""
    phases = []
    for step in range(steps):
        plans = ("A",) if step < replan_at else ("B",)
        if step:
            was = ("A",) if step - 1 < replan_at else ("B",)
            guard.record(step - 1, seconds.get((was, phases[-1]), seconds.get(phases[-1])))
        phases.append(guard.next_phase(step, plans, lambda mine: mine, windows))
    return phases


def test_a_replan_after_a_decisive_look_rechecks_the_new_plans_alone():
    """Plans A at 0.4 s against dense's 1.0 s and PowerSGD's 0.9 s: a decisive look, the verdict at once, its
    other windows' medians kept as the reference. A re-plan to B at step 10 runs B alone for one window's
    steps (no dense or PowerSGD blocks); B at 0.42 s is still at most half of each reference median: kept."""
    g = StepGuard(steps=2, start=1)
    phases = drive_replan(g, {"dense": 1.0, "powersgd": 0.9, (("A",), "plan"): 0.4, (("B",), "plan"): 0.42},
                          16, replan_at=10)
    assert phases == ["plan"] + ["plan", "dense", "powersgd"] * 2 + ["plan"] * 9, phases
    assert g.verdict == "plan" and g.windows == RECHECK and g.trials == 2 and g.stats()["window"] == 10
    assert g.reference == {"dense": 1.0, "powersgd": 0.9}
    st = g.stats()
    assert (st["plan_ms"], st["dense_ms"], st["powersgd_ms"]) == (420.0, 1000.0, 900.0)
    # a later re-plan is rechecked against the same reference
    g2 = StepGuard(steps=2, start=1)
    drive_replan(g2, {"dense": 1.0, "powersgd": 0.9, (("A",), "plan"): 0.4, (("B",), "plan"): 0.42}, 14, 10)
    assert g2.next_phase(14, ("C",), lambda mine: mine, WINDOWS_WITH_POWERSGD) == "plan" and g2.windows == RECHECK


def test_a_recheck_that_does_not_hold_opens_a_whole_trial():
    """B at 0.6 s is more than half the reference's PowerSGD median (0.9 s): the recheck does not hold, and a
    whole trial opens at once (its windows asked then), whose rule decides: B against dense's 1.0 s and
    PowerSGD's 0.9 s, kept after its confirmation round; not decisive, so no reference is left."""
    g = StepGuard(steps=1, start=0)
    seconds = {"dense": 1.0, "powersgd": 0.9, (("A",), "plan"): 0.4, (("B",), "plan"): 0.6}
    phases = drive_replan(g, seconds, 16, replan_at=3)
    assert phases[:3] == ["plan", "dense", "powersgd"]               # A: decisive at the first look
    assert phases[3] == "plan"                                       # B's recheck: one window of one step
    assert phases[4:10] == ["plan", "dense", "powersgd"] * 2         # the whole trial, with its confirmation
    assert phases[10:] == ["plan"] * 6
    assert g.trials == 3 and g.verdict == "plan" and g.windows == WINDOWS_WITH_POWERSGD and g.reference is None
    # its re-plan opens a whole trial again
    assert g.next_phase(16, ("C",), lambda mine: mine, WINDOWS) == "plan" and g.windows == WINDOWS
    assert g.next_phase(17, ("C",), lambda mine: mine, WINDOWS) == "dense"


def test_a_recheck_against_a_two_window_reference_and_one_left_untimed():
    """Horovod's and FSDP2's trials have no PowerSGD window: the reference is dense's median alone. A recheck
    whose plan step was never timed (a restored state's clock) does not hold: a whole trial."""
    g = StepGuard(steps=1, start=0)
    phases = drive_replan(g, {"dense": 1.0, (("A",), "plan"): 0.3, (("B",), "plan"): 0.5}, 6, 2, windows=WINDOWS)
    assert phases == ["plan", "dense", "plan", "plan", "plan", "plan"]
    assert g.reference == {"dense": 1.0} and g.windows == RECHECK and g.verdict == "plan"
    g = StepGuard(steps=1, start=0)
    drive_replan(g, {"dense": 1.0, (("A",), "plan"): 0.3}, 3, 9, windows=WINDOWS)   # A kept at step 2
    assert g.verdict == "plan" and g.reference == {"dense": 1.0}
    assert g.next_phase(3, ("B",), lambda mine: mine, WINDOWS) == "plan" and g.windows == RECHECK
    verdict = g.decide()   # step 3 never recorded
    assert verdict[0] == -1.0
    g.settle(*verdict)
    assert g.verdict is None and g.reference is None
    assert g.next_phase(4, ("B",), lambda mine: mine, WINDOWS) == "plan" and g.windows == WINDOWS


def test_only_a_recheck_takes_the_retrial_code():
    g = StepGuard(steps=1, start=0)
    g.phase(0, True)
    with pytest.raises(ValueError, match="verdict"):
        g.settle(-1.0, 1.0, 1.0)
