"""The step guard's early look (lossless_hc.training.guard, module doc): from the ``early``-th cycle of a
trial's first round, the end of every cycle is a look for a window whose slowest timed step is at most
``decisive`` times every other window's fastest."""
import math
import pickle

import pytest

from lossless_hc.bench.cluster_report import planner_lines
from lossless_hc.training.guard import CONTINUE_CODE, GUARD_EARLY, WINDOWS, WINDOWS_WITH_POWERSGD, StepGuard


def drive(guard, seconds, steps, windows=WINDOWS, plans=("allgather",)):
    """Drive ``guard`` as the adapters do (``next_phase``, rank 0's look shared as it is): step s-1 timed at
    the start of step s; ``seconds(phase, n)`` the time of the n-th step run in ``phase`` (0-based)."""
    phases, count = [], {}
    for step in range(steps):
        if step:
            phase = phases[-1]
            guard.record(step - 1, seconds(phase, count.get(phase, 0)))
            count[phase] = count.get(phase, 0) + 1
        phases.append(guard.next_phase(step, plans, lambda mine: mine, windows))
    return phases


def constant(**s):
    return lambda phase, n: s[phase]


def test_a_window_twice_as_fast_as_every_step_of_the_others_wins_at_the_third_cycle():
    """Plans at 0.4 s against dense's 1.0 s (single-step blocks, 5 timed steps a window): the look at the end of
    the third cycle (step 6) is the verdict, decisive (its reference kept), not the one at step 10."""
    g = StepGuard(steps=5, start=0, block=1)
    assert g.early == GUARD_EARLY == 3
    phases = drive(g, constant(plan=0.4, dense=1.0), 12)
    assert phases == ["plan", "dense"] * 3 + ["plan"] * 6
    assert g.verdict == "plan" and g.rounds == 1 and g.reference == {"dense": 1.0}
    st = g.stats()
    assert (st["span"], st["plan_ms"], st["dense_ms"], st["window"]) == (6, 400.0, 1000.0, 0)
    assert "steps 0-5" in planner_lines("ddp", "auto", {"allgather": ["t"]}, st)[1]


def test_the_slowest_step_against_the_fastest_not_the_medians():
    """One plan step at 0.6 s (more than half dense's fastest) or one dense step at 0.7 s (less than twice the
    plans' slowest) postpones the early verdict; the medians decide at the round's end as before (decisive:
    plans 0.4 against dense 1.0). A look that goes on is not asked again at the same step."""
    def one_slow_plan(phase, n):
        return 0.6 if (phase, n) == ("plan", 1) else {"plan": 0.4, "dense": 1.0}[phase]

    def one_fast_dense(phase, n):
        return 0.7 if (phase, n) == ("dense", 0) else {"plan": 0.4, "dense": 1.0}[phase]

    for seconds in (one_slow_plan, one_fast_dense):
        g = StepGuard(steps=5, start=0, block=1)
        phases = drive(g, seconds, 12)
        assert phases == ["plan", "dense"] * 5 + ["plan"] * 2, seconds.__name__
        assert g.verdict == "plan" and g.stats()["span"] == 10 and g.rounds == 1
        assert g.reference == {"dense": 1.0}
    # later looks still see that step (the slowest so far is the slowest of all): no early verdict, 8 cycles
    g = StepGuard(steps=8, start=0, block=1)
    assert drive(g, one_slow_plan, 18) == ["plan", "dense"] * 8 + ["plan"] * 2


def test_just_above_the_factor_goes_on_and_exactly_at_it_stops():
    """At the factor: the verdict at the third cycle's end; just above it, not decisive at the round's end
    either (the same medians): its confirmation round, no reference."""
    for plan_s, span, rounds in ((0.5, 6, 1), (0.501, 20, 2)):
        g = StepGuard(steps=5, start=0, block=1)
        drive(g, constant(plan=plan_s, dense=1.0), 22)
        assert (g.stats()["span"], g.rounds, g.verdict) == (span, rounds, "plan")
        assert (g.reference is None) == (rounds == 2)


