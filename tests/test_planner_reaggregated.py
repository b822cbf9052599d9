"""The request of a decode's inexact keys, which a sketch or top-k plan issues at nearly every step: what the
planner's cost model prices for it (plan_stats.reaggregated_prior before the plan ran on a tensor, the
tracker's EWMA after), what the aggregators feed that EWMA, and that a checkpoint keeps it."""
import math

import pytest
import torch

from lossless_hc.training.checkpoint import aggregator_state_dict, load_aggregator_state_dict
from lossless_hc.training.plan_tracker import PlanTracker
from lossless_hc.training.plan_stats import TensorStats, reaggregated_prior
from lossless_hc.training.planner import TOPK_RATIO
from lossless_hc.training.strategies import AutoAggregator
from test_planner import run_step, sparse_rows
from test_planner_cost import MODEL


def prior(strategy, s):
    return reaggregated_prior(strategy, s, TOPK_RATIO)


def test_the_prior_is_one_percent_of_the_union_s_coordinates():
    """Before a plan ran on the tensor: ``ceil(0.01 u b)`` coordinates, at most the tensor; top-k's are 1% of
    its ``min(n k, d)`` selections, whatever the rows."""
    assert prior("sketch", TensorStats(1 << 20, 1, 4, (300,) * 4, 1000)) == 10
    assert prior("sketch", TensorStats(1 << 16, 32, 4, (40,) * 4, 100)) == 32
    assert prior("sketch", TensorStats(1 << 16, 32, 4, (40,) * 4, 101)) == 33   # 32.32, rounded up
    assert prior("sketch", TensorStats(1 << 16, 32, 4, (0,) * 4, 0)) == 0
    assert prior("sketch", TensorStats(1, 200, 2, (1, 1), 1)) == 1   # 2 of a row of 200, but the tensor has 1
    # top-k, 1% of 2^16 coordinates per rank (k = 656) on 4 ranks: 1% of 2624, whatever the rows
    for row in (1, 64):
        assert prior("topk", TensorStats(1 << 16, row, 4, (1,) * 4, 1)) == 27
    # more ranks than coordinates: the selections are at most the tensor (1% of 100, not of 200 x 1)
    assert prior("topk", TensorStats(100, 1, 200, (1,) * 200, 1)) == 1
    with pytest.raises(ValueError, match="only sketch and topk"):
        prior("two_phase", TensorStats(64, 1, 2, (1, 1), 1))


def test_the_model_prices_the_observed_count_once_the_plan_ran():
    """An observed count replaces the prior, 0 meaning no request at all (nor its latency); a count that is
    not a number >= 0 is refused with the other statistics."""
    s = TensorStats(1 << 16, 32, 4, (40,) * 4, 100)
    first = MODEL.collectives("sketch", s)[0]
    assert MODEL.collectives("sketch", s)[1] == ("allreduce", 4 * 32)
    seen = TensorStats(1 << 16, 32, 4, (40,) * 4, 100, sketch_reaggregated=7 * 32, topk_reaggregated=5)
    assert MODEL.collectives("sketch", seen) == [first, ("allreduce", 4 * 7 * 32)]
    assert MODEL.collectives("topk", seen)[1:] == [("allreduce", 4 * 5)]
    none = TensorStats(1 << 16, 32, 4, (40,) * 4, 100, sketch_reaggregated=0, topk_reaggregated=0)
    assert MODEL.collectives("sketch", none) == [first] and len(MODEL.collectives("topk", none)) == 1
    link = MODEL.calibration.link
    assert math.isclose(MODEL.predict("sketch", s) - MODEL.predict("sketch", none), link.allreduce(4 * 32, 4),
                        rel_tol=1e-12)
    for bad in (-1, math.nan, math.inf):
        with pytest.raises(ValueError, match="sketch_reaggregated"):
            TensorStats(64, 1, 2, (1, 1), 1, sketch_reaggregated=bad)
        with pytest.raises(ValueError, match="topk_reaggregated"):
            TensorStats(64, 1, 2, (1, 1), 1, topk_reaggregated=bad)


def test_the_tracker_keeps_an_ewma_per_plan_across_plan_changes():
    t = PlanTracker(1000, 10, 2, alpha=0.25)
    t.observe([5, 5], 8)
    assert (t.stats().sketch_reaggregated, t.stats().topk_reaggregated) == (None, None)
    t.observe_reaggregated("sketch", 40)   # the first sets it
    t.observe_reaggregated("sketch", 0)
    t.observe_reaggregated("topk", 3)
    assert t.reaggregated == {"sketch": 30.0, "topk": 3.0}
    t.observe([5, 5], 8)
    s = t.stats()
    assert (s.sketch_reaggregated, s.topk_reaggregated) == (30, 3)
    t.observe_reaggregated("sketch", 1)   # 22.75, then 17.0625: rounded to the nearest coordinate
    assert t.stats().sketch_reaggregated == 23
    t.observe_reaggregated("sketch", 0)
    assert t.stats().sketch_reaggregated == 17
    for bad in (-1, 1001, math.nan):
        with pytest.raises(ValueError, match="re-aggregated"):
            t.observe_reaggregated("sketch", bad)
    assert t.reaggregated["sketch"] == 17.0625


