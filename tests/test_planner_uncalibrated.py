"""Plans without a calibration: :func:`~lossless_hc.training.planner.dense_dominates` (a dense gradient whose
every exact alternative moves nearly dense's bytes or more), checked against the cost model's own choice
over many calibrations, and the ``auto`` aggregator that keeps such a tensor dense with no cost model and
asks for one (``needs_cost_model``) once its statistics no longer allow that. The DDP adapter's use of it
(calibrating only then): tests/test_planner_mp.py, ``dense_steady`` and ``deferred``."""
import random

import pytest
import torch

from lossless_hc.training.auto import AutoSpec
from lossless_hc.training.planner import (DEFAULT_CODEC_SECONDS, EXACT_STRATEGIES, SWITCH_MARGIN, Calibration,
                                          CostModel, LinkModel, dense_dominates)
from lossless_hc.training.plan_stats import TensorStats, bitmap_words
from lossless_hc.training.strategies import AutoAggregator
from test_planner import run_step

LOSSY_PARAMETERS = dict(topk_ratio=0.01, thc_bits=4)   # what an aggregator built without a cost model is given


def stats(keys, row, n, k, union, sparse=False, element_bytes=4):
    return TensorStats(keys * row, row, n, (k,) * n, union, element_bytes, sparse)


# -- dense_dominates ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("n", [2, 3, 4, 8, 64])
@pytest.mark.parametrize("row", [1, 3, 256])
def test_a_gradient_non_zero_in_every_row_is_dominated_by_dense(n, row):
    # the allgather of every row moves n/2 (1 + 1/b) times dense's bytes, two_phase and the sketch at least its
    assert dense_dominates(stats(1000, row, n, 1000, 1000))
    assert dense_dominates(stats(1000, row, n, 1000, 1000, element_bytes=2))   # a half-precision gradient


def test_sparse_gradients_and_lossy_candidates_are_never_dominated():
    assert not dense_dominates(stats(1000, 16, 4, 1000, 1000, sparse=True))
    assert not dense_dominates(stats(1000, 16, 4, 1000, 1000), allowed=EXACT_STRATEGIES + ("bf16",))
    assert dense_dominates(stats(1000, 16, 4, 1000, 1000), allowed=("dense",))
    assert dense_dominates(stats(1000, 16, 4, 10, 40), allowed=("dense",))   # nothing else to choose


