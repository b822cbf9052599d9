"""The re-planning interval of an ``auto`` tensor that no calibration could move off dense
(:meth:`lossless_hc.training.plan_tracker.PlanTracker.reschedule`): its statistics steps come at doubling
intervals up to ``max_interval``, back to ``interval`` on any other plan, never for a tensor that may go
lossy; the results exact on every step, the schedule checked, carried over a checkpoint. The schedule at a
fixed interval: tests/test_planner.py and tests/test_planner_uncalibrated.py."""
import pytest
import torch

from lossless_hc.training.auto import AutoSpec
from lossless_hc.training.checkpoint import aggregator_state_dict, load_aggregator_state_dict
from lossless_hc.training.plan_tracker import PlanTracker, check_max_interval, restored_interval, widened_interval
from lossless_hc.training.planner import Calibration, CostModel, dense_dominates
from lossless_hc.training.step import run_in_process
from lossless_hc.training.strategies import AutoAggregator

MODEL = CostModel(Calibration.default(bandwidth_bits=1e9))
N = 2


def pair(model=MODEL, **options):
    options = {"interval": 4, "max_interval": 32, **options}
    return [AutoAggregator("w", (64, 16), torch.float32, N, r, model, **options) for r in range(N)]


def dense(g):
    return [torch.randn(64, 16, generator=g) for _ in range(N)]


def sparse(g, rows=4):
    """``rows`` of 64 rows non-zero per rank, different rows on each."""
    xs = []
    for r in range(N):
        x = torch.zeros(64, 16)
        x[rows * r:rows * r + rows] = torch.randn(rows, 16, generator=g)
        xs.append(x)
    return xs


def run(aggs, inputs):
    """One step, its sum checked exact; whether the step carried the statistics (every rank alike)."""
    observed = {a.plain_step() is None for a in aggs}
    assert len(observed) == 1
    for y in run_in_process(aggs, inputs)[0]:
        y = y.to_dense() if y.is_sparse else y
        assert torch.equal(y, inputs[0] + inputs[1])
    return observed.pop()


def statistics_steps(aggs, inputs, steps):
    """The step counts (1-based) among the next ``steps`` whose step carried the statistics."""
    first = aggs[0].steps + 1
    return [c for c in range(first, first + steps) if run(aggs, inputs())]


def test_a_dominated_dense_tensor_is_observed_at_doubling_intervals_up_to_max_interval():
    g = torch.Generator().manual_seed(0)
    aggs = pair()
    seen = statistics_steps(aggs, lambda: dense(g), 200)
    # the first step, then each scheduled plan (from count 4, the interval) doubles it: 8, 16, 32, then every 32
    assert seen == [1, 4, 8, 16, 32, 64, 96, 128, 160, 192]
    for a in aggs:
        assert a.strategy == "dense" and dense_dominates(a.plan_input, a.allowed)
        assert a.plan_stats()["interval"] == 32 and a.plans == len(seen)
        assert a.plain_steps == 200 - len(seen)


def test_a_plan_not_dominated_returns_to_the_interval_and_re_plans_every_interval():
    g = torch.Generator().manual_seed(1)
    aggs = pair(CostModel(Calibration.default(bandwidth_bits=1e6)))   # a slow link: a sparse plan pays
    statistics_steps(aggs, lambda: dense(g), 64)
    assert aggs[0].tracker.current_interval == 32
    # sparse from count 65: the next statistics step (96) sees it, and from there every step of the new plan
    # carries the statistics, re-planned every 4 steps (not 32)
    assert statistics_steps(aggs, lambda: sparse(g), 32) == [96]
    assert aggs[0].strategy != "dense" and aggs[0].tracker.current_interval == 4
    plans = aggs[0].plans
    statistics_steps(aggs, lambda: sparse(g), 16)
    assert aggs[0].plans == plans + 4


def test_a_dense_plan_on_statistics_that_do_not_dominate_keeps_the_interval():
    """Half the rows non-zero on each rank, the same half: dense stays cheapest on this link, but an allgather of
    the rows moves less than 0.8 of dense's bytes, so a calibration could move it: no widening."""
    g = torch.Generator().manual_seed(2)

    def half():
        xs = []
        for _ in range(N):
            x = torch.zeros(64, 16)
            x[:32] = torch.randn(32, 16, generator=g)
            xs.append(x)
        return xs
    aggs = pair(allowed=("dense", "two_phase"))
    seen = statistics_steps(aggs, half, 64)
    assert seen == [1, 4, 8, 12, 16, 20, 24, 28, 32, 36, 40, 44, 48, 52, 56, 60, 64]
    assert aggs[0].strategy == "dense" and not dense_dominates(aggs[0].plan_input, aggs[0].allowed)
    assert aggs[0].tracker.current_interval == 4