def recorded(aggs) -> list:
    """Per rank, the (strategy, coordinates) every step feeds its tracker's re-aggregation EWMA."""
    calls = [[] for _ in aggs]
    for r, a in enumerate(aggs):
        def observe(strategy, coordinates, real=a.tracker.observe_reaggregated, r=r):
            calls[r].append((strategy, int(coordinates)))
            real(strategy, coordinates)
        a.tracker.observe_reaggregated = observe
    return calls


def test_a_sketch_plan_feeds_the_coordinates_it_re_aggregated_and_plans_on_them():
    """A sketch plan of a 32-wide table re-aggregates some coordinates of a share of its rows at every step
    (those the decode's bounds do not prove): each step feeds exactly the coordinates its request sends,
    fewer than the inexact rows hold, and each plan prices their EWMA."""
    n, rows, dim = 4, 4000, 32
    rng = torch.Generator().manual_seed(11)
    aggs = [AutoAggregator("emb", (rows, dim), torch.float32, n, r, MODEL, first="sketch", allowed=("sketch",),
                           interval=2) for r in range(n)]
    calls = recorded(aggs)
    sent = [[] for _ in aggs]
    for r, a in enumerate(aggs):
        a._at_coordinates = lambda ctx, c, at=a._at_coordinates, r=r: sent[r].append(c.numel()) or at(ctx, c)
    ewma, before = None, 0
    for step in range(5):
        run_step(aggs, [sparse_rows(rng, rows, dim, 40) for _ in range(n)])   # within the first sizing
        keys = aggs[0].stats.inexact_keys - before
        before = aggs[0].stats.inexact_keys
        coords = sent[0][step]
        assert 0 < coords < keys * dim and aggs[0].stats.fallbacks == 0
        assert [c[step] for c in calls] == [("sketch", coords)] * n and [q[step] for q in sent] == [coords] * n
        ewma = coords if ewma is None else 0.75 * ewma + 0.25 * coords
        assert all(a.tracker.reaggregated == {"sketch": pytest.approx(ewma)} for a in aggs)
    planned = aggs[0].plan_input   # the plan of step 4 (interval 2)
    assert planned.sketch_reaggregated > 0 and planned.topk_reaggregated is None
    assert MODEL.collectives("sketch", planned)[1] == ("allreduce", 4 * planned.sketch_reaggregated)


def test_a_sketch_plan_that_proves_every_key_feeds_zero_and_a_failed_decode_nothing():
    """One rank's rows alone are exact (no sum): every step feeds 0. A step past the sketch's capacity falls
    back densely, which the model neglects: it feeds nothing. With ``partial=False`` an inexact decode's
    dense fallback feeds the whole tensor."""
    n, rows, dim = 2, 2000, 4
    rng = torch.Generator().manual_seed(12)
    aggs = [AutoAggregator("emb", (rows, dim), torch.float32, n, r, MODEL, first="sketch", allowed=("sketch",),
                           interval=100) for r in range(n)]
    calls = recorded(aggs)
    run_step(aggs, [sparse_rows(rng, rows, dim, 20), torch.zeros(rows, dim)])
    assert calls == [[("sketch", 0)]] * n and aggs[0].stats.inexact_decodes == 0
    run_step(aggs, [sparse_rows(rng, rows, dim, 1500) for _ in range(n)])   # far past the sized capacity
    assert aggs[0].stats.fallbacks == 1 and calls == [[("sketch", 0)]] * n

    aggs = [AutoAggregator("emb", (rows, 32), torch.float32, n, r, MODEL, first="sketch", allowed=("sketch",),
                           interval=100, partial=False) for r in range(n)]
    calls = recorded(aggs)
    run_step(aggs, [sparse_rows(rng, rows, 32, 20) for _ in range(n)])
    assert aggs[0].stats.inexact_decodes == 1 and calls == [[("sketch", rows * 32)]] * n