def test_dense_and_powersgd_win_early_too():
    g = StepGuard(steps=5, start=0, block=1)   # plans at least twice as slow on every step: dense at step 6
    assert drive(g, constant(plan=2.5, dense=1.0), 9) == ["plan", "dense"] * 3 + ["dense"] * 3
    assert g.verdict == "dense" and g.stats()["span"] == 6 and g.reference is None
    g = StepGuard(steps=5, start=0, block=1)   # PowerSGD's slowest at most half of the plans' and dense's fastest
    phases = drive(g, constant(plan=1.0, dense=1.1, powersgd=0.4), 12, WINDOWS_WITH_POWERSGD)
    assert phases == ["plan", "dense", "powersgd"] * 3 + ["powersgd"] * 3
    assert g.verdict == "powersgd" and g.stats()["span"] == 9
    g = StepGuard(steps=5, start=0, block=1)   # the plans twice as fast as dense but not as PowerSGD: the round
    drive(g, constant(plan=0.4, dense=1.0, powersgd=0.7), 40, WINDOWS_WITH_POWERSGD)
    assert g.verdict == "plan" and g.stats()["span"] == 30 and g.rounds == 2


def test_blocks_count_cycles_of_blocks_and_time_their_last_steps():
    """Blocks of 2 (the default): a cycle is 4 steps; the third ends at step 12 with 3 timed steps a window. The
    untimed first step of a block (a switch's cost) is not in the slowest or fastest."""
    g = StepGuard(steps=5, start=2)

    def seconds(phase, n):   # every block's first step costs 5 s (its switch)
        return 5.0 if n % 2 == 0 else {"plan": 0.4, "dense": 1.0}[phase]

    phases = drive(g, seconds, 16)
    assert phases == ["plan"] * 2 + ["plan", "plan", "dense", "dense"] * 3 + ["plan"] * 2
    assert g.verdict == "plan" and g.stats()["span"] == 12 and len(g.times["plan"]) == len(g.times["dense"]) == 3


def test_no_early_look_where_it_could_not_come_before_the_round_ends():
    """``early`` at least ``steps``, ``decisive`` 0 (never decisive), a margin above 1 - d (the rule says
    dense though the plans lead by a factor 2), a recheck, a confirmation round: the look at the round's end
    only."""
    for guard in (StepGuard(steps=3, start=0, block=1), StepGuard(steps=5, start=0, block=1, early=5),
                  StepGuard(steps=5, start=0, block=1, decisive=0)):
        drive(guard, constant(plan=0.4, dense=1.0), 30)
        assert guard.verdict == "plan" and guard.stats()["span"] == 2 * guard.steps * guard.rounds
    g = StepGuard(steps=5, start=0, block=1, margin=0.7)
    assert drive(g, constant(plan=0.4, dense=1.0), 12) == ["plan", "dense"] * 5 + ["dense"] * 2
    assert g.verdict == "dense" and g.stats()["span"] == 10
    with pytest.raises(ValueError, match="early"):
        StepGuard(early=0)


def test_a_recheck_and_a_new_trial_after_a_look_that_went_on():
    """A first trial (4 timed steps a window) whose early look at step 6 went on, one plan step being slow, and
    whose round's end (step 8) was decisive: the reference is kept, and a re-plan's recheck (steps 9-12) runs
    one window, no early look in it. After the recheck fails, the whole trial opening at step 13 has early
    looks of its own, counted from its own first step: its verdict at its step 6 (19), the look the first
    trial had taken and gone on from."""
    g = StepGuard(steps=4, start=0, block=1)
    phases = []
    for step in range(24):
        plans = ("A",) if step <= 8 else ("B",)
        if step:
            last = phases[-1]
            if last == "dense":
                seconds = 1.0
            elif step - 1 <= 8:
                seconds = 0.6 if step - 1 == 2 else 0.4   # A: its second plan step slow
            else:
                seconds = 0.6 if step - 1 <= 12 else 0.3  # B: 0.6 in the recheck, 0.3 in the whole trial
            g.record(step - 1, seconds)
        phases.append(g.next_phase(step, plans, lambda mine: mine))
        if step == 8:
            assert g.verdict == "plan" and g.stats()["span"] == 8 and g.reference == {"dense": 1.0}
        if step == 12:
            assert g.windows == ("plan",) and g.trials == 2
    assert phases[:13] == ["plan", "dense"] * 4 + ["plan"] * 5
    assert phases[13:19] == ["plan", "dense"] * 3 and phases[19:] == ["plan"] * 5
    assert g.trials == 3 and g.stats()["window"] == 13 and g.stats()["span"] == 6 and g.verdict == "plan"