def test_a_tensor_that_may_go_lossy_keeps_the_interval_on_a_dense_plan():
    """A lossy tensor planned dense (a link fast enough that nothing beats it): THC or top-k could take it on
    another calibration, so its statistics stay every interval."""
    model = CostModel(Calibration.default(bandwidth_bits=1e13))
    g = torch.Generator().manual_seed(3)
    aggs = [AutoAggregator("w", (64, 16), torch.float32, N, r, model, lossy=True, lossy_min_bytes=0, interval=4,
                           max_interval=32) for r in range(N)]
    seen = statistics_steps(aggs, lambda: dense(g), 40)
    assert aggs[0].strategy == "dense" and aggs[0].tracker.current_interval == 4
    assert seen == [1] + list(range(4, 41, 4))
    # the same tensor exact widens: the statistics dominate dense among the exact strategies
    assert dense_dominates(aggs[0].plan_input)


def test_max_interval_equal_to_the_interval_never_widens():
    g = torch.Generator().manual_seed(4)
    aggs = pair(max_interval=4)
    assert statistics_steps(aggs, lambda: dense(g), 24) == [1, 4, 8, 12, 16, 20, 24]


def test_the_tracker_widens_only_on_a_scheduled_observation():
    t = PlanTracker(640, 10, 2, interval=4, max_interval=16)
    assert t.observe([64, 64], 64, step=1)
    t.reschedule(True)   # the first step: not scheduled
    assert t.current_interval == 4
    assert t.observe([64, 64], 64, step=4)
    t.reschedule(True, forced=True)   # a failure's: not scheduled either
    assert t.current_interval == 4
    t.reschedule(True)
    assert t.current_interval == 8
    assert not t.observe([64, 64], 64, step=12) and t.observe([64, 64], 64, step=16)
    t.reschedule(True)
    assert t.current_interval == 16
    assert t.observe([64, 64], 64, step=32)
    t.reschedule(True)
    assert t.current_interval == 16   # max_interval
    t.reschedule(False)
    assert t.current_interval == 4


@pytest.mark.parametrize("bad", [48, 8, 64.0, True, "32", 0, -16, 40, 20])
def test_max_interval_must_be_the_interval_times_a_power_of_two(bad):
    for make in (lambda: check_max_interval(bad, 16), lambda: AutoSpec(max_interval=bad),
                 lambda: PlanTracker(640, 10, 2, interval=16, max_interval=bad),
                 lambda: AutoAggregator("w", (64,), torch.float32, 2, 0, MODEL, max_interval=bad)):
        with pytest.raises(ValueError, match="max_interval must be interval"):
            make()
    assert [check_max_interval(m, 16) for m in (None, 16, 32, 256, 1024)] == [256, 16, 32, 256, 1024]
    assert check_max_interval(None, 3) == 48 and check_max_interval(12, 3) == 12


def test_a_bool_is_no_interval_even_of_an_interval_of_one():
    """``True == 1`` is ``1 x`` an interval of 1: refused as a ``max_interval`` (as it is for any other interval)
    and not restored as a saved current interval, where 1 and 2 are."""
    with pytest.raises(ValueError, match="max_interval must be interval"):
        check_max_interval(True, 1)
    assert check_max_interval(2, 1) == 2
    assert [restored_interval(s, 1, 16) for s in (True, 1, 2)] == [1, 1, 2]
    assert type(restored_interval(True, 1, 16)) is int