def test_a_top_k_plan_feeds_its_inexact_selections_at_every_step():
    """Top-k's request is of coordinates, issued between statistics steps too: every step feeds the
    coordinates it re-aggregated (the ``inexact_keys`` it added)."""
    n, numel = 4, 1 << 16
    rng = torch.Generator().manual_seed(13)
    aggs = [AutoAggregator("w", (numel,), torch.float32, n, r, MODEL, lossy=True, lossy_min_bytes=0, first="topk",
                           allowed=("topk",), interval=4) for r in range(n)]
    calls = recorded(aggs)
    before = []
    for _ in range(5):
        run_step(aggs, [torch.randn(numel, generator=rng) for _ in range(n)])
        before.append(aggs[0].stats.inexact_keys)
    per_step = [b - a for a, b in zip([0] + before, before)]
    assert sum(per_step) > 0 and aggs[0].stats.fallbacks == 0
    assert calls == [[("topk", c) for c in per_step]] * n


def test_a_checkpoint_keeps_the_re_aggregation_ewma():
    """state_dict() saves the EWMA (a copy: later steps do not change it), a restore brings it back, and a
    state saved before it existed restores none (the prior prices it again)."""
    rng = torch.Generator().manual_seed(14)
    n, rows, dim = 2, 2000, 32
    aggs = [AutoAggregator("emb", (rows, dim), torch.float32, n, r, MODEL, first="sketch", allowed=("sketch",),
                           interval=2) for r in range(n)]
    run_step(aggs, [sparse_rows(rng, rows, dim, 20) for _ in range(n)])
    saved = aggregator_state_dict(aggs[0])
    kept = dict(aggs[0].tracker.reaggregated)
    assert saved["tracker"]["reaggregated"] == kept and kept["sketch"] > 0
    run_step(aggs, [sparse_rows(rng, rows, dim, 20) for _ in range(n)])
    assert saved["tracker"]["reaggregated"] == kept != aggs[0].tracker.reaggregated
    fresh = AutoAggregator("emb", (rows, dim), torch.float32, n, 0, MODEL, first="sketch", allowed=("sketch",),
                           interval=2)
    load_aggregator_state_dict(fresh, saved)
    assert fresh.tracker.reaggregated == kept
    saved["tracker"]["reaggregated"]["sketch"] = -1.0   # the restored EWMA is a copy of the saved one
    assert fresh.tracker.reaggregated == kept
    del saved["tracker"]["reaggregated"]
    load_aggregator_state_dict(fresh, saved)
    assert fresh.tracker.reaggregated == {}


def test_a_top_k_plan_without_partial_feeds_the_tensor_and_a_failed_decode_nothing():
    """``partial=False``: an inexact top-k decode falls back densely, which feeds the whole tensor; a NaN in
    a rank's gradient fails the decode (non-finite input), whose fallback the model neglects: it feeds nothing."""
    n, numel = 4, 1 << 16
    rng = torch.Generator().manual_seed(15)
    aggs = [AutoAggregator("w", (numel,), torch.float32, n, r, MODEL, lossy=True, lossy_min_bytes=0, first="topk",
                           allowed=("topk",), interval=4, partial=False) for r in range(n)]
    calls = recorded(aggs)
    for _ in range(2):   # the first decode is inexact, the second proves every key
        run_step(aggs, [torch.randn(numel, generator=rng) for _ in range(n)])
    assert aggs[0].stats.fallbacks == 1 and calls == [[("topk", numel), ("topk", 0)]] * n
    xs = [torch.randn(numel, generator=rng) for _ in range(n)]
    xs[1][7] = math.nan
    run_step(aggs, xs)
    assert aggs[0].stats.fallbacks == 2 and calls == [[("topk", numel), ("topk", 0)]] * n


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_half_precision_gradient_s_inexact_coordinates_are_requested_in_float32(dtype):
    """A float16 or bfloat16 gradient's sketch plan requests its unproven coordinates' values in float32 (as
    its dense fallback sends the gradient): an engine's SUM of them in the gradient's dtype would round at
    each addition, and a request of another dtype is a collective of its own in the message."""
    n, rows, dim = 4, 4000, 32
    rng = torch.Generator().manual_seed(11)
    aggs = [AutoAggregator("emb", (rows, dim), dtype, n, r, MODEL, first="sketch", allowed=("sketch",), interval=2)
            for r in range(n)]
    xs = [sparse_rows(rng, rows, dim, 40).to(dtype) for _ in range(n)]
    encoded = [a.encode(x) for a, x in zip(aggs, xs)]
    summed = torch.stack([p.to(torch.float64) for p, _ in encoded]).sum(0).to(encoded[0][0].dtype)
    outcome = aggs[0].decode(summed, encoded[0][1])
    assert outcome.value is None and outcome.request.kind == "allreduce"
    sent, coords = outcome.request.tensor, encoded[0][1].partial[1]   # the unproven coordinates (ctx.partial)
    assert sent.dtype == torch.float32 and coords.numel() > 0
    assert torch.equal(sent, xs[0].reshape(-1)[coords].to(torch.float32))
