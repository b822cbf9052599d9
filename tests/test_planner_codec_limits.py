"""The planner's candidates at the codecs' limits (lossless_hc.training.planner.unbuildable): the strategies
whose codec cannot take a tensor's rows, coordinates or the world size are no candidates (the allgather's
int32 row index, the LHC codec's MAX_KEYS and MAX_WORLD_SIZE, THC's world size), and top-k allgathered,
which builds no LHC codec, runs beyond the LHC codec's ranks. The strategies run in-process:
tests/test_planner.py; the cost model's decisions alone: tests/test_planner_cost.py."""
import math

import torch

from lossless_hc.training.planner import CostModel
from lossless_hc.training.strategies import AutoAggregator
from test_planner import run_step
from test_planner_cost import MODEL, stats


def test_allgather_is_no_candidate_for_rows_beyond_its_int32_index():
    """The allgather's slots carry each row's index as an int32 (training.rows.gather_slots): a tensor
    of more than 2^31 - 1 rows is never planned on it (its rows would come back wrapped or lost)."""
    from lossless_hc.training.planner import ALLGATHER_MAX_KEYS
    assert ALLGATHER_MAX_KEYS == (1 << 31) - 1
    big = AutoAggregator("w", (ALLGATHER_MAX_KEYS + 1,), torch.float32, 2, 0, MODEL, first="allgather")
    assert "allgather" not in big.allowed and big.strategy == "dense", big.allowed
    # nor a candidate of the cost model alone (bench.simulate prices with it, without an aggregator)
    for lossy in (False, True):
        predicted = MODEL.choose(stats(ALLGATHER_MAX_KEYS + 1, 1, 2, 10, 20), lossy=lossy)[1]
        assert not {"allgather", "topk_allgather"} & set(predicted), predicted
    predicted = MODEL.choose(stats(ALLGATHER_MAX_KEYS, 1, 2, 10, 20), lossy=True)[1]
    assert {"allgather", "topk_allgather"} <= set(predicted), predicted
    predicted = MODEL.choose(stats(1 << 32, 4, 2, 10, 20), lossy=True)[1]   # 2^30 rows of 4: allgather only
    assert "allgather" in predicted and "topk_allgather" not in predicted, predicted
    assert "allgather" in AutoAggregator("w", (ALLGATHER_MAX_KEYS,), torch.float32, 2, 0, MODEL).allowed
    # the rows counted, not the coordinates: 2^30 rows of 4 are 2^32 coordinates
    assert "allgather" in AutoAggregator("w", (1 << 30, 4), torch.float32, 2, 0, MODEL).allowed
    # top-k allgathered sends coordinates: their count is what the int32 must hold
    lossy = dict(lossy=True, lossy_min_bytes=0)
    assert "topk_allgather" not in AutoAggregator("w", (1 << 30, 4), torch.float32, 2, 0, MODEL, **lossy).allowed
    assert "topk_allgather" in AutoAggregator("w", (ALLGATHER_MAX_KEYS,), torch.float32, 2, 0, MODEL, **lossy).allowed


