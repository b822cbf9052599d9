"""The step guard's three-window rule at its boundary and the medians it reports (lossless_hc.training.guard):
PowerSGD's window against dense at exactly the margin, and the untimed first steps of the blocks (``lead_*``),
the record of what switching windows cost, per window and per trial."""
import math

from lossless_hc.training.guard import WINDOWS, WINDOWS_WITH_POWERSGD, StepGuard


def drive(guard, seconds, steps, windows=WINDOWS_WITH_POWERSGD, plans=lambda step: ("allgather",)):
    """Drive ``guard`` as the adapters do (``next_phase``, rank 0's look shared as it is): step s-1 timed at the
    start of step s with ``seconds(phase, first)`` (``first``: the first step of its block), not at all where
    that is None. Returns every step's phase."""
    phases = []
    for step in range(steps):
        if step:
            first = (step - 1 - guard.begin) % guard.block == 0
            t = seconds(phases[-1], first)
            if t is not None:
                guard.record(step - 1, t)
        phases.append(guard.next_phase(step, plans(step), lambda mine: mine, windows))
    return phases


def test_powersgd_exactly_at_the_margin_under_dense_is_the_alternative():
    """The rule (module doc): PowerSGD is the alternative iff ``T_s <= (1 - m) T_d``, the tie included, and the
    plans stay iff ``T_p <= (1 - m) T_a``. With m = 0.5 (exact in floats) and dense at 1 s: PowerSGD at 0.5 s
    is the verdict over plans at 1 s; plans at exactly 0.25 s are kept against it."""
    for plan_s, verdict in ((1.0, "powersgd"), (0.25, "plan")):
        g = StepGuard(steps=1, start=0, block=1, margin=0.5, confirm=0, decisive=0)
        seconds = {"plan": plan_s, "dense": 1.0, "powersgd": 0.5}
        drive(g, lambda phase, first: seconds[phase], 5)
        assert g.verdict == verdict, (plan_s, g.stats())
        assert (g.stats()["powersgd_ms"], g.stats()["dense_ms"]) == (500.0, 1000.0)


def test_the_lead_medians_are_reported_per_window_powersgd_s_too():
    """Blocks of 2: each window's untimed first steps (2, 3 and 4 s) are reported as its own ``lead_*_ms``,
    PowerSGD's beside the plans' and dense's, at a look with every window timed and at one whose plan window
    went untimed (which keeps the plans, with no medians)."""
    lead = {"plan": 2.0, "dense": 3.0, "powersgd": 4.0}
    timed = {"plan": 0.9, "dense": 1.0, "powersgd": 1.0}
    for untimed_plans in (False, True):
        g = StepGuard(steps=2, start=0, confirm=0)

        def seconds(phase, first):
            if first:
                return lead[phase]
            return None if untimed_plans and phase == "plan" else timed[phase]

        drive(g, seconds, 13)
        st = g.stats()
        assert g.verdict == "plan" and st["span"] == 12, st
        assert (st["lead_plan_ms"], st["lead_dense_ms"], st["lead_powersgd_ms"]) == (2000.0, 3000.0, 4000.0), st
        assert math.isnan(st["plan_ms"]) == untimed_plans


def test_a_new_trial_reports_its_own_lead_medians():
    """A re-plan after a verdict for the plans (not decisive: no recheck) opens a new trial, here with PowerSGD's
    window too: its look reports the untimed steps of its own blocks, not those of the trial before."""
    g = StepGuard(steps=1, start=0, confirm=0)
    leads = ({"plan": 5.0, "dense": 5.0}, {"plan": 2.0, "dense": 3.0, "powersgd": 4.0})
    timed = {"plan": 0.9, "dense": 1.0, "powersgd": 1.0}

    def seconds(phase, first):
        return leads[g.trials - 1][phase] if first else timed[phase]

    windows = [WINDOWS] * 5 + [WINDOWS_WITH_POWERSGD] * 8
    phases = []
    for step in range(13):   # the first trial: steps 0-3, its verdict at 4; the second opens at 5 (plans "B")
        if step:
            first = (step - 1 - g.begin) % g.block == 0
            g.record(step - 1, seconds(phases[-1], first))
        phases.append(g.next_phase(step, ("A",) if step < 5 else ("B",), lambda mine: mine, windows[step]))
        if step == 4:
            assert g.verdict == "plan" and g.reference is None and g.stats()["lead_plan_ms"] == 5000.0
    assert phases == ["plan"] * 2 + ["dense"] * 2 + ["plan"] * 3 + ["dense"] * 2 + ["powersgd"] * 2 + ["plan"] * 2
    st = g.stats()
    assert g.verdict == "plan" and st["trials"] == 2 and st["window"] == 5
    assert (st["lead_plan_ms"], st["lead_dense_ms"], st["lead_powersgd_ms"]) == (2000.0, 3000.0, 4000.0), st
