"""The step guard's third window (lossless_hc.training.guard): torch's PowerSGD hook on every bucket it may take,
where DDP has PowerSGD among its strategies -- its schedule, the three-window verdict, the windows a trial keeps,
and settling and restoring a guard with two or three windows. The two-window schedule: tests/test_guard.py."""
import math
import pickle

import pytest

from lossless_hc.training.guard import WINDOWS_WITH_POWERSGD
from lossless_hc.training.guard import StepGuard as _StepGuard
from test_guard import StepGuard, run


def drive3(guard, seconds, steps, windows=WINDOWS_WITH_POWERSGD):
    """test_guard.drive through :meth:`StepGuard.next_phase` (as the DDP hook calls it), with the trial's
    ``windows`` and every step of phase p taking ``seconds[p]``; the verdict shared as rank 0's own."""
    phases = []
    for step in range(steps):
        if step:
            guard.record(step - 1, seconds[phases[step - 1]])
        phases.append(guard.next_phase(step, ("topk_allgather",), lambda mine: mine, windows))
    return phases


def test_the_powersgd_window_cycles_with_the_plans_and_dense_and_wins_where_both_are_slower():
    g = StepGuard(steps=2, start=1)
    phases = drive3(g, {"plan": 1.0, "dense": 1.2, "powersgd": 0.9}, 20)
    # a first look at step 7 favours PowerSGD, not decisively: a confirmation round (steps 7-12), then PowerSGD
    # for good from step 13
    assert phases == ["plan"] + ["plan", "dense", "powersgd"] * 4 + ["powersgd"] * 7
    assert g.verdict == "powersgd" and g.stats()["rounds"] == 2 and g.stats()["windows"] == list(WINDOWS_WITH_POWERSGD)
    st = g.stats()
    assert (st["plan_ms"], st["dense_ms"], st["powersgd_ms"]) == (1000.0, 1200.0, 900.0)


@pytest.mark.parametrize("plan_s, powersgd_s, verdict", [
    (0.90, 0.95, "plan"),      # the plans beat both by the margin
    (0.94, 0.95, "powersgd"),  # PowerSGD beats dense; the plans not PowerSGD by the margin
    (0.96, 0.98, "plan"),      # PowerSGD within the margin of dense: the plans against dense (0.96 <= 0.97)
    (0.98, 0.98, "dense"),     # neither beats dense by the margin
    (0.98, 0.45, "powersgd"),  # decisive: at most half of each other window's median, no confirmation
])
def test_the_three_window_verdict(plan_s, powersgd_s, verdict):
    g = StepGuard(steps=1, start=0)
    drive3(g, {"plan": plan_s, "dense": 1.0, "powersgd": powersgd_s}, 20)
    assert g.verdict == verdict
    assert g.stats()["rounds"] == (1 if verdict == "dense" or powersgd_s < 0.5 else 2)


def test_a_powersgd_verdict_stands_whatever_the_plans_become():
    g = StepGuard(steps=1, start=0, confirm=0)
    drive3(g, {"plan": 1.0, "dense": 1.0, "powersgd": 0.5}, 4)
    assert g.verdict == "powersgd"
    asked = []
    assert g.begin_step(4, 10.0, lambda: asked.append(1), lambda mine: mine) == "powersgd"
    assert g.phase(5, True, ("dense", "allgather")) == "powersgd" and not asked   # plans not read, no new trial
    assert g.stats()["trials"] == 1


def test_the_windows_are_fixed_when_a_trial_opens():
    g = StepGuard(steps=2, start=0, confirm=0)
    answers = [WINDOWS_WITH_POWERSGD] * 3 + [("plan", "dense")] * 3   # a later answer: the open trial keeps its
    phases = [g.begin_step(s, float(s), lambda: ("topk",), lambda mine: mine, lambda s=s: answers[s])
              for s in range(6)]
    assert phases == ["plan", "dense", "powersgd"] * 2 and g.windows == WINDOWS_WITH_POWERSGD
    with pytest.raises(ValueError, match="windows"):
        StepGuard(start=0).phase(0, True, None, ("plan", "powersgd"))


def test_a_new_trial_after_a_verdict_for_the_plans_asks_for_its_windows_again():
    """A re-plan after a verdict for the plans opens a trial with the windows asked at that step: here
    without PowerSGD's (every bucket it may take now runs it whole under the plans)."""
    g = StepGuard(steps=1, start=0, confirm=0)
    plans, windows = [("topk",)], [WINDOWS_WITH_POWERSGD]
    phases, clock = [], 0.0
    for s in range(8):
        if s == 4:   # the verdict (the plans: 0.6 s against 1 s, not decisive) came at step 3; a re-plan at 4
            plans[0], windows[0] = ("topk_allgather",), ("plan", "dense")
        if phases:
            clock += 0.6 if phases[-1] == "plan" else 1.0
        phases.append(g.begin_step(s, clock, lambda: plans[0], lambda mine: mine, lambda: windows[0]))
    assert phases == ["plan", "dense", "powersgd", "plan", "plan", "dense", "plan", "plan"], phases
    assert g.trials == 2 and g.windows == ("plan", "dense") and g.verdict == "plan"


def test_settle_takes_a_verdict_by_name_code_or_bool_and_refuses_others():
    for verdict, name in ((2.0, "powersgd"), ("dense", "dense"), (True, "plan"), (False, "dense")):
        g = StepGuard(steps=1, start=0, confirm=0)
        g.phase(0, True)
        g.settle(verdict, 1.0, 1.0)
        assert g.verdict == name
    with pytest.raises(ValueError, match="verdict"):
        StepGuard().settle(3.0, 1.0, 1.0)


def test_a_guard_pickled_with_two_window_medians_restores():
    g = StepGuard(steps=1, start=0, confirm=0)
    run(g, plan_s=0.5, dense_s=1.0, steps=4)
    state = g.__dict__.copy()
    state["medians"], state["lead_medians"] = (0.5, 1.0), (0.6, 1.1)   # as a guard pickled before
    del state["windows"], state["reference"]   # nor a reference: a re-plan opens a whole trial
    old = _StepGuard.__new__(_StepGuard)
    old.__setstate__(state)
    restored = pickle.loads(pickle.dumps(old))
    st = restored.stats()
    assert (st["plan_ms"], st["dense_ms"], st["lead_dense_ms"]) == (500.0, 1000.0, 1100.0)
    assert math.isnan(st["powersgd_ms"]) and st["windows"] == ["plan", "dense"]
    assert restored.phase(4, True, "other plans") == "plan" and restored.phase(5, True, "other plans") == "dense"