def test_strategies_whose_codec_cannot_take_the_world_size_are_no_candidates():
    """The LHC codec takes at most 1024 ranks (lhc.layout.MAX_WORLD_SIZE): at more, the sketch and topk
    (which sums through it) are no candidates, instead of the first re-plan raising the codec's ValueError
    mid-run (1025 ranks: "world_size must be in [1, 1024]" at the end of step 0). topk_allgather, which
    sends its selections as pairs, stays one (its aggregator builds no codec: the next test)."""
    from lossless_hc.lhc.layout import MAX_WORLD_SIZE
    n = MAX_WORLD_SIZE + 1
    for lossy in (False, True):
        best, predicted = MODEL.choose(stats(1 << 20, 64, n, 10, 10), lossy=lossy)
        assert not {"sketch", "topk"} & set(predicted), predicted
        assert ("topk_allgather" in predicted) == lossy, predicted
    assert "sketch" in MODEL.choose(stats(1 << 20, 64, MAX_WORLD_SIZE, 10, 10))[1]
    lossy = dict(lossy=True, lossy_min_bytes=0)
    assert AutoAggregator("w", (1 << 12, 4), torch.float32, n, 0, MODEL, **lossy).allowed == (
        "dense", "allgather", "two_phase", "fp16", "bf16", "thc", "topk_allgather")
    assert "sketch" in AutoAggregator("w", (1 << 12, 4), torch.float32, MAX_WORLD_SIZE, 0, MODEL).allowed
    # a step and its plan at that many ranks, exact
    aggs = [AutoAggregator("w", (64, 4), torch.float32, n, r, MODEL, first="sketch") for r in range(n)]
    xs = [torch.zeros(64, 4) for _ in range(n)]
    for r, x in enumerate(xs):
        x[r % 3] = r + 1.0
    values = run_step(aggs, xs)
    assert aggs[0].plans == 1 and aggs[0].strategy in aggs[0].allowed
    assert all(torch.equal(v, torch.stack(xs).sum(0)) for v in values)


def test_top_k_allgathered_runs_beyond_the_lhc_codec_s_ranks():
    """topk_allgather at 2048 ranks (twice the LHC codec's limit): chosen by the cost model where it is the
    cheapest, and a step of it equals the sum of every rank's top-k selection, added in rank order, bit for
    bit (every rank's encode and decode; the gathered result finished on the first and last rank). Its
    aggregator builds no LHC codec, which refused more than 1024 ranks ("world_size must be in [1, 1024]")
    and kept topk_allgather out of the candidates there."""
    n, numel = 2048, 256
    # 1e-5 of a 64 MB gradient per rank: the ranks' pairs together are a fifth of the tensor
    model = CostModel(MODEL.calibration, topk_ratio=1e-5)
    best, predicted = model.choose(stats(1 << 24, 1, n, 1 << 24, 1 << 24), lossy=True)
    assert best == "topk_allgather", predicted
    aggs = [AutoAggregator("w", (numel,), torch.float32, n, r, MODEL, lossy=True, lossy_min_bytes=0,
                           first="topk_allgather") for r in range(n)]
    assert aggs[0].strategy == "topk_allgather" and "topk" not in aggs[0].allowed
    rng = torch.Generator().manual_seed(11)
    xs = [torch.randn(numel, generator=rng) for _ in range(n)]
    encoded = [a.encode(x) for a, x in zip(aggs, xs)]
    summed = torch.stack([p for p, _ in encoded]).sum(0)
    requests = [a.decode(summed, ctx).request for a, (_, ctx) in zip(aggs, encoded)]
    assert aggs[0]._topk.codec is None and aggs[0]._topk.k == math.ceil(MODEL.topk_ratio * numel)
    gathered = torch.stack([r.tensor.reshape(-1) for r in requests])
    truth = torch.zeros(numel)
    for x in xs:   # each rank's k largest |x| (no residual yet), in rank order
        idx = x.abs().topk(aggs[0]._topk.k).indices
        truth.index_add_(0, idx, x[idx])
    for r in (0, n - 1):
        assert torch.equal(aggs[r].finish(encoded[r][1], gathered.clone()), truth)


def test_top_k_allgathered_builds_its_codec_only_when_the_plan_moves_to_topk():
    """The top-k aggregator a topk_allgather plan builds holds no LHC codec; a re-plan to topk builds it
    before the step's payload is sized (payload_numel, which a message reads before encoding), and the
    2-rank topk_allgather step is unchanged: the two ranks' selections added in rank order."""
    n, numel = 2, 4096
    rng = torch.Generator().manual_seed(12)
    aggs = [AutoAggregator("w", (numel,), torch.float32, n, r, MODEL, lossy=True, lossy_min_bytes=0,
                           first="topk_allgather", allowed=("topk", "topk_allgather")) for r in range(n)]
    xs = [torch.randn(numel, generator=rng) for _ in range(n)]
    ys = run_step(aggs, xs)
    k = math.ceil(MODEL.topk_ratio * numel)
    sent = [torch.zeros(numel).index_copy_(0, x.abs().topk(k).indices, x[x.abs().topk(k).indices]) for x in xs]
    assert all(torch.equal(y, sent[0] + sent[1]) for y in ys)
    assert all(a._topk is not None and a._topk.codec is None for a in aggs)
    for a in aggs:
        a.strategy = "topk"   # the plan, the same on every rank
    sizes = [a.payload_numel() for a in aggs]
    payloads = [a.encode(x)[0] for a, x in zip(aggs, xs)]
    assert [p.numel() for p in payloads] == sizes and all(a._topk.codec is not None for a in aggs), sizes
    assert sizes[0] < numel


