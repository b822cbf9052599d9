"""The planner's plans over steps (lossless_hc.training.strategies, run in-process as tests/test_planner.py
runs them): a dense plan's statistics one step in ``interval`` and its plain steps between, the engines'
scale, re-plans (a tensor turning sparse, near ties, a calibration given late), the allgather's rank
order on every device, and which steps count rows. What the steps count and time (the aggregation
stats, the measured seconds): tests/test_planner_step_stats.py."""
import types

import pytest
import torch

import lossless_hc.training.step as step_module
import lossless_hc.training.strategies as strategies
from lossless_hc.training.planner import STRATEGIES
from lossless_hc.training.plan_stats import TensorStats, stats_header_words
from lossless_hc.training.aggregate import ConfigurationMismatch
from lossless_hc.training.strategies import AutoAggregator
from test_planner import _Choosing, record_sent, run_step, sparse_rows
from test_planner_cost import MODEL, stats


# -- a dense plan's cost: statistics one step in ``interval``, the switch margin, the calibration's sizes ---

def test_a_dense_plan_sends_the_bare_tensor_between_its_statistics_steps():
    """Dense gradients: the first step and every ``interval``-th carry the statistics header; the others
    are the bare tensor (no scan, nothing to parse), on every rank alike, and every step is exact."""
    n, rows, dim, interval = 3, 40, 8, 4
    rng = torch.Generator().manual_seed(5)
    aggs = [AutoAggregator("w", (rows, dim), torch.float32, n, r, MODEL, interval=interval) for r in range(n)]
    header = stats_header_words(n)
    sizes = []
    for step in range(10):
        carries = {a.carries_statistics() for a in aggs}
        assert len(carries) == 1
        xs = [torch.randn(rows, dim, generator=rng) for _ in range(n)]
        expected = {a.payload_numel() for a in aggs}
        enc = [a.encode(x) for a, x in zip(aggs, xs)]
        assert {p.numel() for p, _ in enc} == expected == {rows * dim + (header if carries.pop() else 0)}
        sizes.append(expected.pop())
        summed = torch.stack([p for p, _ in enc]).sum(0)
        truth = torch.stack([x.double() for x in xs]).sum(0)
        for a, (_, ctx) in zip(aggs, enc):
            out = a.decode(summed.clone(), ctx)
            assert out.request is None and torch.allclose(out.value.double(), truth, rtol=0, atol=1e-5)
    with_header = [i + 1 for i, m in enumerate(sizes) if m > rows * dim]
    assert with_header == [1, 4, 8], sizes   # step counts 1 and multiples of interval
    for a in aggs:
        assert a.strategy == "dense" and a.steps == 10 and a.plain_steps == 7
        assert a.plan_stats()["plain_steps"] == 7


def test_a_plain_step_keeps_the_engines_scale():
    """An engine that averages (Horovod's default): a plain step's value is the average, like a dense
    step with a header (whose contributor count tells the aggregator it was averaged)."""
    n = 2
    aggs = [AutoAggregator("w", (16,), torch.float32, n, r, MODEL, interval=8) for r in range(n)]
    xs = [torch.arange(16, dtype=torch.float32) + r for r in range(n)]
    for step in range(3):
        ys = run_step(aggs, xs, average=True)
        assert all(torch.equal(y, (xs[0] + xs[1]) / 2) for y in ys), step
    assert aggs[0].plain_steps == 2


def test_a_dense_tensor_that_turns_sparse_is_replanned_at_its_next_statistics_step():
    n, rows, dim, interval = 3, 4000, 16, 4
    rng = torch.Generator().manual_seed(6)
    aggs = [AutoAggregator("emb", (rows, dim), torch.float32, n, r, MODEL, interval=interval) for r in range(n)]
    seen = []
    for step in range(12):
        k = 3900 if step < 2 else 20
        xs = [sparse_rows(rng, rows, dim, k) for _ in range(n)]
        truth = torch.stack([x.double() for x in xs]).sum(0)
        for y in run_step(aggs, xs):
            assert torch.allclose(y.double(), truth, rtol=0, atol=1e-5)
        assert len({a.strategy for a in aggs}) == 1
        seen.append(aggs[0].strategy)
    # dense until a statistics step (count 4 or 8) sees the sparse rows, then the sparse strategy
    (switch, to) = aggs[0].history[0]
    assert switch in (4, 8) and to != "dense" and seen[:switch - 1] == ["dense"] * (switch - 1), seen
    assert "dense" not in seen[switch - 1:] and all(s % 4 == 0 for s, _ in aggs[0].history), aggs[0].history
    assert aggs[0].history == aggs[1].history == aggs[2].history