def test_every_rank_adopts_rank_0_s_early_look():
    """At an early look every rank broadcasts its look and adopts rank 0's: a rank whose own steps are clear
    goes on where rank 0 says so, and stops where rank 0 does."""
    asked = []

    def goes_on(mine):
        asked.append(mine[0])
        return (CONTINUE_CODE,) + tuple(mine[1:])

    g = StepGuard(steps=5, start=0, block=1)
    phases = []
    for step in range(10):
        if step:
            g.record(step - 1, {"plan": 0.4, "dense": 1.0}[phases[-1]])
        phases.append(g.next_phase(step, ("allgather",), goes_on))
    assert phases == ["plan", "dense"] * 5 and asked == [1.0, 1.0] and g.verdict is None
    g = StepGuard(steps=5, start=0, block=1)
    phases = []
    for step in range(8):
        if step:
            g.record(step - 1, {"plan": 0.9, "dense": 1.0}[phases[-1]])   # this rank: not clear
        phases.append(g.next_phase(step, ("allgather",), lambda mine: (1.0, 0.4, 1.0)))
    assert phases == ["plan", "dense"] * 3 + ["plan"] * 2 and g.verdict == "plan"


def test_the_continue_code_only_at_an_early_look():
    g = StepGuard(steps=5, start=0, block=1)
    assert g.phase(0, True) == "plan"
    with pytest.raises(ValueError, match="verdict"):
        g.settle(CONTINUE_CODE, 1.0, 1.0)
    g = StepGuard(steps=1, start=0, block=1)   # the round's end is a final look
    drive(g, constant(plan=0.9, dense=1.0), 2)
    assert g.phase(2, True) == "decide"
    with pytest.raises(ValueError, match="verdict"):
        g.settle(CONTINUE_CODE, 1.0, 1.0)


def test_a_guard_pickled_before_the_early_look_restores_and_looks():
    g = StepGuard(steps=5, start=0, block=1)
    drive(g, constant(plan=0.4, dense=1.0), 3)
    state = g.__dict__.copy()
    for key in ("early", "looking", "looked"):
        del state[key]
    old = StepGuard.__new__(StepGuard)
    old.__setstate__(state)
    restored = pickle.loads(pickle.dumps(old))
    seconds = {"plan": 0.4, "dense": 1.0}
    phases = ["dense"]   # step 2's phase as driven above: plan, dense, plan
    for step in range(3, 8):
        restored.record(step - 1, seconds[phases[-1]] if step > 3 else 0.4)
        phases.append(restored.next_phase(step, ("allgather",), lambda mine: mine))
    assert phases[1:] == ["dense", "plan", "dense", "plan", "plan"] and restored.verdict == "plan"
    assert restored.stats()["span"] == 6


def test_decisive_0_takes_no_early_look():
    """``decisive`` 0 (never decisive): no early look is even asked for (the class doc: "0: never, nor early
    looks"), so no broadcast before the round's end, however the steps compare (steps of 0 s among them,
    which a look would find at most 0 times every other window's fastest)."""
    looks = []

    def share(mine):
        looks.append(mine[0])
        return mine

    g = StepGuard(steps=5, start=0, block=1, decisive=0)
    phases = []
    for step in range(12):
        if step:
            g.record(step - 1, {"plan": 0.0, "dense": 1.0}[phases[-1]])
        phases.append(g.next_phase(step, ("allgather",), share))
    assert phases == ["plan", "dense"] * 5 + ["plan"] * 2 and looks == [1.0]
    assert g.verdict == "plan" and g.stats()["span"] == 10


def test_an_early_look_with_a_window_left_untimed_goes_on():
    """A window with no timed step at an early look (its steps not recorded: a clock reset, as in a restored
    state) is no window won beyond the spread: the look goes on (no verdict, no error), and the round's end
    keeps the plans, nothing measured against them (StepGuard.decide; no confirmation round here)."""
    g = StepGuard(steps=5, start=0, block=1, confirm=0)
    phases = []
    for step in range(12):
        if step and phases[-1] == "plan":   # the dense steps go untimed
            g.record(step - 1, 0.4)
        phases.append(g.next_phase(step, ("allgather",), lambda mine: mine))
        if step == 6:
            assert g.looked == 6 and g.verdict is None
    assert phases == ["plan", "dense"] * 5 + ["plan"] * 2
    assert g.verdict == "plan" and g.stats()["span"] == 10 and math.isnan(g.stats()["dense_ms"])


def test_the_span_while_a_trial_runs_on_after_a_look_is_the_whole_round():
    """stats()["span"] is the steps the trial runs while it runs (the whole round after an early look that went
    on), the steps it ran only once its verdict stands."""
    g = StepGuard(steps=5, start=0, block=1)

    def one_slow_plan(phase, n):
        return 0.6 if (phase, n) == ("plan", 1) else {"plan": 0.4, "dense": 1.0}[phase]

    drive(g, one_slow_plan, 8)   # the look at step 6 went on
    assert g.looked == 6 and g.verdict is None and g.stats()["span"] == 10