def test_sketch_and_top_k_are_no_candidates_beyond_the_codec_s_keys():
    """The LHC codec indexes at most 2^32 - 2^12 keys (lhc.layout.MAX_KEYS): the sketch of a tensor of more
    rows, and top-k of one of more coordinates, are no candidates, instead of its first plan raising "keys
    exceeds the supported 4294963200" (a 2^33-coordinate gradient, 32 GiB: nothing is allocated here)."""
    from lossless_hc.lhc.layout import MAX_KEYS
    for shape, lossy in (((1 << 33,), False), ((1 << 33,), True), ((1 << 32, 4), True)):
        agg = AutoAggregator("w", shape, torch.float32, 2, 0, MODEL, lossy=lossy)
        assert not {"sketch", "topk", "topk_allgather"} & set(agg.allowed), agg.allowed
        agg.tracker.observe((1000, 1000), 2000)
        agg._plan()
        assert agg.strategy == "two_phase", agg.predicted
    # a table of few enough rows keeps the sketch; top-k counts coordinates
    agg = AutoAggregator("w", (1 << 26, 64), torch.float32, 2, 0, MODEL, lossy=True)
    assert "sketch" in agg.allowed and "topk" not in agg.allowed
    assert "sketch" in MODEL.choose(stats(MAX_KEYS, 1, 2, 1000, 2000))[1]
    assert "sketch" not in MODEL.choose(stats(MAX_KEYS + 1, 1, 2, 1000, 2000))[1]


def test_unbuildable_draws_each_codec_s_limit_at_its_bound():
    """``unbuildable`` (its docstring): the sketch out beyond MAX_WORLD_SIZE ranks or MAX_KEYS rows, top-k
    beyond MAX_WORLD_SIZE ranks or MAX_KEYS coordinates, allgather beyond ALLGATHER_MAX_KEYS rows,
    topk_allgather beyond as many coordinates, THC beyond its exact world size; each bound itself buildable,
    and each limit on its own (ranks, rows, coordinates)."""
    from lossless_hc.lhc.layout import MAX_KEYS, MAX_WORLD_SIZE
    from lossless_hc.thc.layout import max_world_size
    from lossless_hc.training.planner import ALLGATHER_MAX_KEYS, THC_GRANULARITY, unbuildable
    A = ALLGATHER_MAX_KEYS
    assert unbuildable(2, 1, 1) == frozenset() == unbuildable(MAX_WORLD_SIZE, A, A)
    assert unbuildable(MAX_WORLD_SIZE + 1, 1, 1) == {"sketch", "topk"}
    assert unbuildable(2, A + 1, 1) == {"allgather"} and unbuildable(2, 1, A + 1) == {"topk_allgather"}
    assert unbuildable(2, MAX_KEYS, MAX_KEYS) == {"allgather", "topk_allgather"}
    assert unbuildable(2, MAX_KEYS + 1, 1) == {"sketch", "allgather"}
    assert unbuildable(2, 1, MAX_KEYS + 1) == {"topk", "topk_allgather"}
    top = max_world_size(THC_GRANULARITY)
    assert top > MAX_WORLD_SIZE and "thc" not in unbuildable(top, 1, 1) and "thc" in unbuildable(top + 1, 1, 1)