def test_a_replan_keeps_the_strategy_in_use_on_a_near_tie():
    from lossless_hc.training.planner import SWITCH_MARGIN
    s = stats(1 << 16, 64, 4, 1024, 1024)
    best, predicted = MODEL.choose(s)
    c = 2 * (4 - 1) * MODEL.calibration.link.alpha_s   # the first allreduce's latency, common to all
    runner_up = min((t for t in predicted if t != best), key=predicted.get)
    assert MODEL.choose(s, current=best)[0] == best
    near = predicted[best] - c >= (1 - SWITCH_MARGIN) * (predicted[runner_up] - c)
    assert MODEL.choose(s, current=runner_up)[0] == (runner_up if near else best), predicted
    far = max(predicted, key=predicted.get)   # far worse than the best: left
    assert predicted[best] - c < (1 - SWITCH_MARGIN) * (predicted[far] - c)
    assert MODEL.choose(s, current=far)[0] == best
    # Shrink the union of a tensor every rank holds densely: the first union at which another strategy
    # is predicted cheaper than dense is a near tie, so a dense plan stays dense there; a much smaller
    # union leaves dense; and a plan already on the cheaper strategy stays on it at the tie.
    D, b, n = 4096, 64, 4
    rows = [u for u in range(D, 0, -8) if MODEL.choose(TensorStats(D * b, b, n, (u,) * n, u))[0] != "dense"]
    u = rows[0]
    tie = TensorStats(D * b, b, n, (u,) * n, u)
    cheaper, p = MODEL.choose(tie)
    assert p[cheaper] < p["dense"] and MODEL.choose(tie, current="dense")[0] == "dense", p
    assert MODEL.choose(tie, current=cheaper)[0] == cheaper
    assert MODEL.choose(TensorStats(D * b, b, n, (u // 4,) * n, u // 4), current="dense")[0] != "dense"


def test_a_strategy_exactly_the_switch_margin_faster_does_not_replace_the_one_in_use():
    """The switch rule is strict (``CostModel.choose``): the strategy in use is kept unless
    ``t_best - c < (1 - SWITCH_MARGIN)(t_current - c)``, so a candidate predicted exactly that much cheaper
    leaves it in place, and one a hair cheaper still replaces it. A free link (``c`` = 0) and local costs
    per coordinate over 1024 coordinates make the predictions exact: dense ``x``, allgather
    ``(1 - SWITCH_MARGIN) x``."""
    from lossless_hc.training.planner import DEFAULT_CODEC_SECONDS, SWITCH_MARGIN, Calibration, CostModel, LinkModel
    import math
    s = TensorStats(1024, 1, 2, (0, 0), 0)
    x = 1e-9

    def model(per_coord_allgather):
        codec = dict(DEFAULT_CODEC_SECONDS, dense=(x, 0.0), allgather=(per_coord_allgather, 0.0),
                     two_phase=(10 * x, 0.0), sketch=(10 * x, 0.0))
        return CostModel(Calibration(LinkModel(0.0, 0.0), codec))
    at_margin = model((1.0 - SWITCH_MARGIN) * x)
    best, predicted = at_margin.choose(s)
    assert best == "allgather" and predicted["allgather"] == (1.0 - SWITCH_MARGIN) * predicted["dense"], predicted
    assert at_margin.choose(s, current="dense")[0] == "dense"
    beyond = model(math.nextafter((1.0 - SWITCH_MARGIN) * x, 0.0))
    assert beyond.choose(s, current="dense")[0] == "allgather"


def test_an_aggregator_built_before_the_calibration_plans_once_it_is_given():
    n = 2
    aggs = [AutoAggregator("emb", (4000, 16), torch.float32, n, r, None, interval=4, topk_ratio=0.01, thc_bits=4)
            for r in range(n)]
    rng = torch.Generator().manual_seed(7)
    xs = [sparse_rows(rng, 4000, 16, 20) for _ in range(n)]
    run_step(aggs, xs)   # the first step is dense and needs no cost model; its plan waits
    assert all(a.strategy == "dense" and a._plan_due for a in aggs)
    with pytest.raises(RuntimeError, match="not calibrated"):
        aggs[0].encode(xs[0])
    for a in aggs:
        a.cost_model = MODEL
    truth = torch.stack([x.double() for x in xs]).sum(0)
    for y in run_step(aggs, xs):   # the due plan is applied at this encode, on every rank alike
        assert torch.allclose(y.double(), truth, rtol=0, atol=1e-5)
    assert {a.strategy for a in aggs} == {aggs[0].strategy} and aggs[0].strategy != "dense"


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_gathered_rows_are_summed_in_rank_order_on_every_device(device):
    """The allgather strategy's sum of the gathered slots (rows.sum_slots) adds each row's values in rank
    order, so every rank gets the same bits; values chosen so that another order changes them (1e8 + 1
    - 1e8 is 0 in float32, -1e8 + 1e8 + 1 is 1)."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from lossless_hc.training.rows import gather_slots, sum_slots
    n, k, row = 5, 4, 3
    sent = {0: [2, 7], 1: [7], 2: [], 3: [1, 2, 7, 9], 4: [7, 9]}
    gen = torch.Generator().manual_seed(0)
    values = {r: torch.randn(len(rows), row, generator=gen) for r, rows in sent.items()}
    values[0][1] = 1e8   # row 7: 1e8, then 1, then -1e8 (ranks 0, 1, 3), then rank 4's
    values[1][0] = 1.0
    values[3][2] = -1e8
    slots = torch.stack([gather_slots(torch.tensor(sent[r], dtype=torch.int64, device=device),
                                      values[r].to(device), k, row).reshape(k, 1 + row) for r in range(n)])
    union, rows = sum_slots(slots, row)
    assert union.tolist() == [1, 2, 7, 9]
    want = torch.zeros(4, row)
    for r in range(n):   # rank order, one float32 addition at a time
        for i, key in enumerate(sent[r]):
            want[union.tolist().index(key)] += values[r][i]
    assert torch.equal(rows.cpu(), want)
    assert torch.equal(rows[2].cpu(), values[4][0])   # 1e8 + 1 - 1e8 = 0 first: row 7 is rank 4's value


def test_the_in_process_engine_gathers_in_rank_order():
    """step.run_in_process stacks an allgather's tensors in rank order, as an engine does, so an allgather
    plan's rows are summed rank 0 first: 1 + 1e8 - 1e8 is 0 in float32 (in the reverse order, 1)."""
    n = 3
    aggs = [AutoAggregator("w", (8, 2), torch.float32, n, r, MODEL, first="allgather", allowed=("allgather",))
            for r in range(n)]
    xs = [torch.zeros(8, 2) for _ in range(n)]
    for x, v in zip(xs, (1.0, 1e8, -1e8)):
        x[0] = v
    for y in run_step(aggs, xs):
        assert torch.equal(y, torch.zeros(8, 2))


def test_the_in_process_engine_refuses_requests_no_engine_could_carry_out():
    """Ranks whose plans differ (here an allgather and an fp16 plan, whose first payloads are both the header
    alone) ask for different second collectives: run_in_process raises, as no engine could run them."""
    aggs = [AutoAggregator("w", (64, 4), torch.float32, 2, r, MODEL, lossy=True, lossy_min_bytes=0, first=s,
                           allowed=(s,)) for r, s in enumerate(("allgather", "fp16"))]
    xs = [torch.ones(64, 4), torch.ones(64, 4)]
    with pytest.raises(RuntimeError, match="the ranks asked for different collectives"):
        run_step(aggs, xs)


def test_the_in_process_engine_runs_a_world_of_one():
    """One rank (world_size 1, planned dense) is a world like any other for run_in_process: its statistics
    steps and its plain steps return the rank's own gradient, exactly."""
    agg = AutoAggregator("w", (64, 8), torch.float32, 1, 0, MODEL, interval=2)
    x = torch.zeros(64, 8)
    x[3], x[10] = 1.5, -2.0
    for _ in range(3):
        (y,) = run_step([agg], [x])
        assert torch.equal(y, x)
    assert agg.steps == 3 and agg.plain_steps > 0


def test_the_in_process_engine_sums_unless_it_is_told_to_average():
    """run_in_process's engine SUMs the ranks' payloads by default (DDP's, BytePS's), as the aggregators expect
    unless told otherwise; average=True divides by n (Horovod's default) and the values are the average."""
    n = 2
    aggs = [AutoAggregator("w", (16,), torch.float32, n, r, MODEL) for r in range(n)]
    xs = [torch.arange(16, dtype=torch.float32) + r for r in range(n)]
    values, _ = step_module.run_in_process(aggs, xs)
    assert all(torch.equal(y, xs[0] + xs[1]) for y in values)
    values, _ = step_module.run_in_process(aggs, xs, average=True)
    assert all(torch.equal(y, (xs[0] + xs[1]) / 2) for y in values)


@pytest.mark.parametrize("first,calls", [("allgather", 3), ("dense", 2)])
def test_the_in_process_engine_times_the_aggregators_calls_only(monkeypatch, first, calls):
    """run_in_process's seconds are the aggregators' own calls (encode, decode and, with a second collective,
    finish, on each rank) summed, the collectives left out: on a clock that ticks 1 s per reading, one
    second per call."""
    ticks = iter(range(10 ** 6))
    monkeypatch.setattr(step_module, "time", types.SimpleNamespace(perf_counter=lambda: float(next(ticks))))
    n = 2
    aggs = [AutoAggregator("w", (64, 8), torch.float32, n, r, MODEL, first=first, allowed=(first,))
            for r in range(n)]
    xs = [torch.ones(64, 8) for _ in range(n)]
    values, seconds = step_module.run_in_process(aggs, xs)
    assert all(torch.equal(y, 2 * torch.ones(64, 8)) for y in values)
    assert seconds == calls * n


def test_a_dense_gradient_s_sketch_plan_counts_its_rows_as_it_encodes_them(monkeypatch):
    """A sketch plan of a dense gradient takes this rank's row count (its statistics) from the encoder's
    own count (LosslessCodec.encoded_keys), not from a second read of the gradient by the row scan: the
    statistics carry the rows holding a value other than +-0.0, and the step's sum is exact."""
    rng = torch.Generator().manual_seed(4)
    aggs = [AutoAggregator("emb", (500, 16), torch.float32, 3, r, MODEL, first="sketch", allowed=("sketch",))
            for r in range(3)]
    xs = [sparse_rows(rng, 500, 16, k) for k in (0, 40, 75)]
    xs[2][xs[2].abs().sum(dim=1).argmax()] = -0.0   # a row of -0.0: not a row held
    want = [int((x != 0).any(dim=1).sum()) for x in xs]
    assert want == [0, 40, 74]

    run_step(aggs, xs)   # sized for 1% of the rows before any statistics: a dense fallback, then sized

    def scanned(self, *args):
        raise AssertionError("the sketch step read a tensor for its rows")
    monkeypatch.setattr(AutoAggregator, "_present", scanned)   # a result's rows
    monkeypatch.setattr(AutoAggregator, "_scan", scanned)      # a gradient's rows
    for y in run_step(aggs, xs):
        assert torch.allclose(y, sum(xs), rtol=2 ** -10, atol=0)
    assert aggs[0].fallbacks == 1 and aggs[0].tracker.rank_keys == [float(k) for k in want]


@pytest.mark.parametrize("strategy", ["thc", "topk"])
def test_thc_and_top_k_count_rows_on_the_statistics_steps_only(strategy, monkeypatch):
    """A THC or top-k plan's header rides on every step, but its counts are statistics on a dense plan's
    statistics steps only (the first, then step counts that are multiples of ``interval``): the gradient's
    and the result's rows are scanned and the tracker observes there; between them nothing scans."""
    n = 2
    aggs = [AutoAggregator("w", (4096,), torch.float32, n, r, MODEL, lossy=True, first=strategy, allowed=(strategy,),
                           interval=4, lossy_min_bytes=0) for r in range(n)]
    scans = []
    present, scan = AutoAggregator._present, AutoAggregator._scan

    def counted_present(self, flat):   # a result's rows
        scans.append(self.steps)
        return present(self, flat)

    def counted_scan(self, ctx):       # a gradient's rows
        scans.append(self.steps)
        return scan(self, ctx)
    monkeypatch.setattr(AutoAggregator, "_present", counted_present)
    monkeypatch.setattr(AutoAggregator, "_scan", counted_scan)
    g = torch.Generator().manual_seed(3)
    observed = []
    for _ in range(9):
        xs = [torch.randn(4096, generator=g) for _ in range(n)]
        xs[1][:100] = 0.0
        before = aggs[0].tracker.steps
        run_step(aggs, xs)
        observed.append(aggs[0].tracker.steps > before)
    assert aggs[0].strategy == strategy and aggs[0].steps == 9
    assert observed == [True, False, False, True, False, False, False, True, False]
    assert scans == [s for s in (0, 3, 7) for _ in range(2 * n)]   # each rank's gradient, then the result
    assert aggs[0].tracker.rank_keys == [4096.0, 3996.0]


def test_a_sketch_that_fails_is_resized_at_once_not_at_the_next_interval():
    """A failed sketch decode (the support outgrew the sketch) falls back densely and forces a re-plan
    after that step, so the next step's sketch is sized for the new support and decodes: one fallback, not
    one per step until the interval's plan."""
    n, numel = 2, 4000
    aggs = [AutoAggregator("w", (numel,), torch.float32, n, r, MODEL, first="sketch", allowed=("sketch",),
                           interval=1000) for r in range(n)]
    rng = torch.Generator().manual_seed(3)
    for step, k in enumerate((5, 400, 400, 400)):
        rows = torch.randperm(numel, generator=rng)[:k]   # one support on every rank: the union is k
        xs = [torch.zeros(numel).index_copy_(0, rows, torch.randn(k, generator=rng)) for _ in range(n)]
        truth = torch.stack(xs).double().sum(0)
        for y in run_step(aggs, xs):
            assert torch.equal(y != 0, truth != 0)
            assert torch.allclose(y.double(), truth, rtol=0, atol=1e-5)
        assert [a.fallbacks for a in aggs] == [0 if step == 0 else 1] * n, step


@pytest.mark.parametrize("strategy", ("dense", "allgather", "two_phase", "sketch", "topk"))
def test_an_empty_tensor_s_first_payload_is_priced_at_its_statistics_header_alone(strategy):
    """A tensor of no coordinates has no body, bitmap, sketch or selection to send: its statistics step's
    payload is the ``1 + 2n`` words of the statistics header, and the cost model prices the first collective
    at exactly those bytes (``H = 4(1 + 2n)``), not a word more."""
    n = 2
    aggs = [AutoAggregator("w", (0,), torch.float32, n, r, MODEL, lossy=True, lossy_min_bytes=0,
                           first=strategy, allowed=(strategy,), interval=1) for r in range(n)]
    sent = record_sent(aggs)
    run_step(aggs, [torch.zeros(0) for _ in range(n)])
    header = 4 * stats_header_words(n)
    assert sent == [header] * n
    assert MODEL.collectives(strategy, TensorStats(0, 1, n, (0,) * n, 0))[0] == ("allreduce", header)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_payload_numel_is_the_size_of_the_next_first_payload(strategy):
    """payload_numel (what an adapter sizes a message's slot with, before encoding) is the numel of the
    payload the next encode returns, for every strategy, on statistics and plain steps alike (THC's and
    top-k's from their second step, once their aggregator is built)."""
    n, rows, dim = 2, 300, 4
    rng = torch.Generator().manual_seed(4)
    aggs = [AutoAggregator("w", (rows, dim), torch.float32, n, r, MODEL, lossy=True, lossy_min_bytes=0,
                           first=strategy, allowed=(strategy,), interval=3) for r in range(n)]
    sent = {}
    for a in aggs:
        def recorded(x, a=a, encode=a.encode):
            payload, ctx = encode(x)
            sent[a.rank] = payload.numel()
            return payload, ctx
        a.encode = recorded
    for step in range(6):
        expected = [a.payload_numel() for a in aggs] if step or strategy not in ("thc", "topk") else None
        xs = [sparse_rows(rng, rows, dim, 20) for _ in range(n)]
        run_step(aggs, xs)
        if expected is not None:
            assert [sent[a.rank] for a in aggs] == expected, step


@pytest.mark.parametrize("average", [False, True])
def test_row_counts_past_the_low_count_field_reach_every_rank_exactly(average):
    """A rank's row count goes as two header fields, its low COUNT_FIELD_BITS bits and the rest: counts of
    2^21 rows and more (here 2^21 + 5 and 2^21 + 2 non-zero coordinates) are read back exactly, summed or
    averaged."""
    n, numel = 2, (1 << 21) + 5
    aggs = [AutoAggregator("w", (numel,), torch.float32, n, r, MODEL, allowed=("dense",)) for r in range(n)]
    xs = [torch.ones(numel), torch.ones(numel)]
    xs[1][:3] = 0.0
    run_step(aggs, xs, average)
    assert all(a.tracker.rank_keys == [numel, numel - 3] for a in aggs)


def test_a_dense_statistics_step_missing_a_rank_is_refused_where_the_engine_s_op_is_unknown():
    """Only an engine whose op is known (Horovod's plugin sets engine_averages) may have ranks that left by
    hvd.join(), which a dense plan tolerates; without it, a SUM of fewer ranks than the world is a
    configuration error, not a dense sum of the ranks that happened to send."""
    n = 3
    rng = torch.Generator().manual_seed(6)
    aggs = [AutoAggregator("w", (64, 8), torch.float32, n, r, MODEL, allowed=("dense",)) for r in range(n)]
    xs = [sparse_rows(rng, 64, 8, 5) for _ in range(n)]
    enc = [a.encode(x) for a, x in zip(aggs, xs)]
    summed = enc[0][0] + enc[1][0]   # rank 2's payload missing
    with pytest.raises(ConfigurationMismatch, match="2 contributors, expected 3"):
        aggs[0].decode(summed, enc[0][1])


def test_a_plan_due_before_the_calibration_is_applied_by_current_plan():
    """current_plan applies a plan that waited for the cost model (the first step's, with no calibration
    then): once the model is set, it reports the planned strategy and the statistics it was planned on
    before any further encode, as the adapters read it to settle a message's plans."""
    n = 2
    aggs = [AutoAggregator("emb", (4000, 16), torch.float32, n, r, None, interval=4, topk_ratio=0.01, thc_bits=4)
            for r in range(n)]
    rng = torch.Generator().manual_seed(7)
    run_step(aggs, [sparse_rows(rng, 4000, 16, 20) for _ in range(n)])
    with pytest.raises(RuntimeError, match="not calibrated"):   # no model yet: the due plan cannot be made
        aggs[0].current_plan()
    for a in aggs:
        a.cost_model = MODEL
    strategy, planned_on = aggs[0].current_plan()
    assert strategy != "dense" and strategy == aggs[0].strategy and planned_on is not None
    assert planned_on.rank_keys == (20, 20) and aggs[0].plans == 1


def test_the_default_interval_puts_a_dense_plan_s_statistics_on_step_counts_1_16_32():
    """``interval`` defaults to 16 (docs/DESIGN.md: "with the default interval of 16, 15 steps in 16 of a
    dense plan cost exactly DDP's allreduce"): the statistics ride on the first step and on the step counts
    that are multiples of 16."""
    n = 2
    aggs = [AutoAggregator("w", (4,), torch.float32, n, r, MODEL) for r in range(n)]
    carried = []
    for step in range(1, 34):
        carried.append(aggs[0].carries_statistics())
        run_step(aggs, [torch.ones(4) for _ in range(n)])
    assert [s for s, c in zip(range(1, 34), carried) if c] == [1, 16, 32]


@pytest.mark.parametrize("given", [{"topk_ratio": 0.01}, {"thc_bits": 4}, {}])
def test_an_aggregator_built_before_the_calibration_needs_both_lossy_parameters(given):
    """Without a cost model, topk_ratio and thc_bits both come from the caller (a top-k or THC plan made
    once the calibration arrives builds its aggregator from them): one of them alone is a ValueError at
    construction, not an error at that plan."""
    with pytest.raises(ValueError, match="give topk_ratio and thc_bits"):
        AutoAggregator("w", (64,), torch.float32, 2, 0, None, **given)


@pytest.mark.parametrize("rows", [1, 50, 100, 101, 1000])
def test_a_first_sketch_is_sized_for_one_percent_of_the_rows_per_rank_at_least_one(rows):
    """A sketch planned before any statistics (first="sketch") is sized for FIRST_SKETCH_DENSITY (1%) of the
    rows per rank, rounded up, at least one row and at most all of them, and a union of n times that (at most
    every row): its first payload is the header and the LHC payload so sized."""
    from lossless_hc.lhc.codec import LosslessCodec
    from lossless_hc.training.plan_stats import sketch_capacity
    n = 2
    agg = AutoAggregator("w", (rows, 8), torch.float32, n, 0, MODEL, first="sketch", allowed=("sketch",))
    assert strategies.FIRST_SKETCH_DENSITY == 0.01
    per_rank = min(agg.keys, max(1, -(-agg.keys // 100)))
    cap, union = sketch_capacity(TensorStats(agg.numel, agg.row, n, (per_rank,) * n, min(agg.keys, n * per_rank)))
    codec = LosslessCodec(agg.numel, n, cap, agg.row, 0, union_nnz=union)
    assert agg.payload_numel() == stats_header_words(n) + codec.payload_numel


def test_a_replan_revising_a_later_plan_s_change_back_drops_that_change_alone():
    """The history's last entry is this step's change (an earlier entry is another step's): a re-plan of
    step 2 that revises its change (top-k -> topk_allgather) back to top-k leaves step 1's entry alone."""
    n = 2
    model = MODEL
    rng = torch.Generator().manual_seed(7)
    aggs = [AutoAggregator("w", (1 << 15,), torch.float32, n, r, model, lossy=True, interval=2,
                           allowed=("dense", "topk", "topk_allgather")) for r in range(n)]
    for a in aggs:
        a.cost_model = _Choosing(model, "topk")
    run_step(aggs, [torch.randn(1 << 15, generator=rng) for _ in range(n)])
    for a in aggs:
        a.cost_model = _Choosing(model, "topk_allgather")
    run_step(aggs, [torch.randn(1 << 15, generator=rng) for _ in range(n)])   # count 2: a statistics step
    assert [a.history for a in aggs] == [[(1, "topk"), (2, "topk_allgather")]] * n
    for a in aggs:
        a.cost_model = _Choosing(model, "topk")
        a.replan()
    assert [(a.strategy, a.history) for a in aggs] == [("topk", [(1, "topk")])] * n


@pytest.mark.parametrize("strategy", ["allgather", "topk_allgather"])
def test_finish_writes_into_out_only_for_a_float32_gradient(strategy):
    """finish's ``out`` (a float32 buffer a dense gradient's allgather sum may be written into) is ignored for
    a gradient of another dtype: its value is a new tensor and ``out`` keeps what it held."""
    n, numel = 2, 1 << 12
    aggs = [AutoAggregator("w", (numel,), torch.bfloat16, n, r, MODEL, lossy=True, lossy_min_bytes=0,
                           first=strategy, allowed=(strategy,)) for r in range(n)]
    rng = torch.Generator().manual_seed(8)
    xs = [torch.zeros(numel, dtype=torch.bfloat16) for _ in range(n)]
    for x in xs:
        x[torch.randperm(numel, generator=rng)[:20]] = 1.0
    encoded = [a.encode(x) for a, x in zip(aggs, xs)]
    summed = torch.stack([p for p, _ in encoded]).sum(0)
    requests = [a.decode(summed.clone(), ctx).request.tensor for a, (_, ctx) in zip(aggs, encoded)]
    out = torch.full((numel,), 7.0)
    value = aggs[0].finish(encoded[0][1], torch.stack(requests), out=out)
    assert torch.equal(out, torch.full((numel,), 7.0)) and value.data_ptr() != out.data_ptr()
    assert torch.equal(value.float(), (xs[0].float() + xs[1].float()))


@pytest.mark.parametrize("strategy", ["allgather", "two_phase"])
def test_a_single_row_is_gathered_or_reduced_not_taken_for_none(strategy):
    """The smallest non-empty step (one row on one rank; then one row on every rank, the same row) still
    makes the strategy's second collective, and its value is the sum."""
    n = 2
    aggs = [AutoAggregator("w", (64, 8), torch.float32, n, r, MODEL, first=strategy, allowed=(strategy,))
            for r in range(n)]
    for ranks in ((0,), (0, 1)):
        xs = [torch.zeros(64, 8) for _ in range(n)]
        for r in ranks:
            xs[r][5] = torch.arange(8.0) + r
        for y in run_step(aggs, xs):
            assert torch.equal(y, xs[0] + xs[1]), ranks