def test_the_margin_is_the_planner_s_switch_margin():
    """At 2 ranks the allgather of K of D rows of b moves K (4 + 4b) bytes against dense's 4 D b (+ headers):
    dominated down to K ~ (1 - SWITCH_MARGIN) D, not below."""
    D, b, n = 10_000, 256, 2
    line = (1 - SWITCH_MARGIN) * D * b / (b + 1)
    assert dense_dominates(stats(D, b, n, int(line) + 2, D))
    assert not dense_dominates(stats(D, b, n, int(line) - 2, D))
    assert not dense_dominates(stats(D, b, 4, D // 100, D // 25))   # an embedding table's few rows


def test_the_bytes_compared_are_what_a_ring_moves_per_rank():
    """dense_dominates prices the strategies on a link of one second per byte, no latency and no local work:
    its predictions are the ring's bytes per rank, 2(n-1)/n B per allreduce and (n-1) B per allgather; the
    sketch's at its sketch_floor, which decides where only the sized layout would reach dense's bytes."""
    from lossless_hc.training.planner import _ring_bytes_model
    unit, s = _ring_bytes_model(), stats(1000, 4, 4, 100, 300)
    H = 4 * (1 + 2 * 4)   # the statistics header of 4 ranks
    for strategy, expected in (("dense", 1.5 * (H + 4 * 4000)), ("allgather", 1.5 * H + 3 * 100 * (4 + 4 * 4)),
                               ("two_phase", 1.5 * (H + 4 * bitmap_words(1000, 4)) + 1.5 * 4 * 300 * 4)):
        assert unit.predict(strategy, s) == pytest.approx(expected), strategy
    assert unit.predict("dense", stats(1000, 4, 1, 100, 100)) == 0
    # the sketch at its floor (sketch_floor, no layout sized): 64 ranks' 70 rows of 4096, 2252 in the union,
    # whose sized payload moves dense's bytes or more but whose union capacity alone does not, is not dominated
    s = stats(4096, 1, 64, 70, 2252)
    dense = unit.predict("dense", s)
    assert unit.sketch_floor(s) < (1 - SWITCH_MARGIN) * dense <= unit.predict("sketch", s)
    assert min(unit.predict(t, s) for t in ("allgather", "two_phase")) >= (1 - SWITCH_MARGIN) * dense
    assert not dense_dominates(s)


def test_no_calibration_moves_a_dominated_tensor_off_dense():
    """The promise dense_dominates makes, against CostModel.choose itself: over random statistics and random
    calibrations (latency, one per-byte cost for every collective, local costs per coordinate at least
    dense's), a dominated tensor planned on dense stays dense; and domination is no rare case here, nor
    universal (a test that cannot fail would prove nothing)."""
    rng = random.Random(11)
    dominated = kept_off = 0
    for _ in range(600):
        n, row = rng.choice([2, 3, 4, 8, 16]), rng.choice([1, 4, 64, 256])
        keys = rng.choice([64, 1000, 50_000])
        k = max(1, round(keys * rng.choice([0.01, 0.3, 0.7, 0.85, 0.95, 1.0])))
        union = min(keys, max(k, round(k * rng.uniform(1, n))))
        s = stats(keys, row, n, k, union)
        beta = 10 ** rng.uniform(-11, -7)
        dense_local = rng.uniform(0, 5e-9)
        codec = {name: (max(dense_local, c * 10 ** rng.uniform(-1, 1)), p * 10 ** rng.uniform(-1, 1))
                 for name, (c, p) in DEFAULT_CODEC_SECONDS.items()}
        codec["dense"] = (dense_local, 0.0)
        model = CostModel(Calibration(LinkModel(10 ** rng.uniform(-7, -3), beta), codec))
        best, predicted = model.choose(s, current="dense")
        if dense_dominates(s):
            dominated += 1
            assert best == "dense", (s, predicted)
        elif best != "dense":
            kept_off += 1
    assert 100 < dominated < 500 and kept_off > 50, (dominated, kept_off)


# -- the aggregator without a cost model -------------------------------------------------------------------

def aggregators(n=2, shape=(64, 16), **options):
    return [AutoAggregator("w", shape, torch.float32, n, r, None, interval=2, **LOSSY_PARAMETERS, **options)
            for r in range(n)]


def test_a_dense_gradient_is_planned_dense_without_a_cost_model_until_it_turns_sparse():
    n = 2
    aggs = aggregators(n)
    g = torch.Generator().manual_seed(3)
    dense = lambda: [torch.randn(64, 16, generator=g) for _ in range(n)]   # noqa: E731
    # statistics on step counts 1, 2 and 4: each plan dense, made without a model, and each scheduled one
    # (from count 2, the interval) doubling the interval: the next statistics at count 8
    for step in range(7):
        xs = dense()
        for y in run_step(aggs, xs):
            assert torch.equal(y, xs[0] + xs[1])
        assert [a.needs_cost_model() for a in aggs] == [False, False]
    assert {(a.strategy, a.plans) for a in aggs} == {("dense", 3)}
    assert aggs[0].plan_stats()["predicted_seconds"] == {}   # planned on its bytes, not priced
    spec = AutoSpec()
    assert not spec.calibration_due(aggs) and spec.calibration_stats(deferred=True) == {"source": "not needed"}
    assert [a.tracker.current_interval for a in aggs] == [8, 8]
    # 4 of 64 rows: its statistics step (step count 8) leaves a plan due that only a calibration can make
    sparse = []
    for r in range(n):
        x = torch.zeros(64, 16)
        x[4 * r:4 * r + 4] = torch.randn(4, 16, generator=g)
        sparse.append(x)
    for y in run_step(aggs, sparse):
        assert torch.equal(y, sparse[0] + sparse[1])
    assert [a.needs_cost_model() for a in aggs] == [True, True] and spec.calibration_due(aggs)
    assert [a.tracker.current_interval for a in aggs] == [2, 2]   # no plan made on it yet: not widened again
    # one such plan among plans that need none is enough
    assert spec.calibration_due([aggregators(n)[0], aggs[0]]) and not spec.calibration_due(aggregators(n))
    with pytest.raises(RuntimeError, match="no cost model is set"):
        aggs[0].plain_step()
    calibrated = AutoSpec(calibration=Calibration.default())   # known: never measured again
    assert not calibrated.calibration_due(aggs)
    model = CostModel(Calibration.default(bandwidth_bits=1e9))
    for a in aggs:
        a.cost_model = model
    # the plan is still due, but the model it needed is there
    assert [a.needs_cost_model() for a in aggs] == [False, False] and not spec.calibration_due(aggs)
    for a in aggs:   # priced now (on EWMAs still near the dense steps': dense or not, the model says)
        a.current_plan()
        assert a.plans == 4 and set(a.plan_stats()["predicted_seconds"]) == set(EXACT_STRATEGIES)
    assert not spec.calibration_due(aggs)


@pytest.mark.parametrize("options", [dict(lossy=True, lossy_min_bytes=0), dict(lossy=True), dict(first="sketch")],
                         ids=["lossy", "lossy_below_lossy_min_bytes", "first_sketch"])
def test_a_lossy_plan_or_one_not_on_dense_waits_for_the_cost_model(options):
    """Only an exact plan on dense keeps dense without a model: a lossy one may go half precision (with
    ``lossy`` every plan waits, docs/DESIGN.md: a tensor below ``lossy_min_bytes`` too, planned exactly), and
    one on another strategy is kept there unless dense is clearly cheaper, which only the prices say."""
    n = 2
    aggs = aggregators(n, **options)
    xs = [torch.randn(64, 16) for _ in range(n)]
    run_step(aggs, xs)
    assert [a.needs_cost_model() for a in aggs] == [True, True] and [a.plans for a in aggs] == [0, 0]


def test_a_look_without_a_model_keeps_the_interval_s_peak_for_the_plan():
    """dense_without_model looks at the statistics without resetting them (``stats(reset=False)``): the plan
    it lets be made without a model keeps a grown tensor's peak, as every plan keeps its interval's (PlanTracker)."""
    n = 2
    aggs = aggregators(n)
    g = torch.Generator().manual_seed(5)

    def first_rows(k):
        x = torch.zeros(64, 16)
        x[:k] = torch.randn(k, 16, generator=g)
        return x
    run_step(aggs, [first_rows(56) for _ in range(n)])   # dominated: planned dense without a model
    run_step(aggs, [first_rows(64) for _ in range(n)])   # its EWMAs 58, its peak 64
    for a in aggs:
        strategy, planned = a.current_plan()
        assert (strategy, a.plans, a.needs_cost_model()) == ("dense", 2, False)
        assert planned.rank_keys == (64, 58) and planned.union_keys == 64