def test_widened_interval_doubles_only_a_scheduled_look_from_the_interval_on():
    """widened_interval's contract (its callers pass only scheduled looks, so they alone cannot tell): a look at
    a step count that is a multiple of ``current``, of ``interval`` or more, doubles it up to ``max_interval``;
    any other look, a multiple of ``interval`` but not of ``current`` included, keeps ``current`` (not
    ``interval``). PlanTracker.reschedule after an observation off its schedule keeps it so too."""
    assert [widened_interval(4, 4, 32, s) for s in (0, 1, 4, 8)] == [4, 4, 8, 8]
    assert [widened_interval(8, 4, 32, s) for s in (0, 4, 12, 16, 32)] == [8, 8, 8, 16, 16]
    assert widened_interval(32, 4, 32, 64) == 32
    t = PlanTracker(640, 10, 2, interval=4, max_interval=32)
    t.observe([64, 64], 64, step=4)
    t.reschedule(True)
    assert t.current_interval == 8
    assert not t.observe([64, 64], 64, step=12)   # not due: off the schedule of 8
    t.reschedule(True)
    assert t.current_interval == 8


def test_the_widened_interval_survives_a_checkpoint():
    g = torch.Generator().manual_seed(5)
    steps = [dense(g) for _ in range(120)]
    straight = pair()
    for xs in steps[:40]:
        run(straight, xs)
    assert straight[0].tracker.current_interval == 32
    saved = [aggregator_state_dict(a) for a in straight]
    resumed = pair()
    for a, state in zip(resumed, saved):
        load_aggregator_state_dict(a, state)
    for xs in steps[40:]:
        assert run(straight, xs) == run(resumed, xs)
    assert [a.tracker.current_interval for a in resumed] == [a.tracker.current_interval for a in straight] == [32, 32]
    # a state saved before the interval widened: never widened, so the interval
    old = dict(saved[0], tracker={k: v for k, v in saved[0]["tracker"].items() if k != "current_interval"})
    fresh = pair()[0]
    load_aggregator_state_dict(fresh, old)
    assert fresh.tracker.current_interval == 4


def test_a_forced_plan_on_a_scheduled_step_does_not_widen():
    """A plan a failure forced (``tracker.force``, set here as a failed decode sets it) that falls on a scheduled
    step (8, the interval being 8) and keeps the tensor dense, dominated, keeps the interval: only an unforced
    scheduled plan doubles it (the aggregator passes ``forced`` on to PlanTracker.reschedule)."""
    g = torch.Generator().manual_seed(7)
    aggs = pair()
    assert statistics_steps(aggs, lambda: dense(g), 7) == [1, 4]
    assert [a.tracker.current_interval for a in aggs] == [8, 8]
    for a in aggs:
        a.tracker.force = True
    assert statistics_steps(aggs, lambda: dense(g), 1) == [8]
    for a in aggs:
        assert a.strategy == "dense" and dense_dominates(a.plan_input, a.allowed) and not a.tracker.force
        assert a.tracker.current_interval == 8 and a.plan_stats()["interval"] == 8
    # the next scheduled plan, unforced, doubles it
    assert statistics_steps(aggs, lambda: dense(g), 8) == [16]
    assert [a.tracker.current_interval for a in aggs] == [16, 16]


def test_a_re_plan_off_dense_returns_to_the_interval():
    """A re-plan on the same statistics (``replan``: the bucket's batching changed) that leaves dense, here under
    a calibration whose allgather bytes cost a hundredth of the allreduce's: re-planned every interval again."""
    from lossless_hc.training.planner import LinkModel
    g = torch.Generator().manual_seed(6)
    aggs = pair()
    statistics_steps(aggs, lambda: dense(g), 64)
    assert aggs[0].tracker.current_interval == 32
    cheap = Calibration(LinkModel(1e-5, 8e-9, 8e-11), MODEL.calibration.codec_seconds)
    for a in aggs:
        a.cost_model = CostModel(cheap)
        a.replan()
        assert a.strategy != "dense" and a.tracker.current_interval == 4


@pytest.mark.parametrize("saved, restored", [(32, 32), (16, 16), (64, 4), (24, 4), (2, 4), (None, 4), (10, 4)])
def test_a_saved_interval_this_schedule_cannot_have_restarts_from_the_interval(saved, restored):
    """Restored into an aggregator of interval 4 and max_interval 32: a saved 64 (a larger max_interval), 24, 2
    or 10 (another interval; 10 // 4 is a power of two, but 10 is no multiple of 4) is not one of its schedule's,
    so it starts again from 4."""
    agg = pair()[0]
    state = aggregator_state_dict(agg)
    state["tracker"]["current_interval"] = saved
    load_aggregator_state_dict(agg, state)
    assert agg.tracker.current_interval == restored
