"""The planner's statistics tracker on its own (lossless_hc.training.plan_tracker.PlanTracker): its defaults,
the exact values of its EWMAs and the counts its stats() reports. Its schedule and its rounding up:
tests/test_planner_cost.py; under the planner: tests/test_planner_replan.py."""
from lossless_hc.training.auto import AutoSpec
from lossless_hc.training.plan_tracker import PlanTracker


def test_a_tracker_s_defaults_are_the_planner_s():
    """PlanTracker's own defaults are AutoSpec's (a decision at the first step and then every 16 steps, EWMAs of
    weight 0.25) and a dense gradient's (the statistics it hands the cost model say sparse=False)."""
    spec = AutoSpec()
    tr = PlanTracker(1000, 10, 2)
    assert (tr.interval, tr.alpha) == (spec.interval, spec.alpha) == (16, 0.25)
    assert [step for step in range(1, 49) if tr.observe((5, 7), 10)] == [1, 16, 32, 48]
    assert tr.stats().sparse is False
    sparse = PlanTracker(1000, 10, 2, sparse=True)
    sparse.observe((5, 7), 10)
    assert sparse.stats().sparse is True
