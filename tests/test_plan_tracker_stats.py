"""The planner's statistics tracker on its own (lossless_hc.training.plan_tracker.PlanTracker): its defaults,
the exact values of its EWMAs and the counts its stats() reports. Its schedule and its rounding up:
tests/test_planner_cost.py; under the planner: tests/test_planner_replan.py."""
import pytest

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


def test_each_observation_moves_the_ewmas_by_alpha():
    """The first observation sets the EWMAs; each next one (one step on) moves them by ``alpha`` exactly:
    (1 - a) * mean + a * count, for every rank's count and for the union."""
    tr = PlanTracker(1000, 1, 2, alpha=0.25)
    tr.observe((5, 7), 12)
    assert tr.rank_keys == [5.0, 7.0] and tr.union == 12.0
    tr.observe((6, 7), 13)
    assert tr.rank_keys == [5.25, 7.0] and tr.union == 12.25


def test_an_observation_at_or_behind_the_last_step_weighs_as_one_step():
    """``step`` at or behind the last observation's (a caller mixing its own step counts with the default
    one) weighs as one step, ``alpha``: never 0 (an ignored observation) nor a negative weight."""
    tr = PlanTracker(1000, 1, 2, alpha=0.25)
    tr.observe((4, 4), 4, step=3)
    tr.observe((8, 8), 8, step=3)
    assert tr.rank_keys == [5.0, 5.0] and tr.union == 5.0
    tr.observe((9, 9), 9, step=2)
    assert tr.rank_keys == [6.0, 6.0] and tr.union == 6.0


def test_the_counts_are_whole_rows_of_a_row_that_does_not_divide_the_tensor():
    """10 coordinates in rows of 3 are 4 rows (the last one short): a rank holding every row reports 4, an int,
    and so does the union."""
    tr = PlanTracker(10, 3, 2)
    tr.observe((4, 4), 4)
    s = tr.stats()
    assert (s.keys, s.rank_keys, s.union_keys) == (4, (4, 4), 4)
    assert all(type(k) is int for k in s.rank_keys + (s.union_keys,))


@pytest.mark.parametrize("rank_keys, union_keys, match", [
    ((5,), 5, "1 entries for world_size 2"),             # zip would drop rank 1's average
    ((5, 7, 9), 9, "3 entries for world_size 2"),
    ((5, -1), 5, "finite and >= 0"),
    ((5, float("nan")), 5, "finite and >= 0"),            # would stay in the EWMAs for good
    ((5, 7), float("inf"), "finite and >= 0"),
    ((5, 7), -3, "finite and >= 0"),
])
def test_an_observation_of_the_wrong_shape_or_a_bad_count_is_refused_and_changes_nothing(rank_keys, union_keys,
                                                                                         match):
    """Every observation carries one finite count >= 0 per rank and the union's: refused at observe(), first or
    later, with the tracker left as it was. The next good observation moves the EWMAs as if the refused one had
    not come: at step 3 after step 1 it weighs as two steps, 1 - 0.75^2 = 0.4375."""
    tr = PlanTracker(1000, 1, 2, alpha=0.25)
    with pytest.raises(ValueError, match=match):
        tr.observe(rank_keys, union_keys, step=1)
    assert (tr.rank_keys, tr.steps, tr.last_step) == (None, 0, 0)
    tr.observe((4, 8), 8, step=1)
    with pytest.raises(ValueError, match=match):
        tr.observe(rank_keys, union_keys, step=2)
    tr.observe((8, 8), 12, step=3)
    assert tr.rank_keys == [5.75, 8.0] and tr.union == 9.75 and tr.steps == 2


def test_a_skipped_step_records_nothing_says_whether_a_decision_is_due_and_the_next_observation_stands_for_it():
    """PlanTracker.skip (a step whose gradient carried error memory sent late): the EWMAs, the peak and the
    observation count stay; it is due where observe() would have been (the first step, every ``interval``,
    after a failure); the next observation weighs as the two steps it stands for, 1 - (1 - a)^2."""
    tr = PlanTracker(1000, 1, 2, interval=4, alpha=0.25)
    tr.observe((8, 8), 8, step=1)
    assert [tr.skip(step) for step in (2, 3, 4, 5)] == [False, False, True, False]
    assert (tr.rank_keys, tr.union, tr.peak_rank, tr.steps) == ([8.0, 8.0], 8.0, 8, 1)
    tr.force = True
    assert tr.skip(6) and tr.rank_keys == [8.0, 8.0]
    tr.observe((16, 16), 16, step=3)   # two steps after the last observation
    assert tr.rank_keys == [8.0 + 8.0 * 0.4375] * 2 and tr.union == 8.0 + 8.0 * 0.4375
