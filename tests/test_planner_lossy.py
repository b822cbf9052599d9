"""The planner's lossy strategies (fp16, bf16, top-k, top-k allgathered, THC), run as
tests/test_planner.py runs the exact ones: close to the dense sum and only with ``lossy``, half precision's
plain steps as the engines' own hooks send them, top-k's re-sums and shared error feedback, and error
feedback flushed when a plan leaves a lossy strategy."""
import math

import pytest
import torch

from lossless_hc.lhc import contract
from lossless_hc.lhc.codec import DEFAULT_RTOL
from lossless_hc.training.auto import AutoSpec
from lossless_hc.training.plan_stats import stats_header_words
from lossless_hc.training.planner import EXACT_STRATEGIES, LOSSY_MIN_BYTES, LOSSY_STRATEGIES, STRATEGIES, Calibration, CostModel
from lossless_hc.training.strategies import AutoAggregator
from test_planner import on_each_payload, record_sent, run_step
from test_planner_cost import MODEL, stats


@pytest.mark.parametrize("strategy", ["fp16", "bf16", "topk", "thc", "topk_allgather"])
def test_lossy_strategies_are_close_and_only_with_lossy(strategy):
    """Only with lossy=True; every rank decodes the same bits; fp16/bf16 within their rounding (per
    coordinate and in norm); topk equal (within the codec's contract) to the top-k of each rank's
    x + residual, step by step, and topk_allgather equal to it bit for bit (the selections added in rank
    order); topk, topk_allgather and thc lose nothing: what the running sums miss is exactly what their
    error feedback still holds."""
    n, numel = 2, 4096
    rng = torch.Generator().manual_seed(3)
    assert AutoAggregator("w", (numel,), torch.float32, n, 0, MODEL, first=strategy).strategy == "dense"
    aggs = [AutoAggregator("w", (numel,), torch.float32, n, r, MODEL, lossy=True, lossy_min_bytes=0, first=strategy,
                           allowed=(strategy,)) for r in range(n)]
    total_in = torch.zeros(numel, dtype=torch.float64)
    total_out = torch.zeros(numel, dtype=torch.float64)
    mass = torch.zeros(numel, dtype=torch.float64)
    k = math.ceil(MODEL.topk_ratio * numel)
    residuals = [torch.zeros(numel) for _ in range(n)]   # topk: the error feedback, recomputed here
    for step in range(6):
        xs = [torch.randn(numel, generator=rng) for _ in range(n)]
        total_in += sum(x.double() for x in xs)
        mass += sum(x.double().abs() for x in xs)
        ys = run_step(aggs, xs)
        assert aggs[0].strategy == strategy
        assert all(torch.equal(ys[0], y) for y in ys)   # every rank decodes the same bits
        total_out += ys[0].double()
        if strategy in ("topk", "topk_allgather"):   # each rank sends the k largest |x + residual|
            sent = []
            for r in range(n):
                a = xs[r] + residuals[r]
                idx = a.abs().topk(k).indices
                sent.append(torch.zeros(numel).index_copy_(0, idx, a[idx]))
                residuals[r] = a.index_fill_(0, idx, 0.0)
            if strategy == "topk_allgather":   # the gathered pairs, summed in rank order
                assert torch.equal(ys[0], sent[0] + sent[1]), f"step {step}"
                continue
            s, m = contract.truth(sent)
            bad = contract.outside_contract(ys[0], s, m, n, DEFAULT_RTOL)
            assert not bool(bad.any()), f"step {step}: {int(bad.sum())} coordinates are not the top-k sum"
    if strategy == "topk_allgather":   # a rank sends, each step, the header and its k slots of (index, value)
        per_step = stats_header_words(n) * 4 + k * 2 * 4
        assert all(a.bytes_sent == a.stats.payload_bytes == 6 * per_step for a in aggs)
    rel = float((total_out - total_in).norm() / total_in.norm())
    if strategy in ("fp16", "bf16"):
        # Each step rounds every rank's value and their sum once: |error| <= u (2 + u) * sum |x| per
        # coordinate (fp16 subnormals add 2**-25 per rounding, n times that: fp16 sums x / n, then
        # multiplies by n). Measured: at most 0.90 u * mass, and rel 0.64 u (fp16 3.1e-4, bf16 2.5e-3);
        # 2 u would not pass bf16 off as fp16 (u = 2**-11, 2**-8).
        u = 2.0 ** -11 if strategy == "fp16" else 2.0 ** -8
        err = (total_out - total_in).abs()
        assert bool((err <= u * (2 + u) * mass + 6 * 3 * n * 2.0 ** -25).all()), float((err / mass).max())
        assert rel < 2 * u, rel
    else:
        # Error feedback: what the sums miss is what the ranks still hold (measured to 5e-8 for topk, 1.3e-7
        # for thc, relative: float32 roundings), and it is a bounded share: measured rel 0.87 for topk
        # (1% sent per rank and step), 0.059 for thc.
        held = sum(a.take_lossy_memory().double() for a in aggs)
        lost = float((total_in - total_out - held).norm() / total_in.norm())
        assert lost < 1e-6, lost
        assert rel < (0.2 if strategy == "thc" else 0.95), rel


@pytest.mark.parametrize("strategy,averages", [("fp16", None), ("fp16", False), ("fp16", True), ("bf16", None)])
def test_a_half_precision_plan_s_plain_steps_send_the_tensor_in_half_precision_as_the_engines_hooks_do(
        strategy, averages):
    """Between its statistics steps (its first, then one in ``interval``) an fp16 or bf16 plan sends the
    tensor alone in half precision, one collective, no scan: fp16 ``x / n`` (DDP's fp16_compress_hook) or,
    where the engine is known to average, ``x`` (Horovod's fp16 compression: no second division in
    float16); bf16 ``x``. The value is the engine's scale (SUM, or the average where it averages), the
    bytes those the cost model prices (``collectives``). Before, every step carried the statistics
    header, then allreduced the half tensor in a second round trip, and scanned the tensor twice."""
    n, shape, interval = 3, (500, 8), 4
    half = torch.float16 if strategy == "fp16" else torch.bfloat16
    g = torch.Generator().manual_seed(1)
    aggs = [AutoAggregator("w", shape, torch.float32, n, r, MODEL, lossy=True, first=strategy, allowed=(strategy,),
                           lossy_min_bytes=0, interval=interval) for r in range(n)]
    for a in aggs:
        a.engine_averages = averages
    average = averages is True
    carried = []
    for _ in range(2 * interval):
        carries = aggs[0].carries_statistics()
        assert all(a.carries_statistics() == carries for a in aggs)
        carried.append(carries)
        xs = [torch.randn(shape, generator=g) for _ in range(n)]
        before = aggs[0].stats.payload_bytes
        enc = [a.encode(x) for a, x in zip(aggs, xs)]
        assert aggs[0].strategy == strategy
        if not carries:
            assert all(p.dtype == half and p.numel() == xs[0].numel() for p, _ in enc)
            summed = torch.stack([p.to(torch.float64) for p, _ in enc]).sum(0)
            summed = (summed / n if average else summed).to(half)
            outs = [a.decode(summed, ctx) for a, (_, ctx) in zip(aggs, enc)]
            assert all(o.request is None for o in outs)
            payloads = [x.to(half) if strategy == "bf16" or average else x.to(half).div_(n) for x in xs]
            want = torch.stack([p.to(torch.float64) for p in payloads]).sum(0)
            want = (want / n if average else want).to(half).to(torch.float32)
            if strategy == "fp16" and not average:
                want = want * n
            for o in outs:
                assert torch.equal(o.value, want.reshape(shape))
            assert aggs[0].stats.payload_bytes - before == 2 * xs[0].numel()
            assert MODEL.collectives(strategy, aggs[0].plan_input) == [("allreduce_half", 2 * xs[0].numel())]
        else:   # a statistics step: the header, then the half tensor in a second collective
            summed = torch.stack([p.to(torch.float64) for p, _ in enc]).sum(0)
            summed = (summed / n if average else summed).to(enc[0][0].dtype)
            outs = [a.decode(summed, ctx) for a, (_, ctx) in zip(aggs, enc)]
            req = torch.stack([o.request.tensor.to(torch.float64) for o in outs]).sum(0)
            for a, o, (_, ctx) in zip(aggs, outs, enc):
                a.finish(ctx, req.to(o.request.tensor.dtype))
    assert carried == [True, False, False, True, False, False, False, True]


def test_topk_re_sums_the_keys_its_decode_reports_inexact():
    """auto's top-k aggregates each rank's selection with the lossless codec. Small values sharing sketch
    cells with 2**30 (tests/mp/inexact_case.py) decode inexact: their coordinates are summed again,
    exactly (as Compression.topk does). auto returned the decoded values as they were (1-5 coordinates
    wrong per step, e.g. 16 for -8) while the residual counted them as delivered. Now every step gives
    the sum of the ranks' selections (the first k of a stable sort of |x + residual|) within the
    codec's contract."""
    import os
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "mp"))
    import inexact_case
    n, numel = 2, inexact_case.VEC
    aggs = [AutoAggregator("w", (numel,), torch.float32, n, r, MODEL, lossy=True, lossy_min_bytes=0,
                           first="topk", allowed=("topk",), topk_ratio=0.01) for r in range(n)]
    k = math.ceil(0.01 * numel)
    residuals = [torch.zeros(numel) for _ in range(n)]
    for step in range(inexact_case.STEPS):
        xs = [inexact_case.gradients(step, r)[1] for r in range(n)]
        ys = run_step(aggs, xs)
        assert all(torch.equal(ys[0], y) for y in ys)
        sent = []
        for r in range(n):
            a = xs[r] + residuals[r]
            idx = torch.argsort(a.abs(), descending=True, stable=True)[:k]
            sent.append(torch.zeros(numel).index_copy_(0, idx, a[idx]))
            residuals[r] = a.index_fill_(0, idx, 0.0)
        s, m = contract.truth(sent)
        bad = contract.outside_contract(ys[0], s, m, n, DEFAULT_RTOL)
        assert not bool(bad.any()), f"step {step}: {ys[0][bad][:3].tolist()} for {s[bad][:3].tolist()}"
    assert aggs[0].stats.partial_fallbacks >= 1 and aggs[0].stats.inexact_keys >= 1, aggs[0].stats
    # each decode that reported inexact keys re-summed them (a partial re-aggregation), once
    assert aggs[0].stats.inexact_decodes == aggs[0].stats.partial_fallbacks, aggs[0].stats


def test_the_two_top_k_strategies_share_one_error_feedback_memory():
    """topk and topk_allgather select from the same x + residual: a plan that moves between them (and at last
    to dense, which sends what is left) loses nothing. The running sum of the results plus what the ranks
    still hold equals the sum of every gradient at every step, to float rounding."""
    n, numel = 3, 4096
    rng = torch.Generator().manual_seed(5)
    aggs = [AutoAggregator("w", (numel,), torch.float32, n, r, MODEL, lossy=True, lossy_min_bytes=0,
                           first="topk_allgather", allowed=("topk", "topk_allgather", "dense")) for r in range(n)]
    total_in = torch.zeros(numel, dtype=torch.float64)
    total_out = torch.zeros(numel, dtype=torch.float64)
    for step, strategy in enumerate(["topk_allgather", "topk_allgather", "topk", "topk", "topk_allgather", "dense"]):
        for a in aggs:   # the plan, the same on every rank (set here, not by the cost model)
            a.strategy = strategy
        xs = [torch.randn(numel, generator=rng) for _ in range(n)]
        total_in += sum(x.double() for x in xs)
        ys = run_step(aggs, xs)
        assert all(torch.equal(ys[0], y) for y in ys)
        total_out += ys[0].double()
        held = [a.topk_aggregator().residual if a._topk is not None else None for a in aggs]
        if strategy == "dense":   # leaving the top-k strategies flushed the memory into this step
            assert held == [None] * n
        else:
            assert all(h is not None for h in held)
        memory = sum(h.double() for h in held if h is not None) if held[0] is not None else 0
        lost = float((total_in - total_out - memory).abs().max())
        assert lost < 1e-5, (step, strategy, lost)


def test_top_k_allgathered_drops_its_memory_after_a_non_finite_step():
    """A rank's infinite coordinate (an AMP scaler's overflow step) is selected first and comes back infinite
    in the sum, as a dense allreduce would carry it; every rank then drops its memory (the others' hold values
    at the scale that overflowed), as TopKAggregator does, and the next step is finite."""
    n, numel = 2, 4096
    aggs = [AutoAggregator("w", (numel,), torch.float32, n, r, MODEL, lossy=True, lossy_min_bytes=0,
                           first="topk_allgather", allowed=("topk_allgather",)) for r in range(n)]
    rng = torch.Generator().manual_seed(6)
    run_step(aggs, [torch.randn(numel, generator=rng) for _ in range(n)])
    assert all(a.topk_aggregator().residual is not None for a in aggs)
    xs = [torch.randn(numel, generator=rng) for _ in range(n)]
    xs[1][7] = float("inf")
    ys = run_step(aggs, xs)
    assert math.isinf(float(ys[0][7])) and int(torch.isinf(ys[0]).sum()) == 1
    assert all(a.topk_aggregator().residual is None for a in aggs)
    ys = run_step(aggs, [torch.randn(numel, generator=rng) for _ in range(n)])
    assert bool(torch.isfinite(ys[0]).all())


def test_a_top_k_plan_falls_back_densely_on_a_non_finite_step_and_counts_the_fallback():
    """Under a topk plan, a rank's infinite coordinate makes the selections' sum non-finite: the decode
    falls back, on every rank, to the dense allreduce of the selections (the sum keeps the Inf where a dense
    allreduce would, every other coordinate the selections' plain sum), counted once in ``fallbacks`` and the
    stats; the residual is dropped and the next step is finite again."""
    n, numel = 2, 4096
    aggs = [AutoAggregator("w", (numel,), torch.float32, n, r, MODEL, lossy=True, lossy_min_bytes=0,
                           first="topk", allowed=("topk",)) for r in range(n)]
    rng = torch.Generator().manual_seed(6)
    xs = [torch.randn(numel, generator=rng) for _ in range(n)]
    xs[1][7] = float("inf")
    k = aggs[0].topk_aggregator().k
    selected = []   # the first step: no residual yet, so each rank selects the k largest |g| (ties: lower index)
    for x in xs:
        idx = torch.argsort(x.abs(), descending=True, stable=True)[:k]
        selected.append(torch.zeros(numel).index_copy_(0, idx, x[idx]))
    finite = torch.arange(numel) != 7
    for y in run_step(aggs, xs):
        assert math.isinf(float(y[7])) and int(torch.isinf(y).sum()) == 1
        assert torch.equal(y[finite], (selected[0] + selected[1])[finite])
    assert [(a.fallbacks, a.stats.fallbacks, a.plan_stats()["fallbacks"]) for a in aggs] == [(1, 1, 1)] * n
    assert all(a.topk_aggregator().residual is None for a in aggs)
    ys = run_step(aggs, [torch.randn(numel, generator=rng) for _ in range(n)])
    assert bool(torch.isfinite(ys[0]).all()) and aggs[0].fallbacks == 1


@pytest.mark.parametrize("average", [False, True])
def test_fp16_sums_beyond_its_range_come_back_finite(average):
    """fp16 sends x / n (as DDP's fp16_compress_hook divides before the SUM): three ranks' ~40000 sum to 120003,
    beyond float16's 65504, and come back as that sum (the average where the engine averaged the first
    payload), within fp16's roundings (the bound of the test above)."""
    n, numel = 3, 4096
    aggs = [AutoAggregator("w", (numel,), torch.float32, n, r, MODEL, lossy=True, lossy_min_bytes=0, first="fp16",
                           allowed=("fp16",)) for r in range(n)]
    xs = [torch.full((numel,), 40000.0 + r) for r in range(n)]
    want = sum(x.double() for x in xs) / (n if average else 1)
    u = 2.0 ** -11
    for _ in range(2):
        ys = run_step(aggs, xs, average=average)
        assert aggs[0].strategy == "fp16"
        assert all(torch.equal(ys[0], y) for y in ys)
        err = (ys[0].double() - want).abs()   # inf where the sum overflowed
        assert bool((err <= u * (2 + u) * want.abs()).all()), float(err.max())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fp16_is_not_a_candidate_for_a_half_precision_gradient(dtype):
    """fp16 took a bfloat16 gradient out of its range (on Horovod, whose bfloat16 plain steps travel in
    float32, the planner chose it by itself: averages of 3e5 came back inf, 1e-9 came back 0) and rounded a
    float16 one twice (x / n, then n times the sum). Neither is a candidate; asked for alone, the tensor
    is sent dense, exactly. bf16 stays one for both (bfloat16 holds float16's range)."""
    n, numel = 2, 1 << 15
    slow = CostModel(Calibration.default(bandwidth_bits=1e8))   # a slow link: half the bytes wins
    free = AutoAggregator("w", (numel,), dtype, n, 0, slow, lossy=True, lossy_min_bytes=0,
                          allowed=("dense", "fp16", "bf16"))
    assert "fp16" not in free.allowed and "bf16" in free.allowed
    aggs = [AutoAggregator("w", (numel,), dtype, n, r, slow, lossy=True, lossy_min_bytes=0, first="fp16",
                           allowed=("fp16",)) for r in range(n)]
    big = 3e5 if dtype == torch.bfloat16 else 3e4   # beyond float16's range / its sum near 65504
    xs = [torch.tensor([big, -1e-9, 1.5] * (numel // 3) + [0.0] * (numel % 3)).to(dtype) for _ in range(n)]
    assert bool(xs[0].isfinite().all())
    for _ in range(3):
        ys = run_step(aggs, xs)
        assert aggs[0].strategy == "dense"
        assert torch.equal(ys[0], xs[0].double().mul(n).to(dtype)), ys[0][:3]


def test_small_tensors_stay_exact_under_lossy():
    """Below lossy_min_bytes (64 KiB) a tensor is planned among the exact strategies only, even with
    lossy=True and a link slow enough that the cost model would prefer a lossy one; at the threshold the
    lossy ones are candidates again; lossy_min_bytes=0 allows them for every tensor."""
    slow = CostModel(Calibration.default(bandwidth_bits=1e7))
    small = LOSSY_MIN_BYTES // 4 - 1   # float32 coordinates: one short of the threshold
    agg = AutoAggregator("w", (small,), torch.float32, 4, 0, slow, lossy=True)
    assert set(agg.allowed) == set(EXACT_STRATEGIES)
    assert set(AutoAggregator("w", (small + 1,), torch.float32, 4, 0, slow, lossy=True).allowed) == set(STRATEGIES)
    assert set(AutoAggregator("w", (small,), torch.float32, 4, 0, slow, lossy=True, lossy_min_bytes=0).allowed) \
        == set(STRATEGIES)
    assert slow.choose(stats(small, 1, 4, small, small), lossy=True)[0] in LOSSY_STRATEGIES   # what the rule overrides
    with pytest.raises(ValueError, match="lossy_min_bytes"):
        AutoSpec(lossy=True, lossy_min_bytes=-1)


@pytest.mark.parametrize("lossy", ["topk", "thc"])
def test_leaving_a_lossy_strategy_sends_what_its_error_feedback_kept(lossy):
    """Error feedback holds back part of each gradient; when the plan leaves top-k or THC for an exact
    strategy, the next step sends it, so everything sent adds up to everything computed."""
    n, numel = 2, 2048
    rng = torch.Generator().manual_seed(4)
    slow = CostModel(Calibration.default(bandwidth_bits=1e6))   # a slow link: the lossy payload wins
    aggs = [AutoAggregator("w", (numel,), torch.float32, n, r, slow, lossy=True, lossy_min_bytes=0, first=lossy, interval=1000,
                           allowed=("dense", lossy)) for r in range(n)]
    total_in = torch.zeros(numel, dtype=torch.float64)
    total_out = torch.zeros(numel, dtype=torch.float64)
    for step in range(4):
        if step == 3:
            assert all(a.strategy == lossy for a in aggs)
            for a in aggs:
                a.strategy = "dense"   # what a re-plan does
        xs = [torch.randn(numel, generator=rng) for _ in range(n)]
        total_in += sum(x.double() for x in xs)
        total_out += run_step(aggs, xs)[0].double()
    assert torch.allclose(total_out, total_in, rtol=0, atol=1e-4)
    assert all(a._topk is None and a._thc is None for a in aggs)


def test_taking_the_lossy_memory_takes_what_thc_and_top_k_both_hold():
    """take_lossy_memory() hands back everything error feedback holds, THC's memory and top-k's residual
    together where both were built (a caller aggregating the tensor by other means adds it, so nothing is
    lost), and leaves neither behind."""
    numel = 4096
    agg = AutoAggregator("w", (numel,), torch.float32, 2, 0, MODEL, lossy=True, lossy_min_bytes=0,
                         allowed=("dense", "thc", "topk"))
    g = torch.Generator().manual_seed(8)
    x, y = torch.randn(numel, generator=g), torch.randn(numel, generator=g)
    agg.thc_aggregator().encode(x)                 # THC's first step agrees on a norm: all of x stays owed
    agg.topk_aggregator().select_indices(y)        # top-k (allgathered) keeps what it did not select
    thc_held, topk_held = agg.thc_aggregator().pending_error(), agg.topk_aggregator().residual
    assert torch.equal(thc_held, x) and 0 < int(torch.count_nonzero(topk_held)) < numel
    assert torch.equal(agg.take_lossy_memory(), x + topk_held)
    assert agg._thc is None and agg._topk is None and agg.take_lossy_memory() is None


def test_top_k_is_priced_at_the_sketch_of_its_selections_it_sends():
    """topk's wire bytes (module doc): ``allreduce(H + 4 L)``, ``L`` the LHC layout of ``numel`` coordinates
    (rows of 1) sized for ``k = ceil(r d)`` per rank and ``min(n k, d)`` in the union; and that is the size of
    the payload a top-k plan's step sends (float32 words), at every world size tried."""
    from lossless_hc.lhc.cost_model import plan_layout
    from lossless_hc.training.plan_stats import stats_header_words
    rows, dim = 300, 64
    numel = rows * dim
    for n in (2, 3):
        k = math.ceil(MODEL.topk_ratio * numel)
        s = stats(numel, dim, n, 20, 20 * n)
        header = 4 * stats_header_words(n)
        layout = plan_layout(numel, n, k, 1, 0, union_nnz=min(numel, n * k))
        # then the request of its inexact keys, priced before the plan ran at 1% of the n k selections
        request = 4 * math.ceil(0.01 * n * k)
        assert MODEL.collectives("topk", s) == [("allreduce", header + 4 * layout.payload_numel), ("allreduce", request)]
        aggs = [AutoAggregator("w", (rows, dim), torch.float32, n, r, MODEL, lossy=True, lossy_min_bytes=0,
                               first="topk", allowed=("topk",), interval=1) for r in range(n)]
        sent = record_sent(aggs)
        rng = torch.Generator().manual_seed(n)
        for _ in range(2):   # the first step builds top-k's aggregator; the second sends its payload
            sent.clear()
            run_step(aggs, [torch.randn(rows, dim, generator=rng) for _ in range(n)])
        first = MODEL.collectives("topk", s)[0][1]
        assert sent == [first] * n, (sent, first)


@pytest.mark.parametrize("strategy,dtype,divisor", [("bf16", torch.bfloat16, None), ("fp16", torch.float16, 4),
                                                    ("fp16", torch.float16, None), ("bf16", torch.float32, None)])
def test_half_payload_is_a_new_tensor_even_of_a_gradient_already_in_its_dtype(strategy, dtype, divisor):
    """strategies.half_payload returns a new tensor: the engine sums it in place and fp16 divides it, so the
    gradient it was made from (here already in the half dtype, where a cast alone would alias it) keeps its
    values."""
    from lossless_hc.training.strategies import half_payload
    x = torch.arange(8, dtype=torch.float32).to(dtype)
    kept = x.clone()
    payload = half_payload(x, strategy, divisor)
    expected = kept.to(payload.dtype) / (divisor or 1)
    assert payload.data_ptr() != x.data_ptr() and torch.equal(payload, expected)
    payload.add_(1)   # what an engine's in-place SUM does to it
    assert torch.equal(x, kept)


def test_an_fp16_plain_step_s_decode_leaves_the_summed_tensor_it_is_given_as_it_was():
    """A plain fp16 step's sum, handed to decode in float32 (a message part wider than the payload), is read,
    not written: the value is n times it (the SUM of x / n), a new tensor, and the summed tensor keeps its
    values."""
    n = 4
    agg = AutoAggregator("w", (8,), torch.float32, n, 0, MODEL, lossy=True, lossy_min_bytes=0, first="fp16",
                         allowed=("fp16",), interval=4)
    agg.steps = 1   # past the first step: a plain one
    payload, ctx = agg.encode_plain(torch.arange(8, dtype=torch.float32), "fp16")
    assert ctx.plain and payload.dtype == torch.float16
    summed = (payload.float() * n).contiguous()   # every rank sent the same x / n
    kept = summed.clone()
    value = agg.decode(summed, ctx).value
    assert torch.equal(summed, kept) and torch.equal(value, kept * n)


@pytest.mark.parametrize("strategy", ["thc", "topk"])
def test_a_lossy_plan_s_header_carries_zero_counts_between_its_statistics_steps(strategy):
    """THC and top-k carry the statistics header on every step, but its counts are statistics only on the
    dense plans' statistics steps (the first, step counts that are multiples of ``interval``); between them
    every rank's count fields hold zeros (docs/DESIGN.md, "What is exchanged when"), the contributor word 1."""
    from lossless_hc.training.plan_stats import stats_header_words
    n, numel = 2, 1 << 12
    aggs = [AutoAggregator("w", (numel,), torch.float32, n, r, MODEL, lossy=True, lossy_min_bytes=0,
                           first=strategy, allowed=(strategy,), interval=4) for r in range(n)]
    rng = torch.Generator().manual_seed(9)
    H = stats_header_words(n)
    headers = []
    on_each_payload(aggs, lambda r, payload: headers.append((r, payload[:H].clone())))
    for step in range(1, 6):
        run_step(aggs, [torch.randn(numel, generator=rng) for _ in range(n)])
        for r, header in headers[-n:]:
            counts = header[1:].reshape(n, 2)
            assert float(header[0]) == 1.0
            if step in (1, 4):
                assert float(counts[r, 0]) == numel and float(counts[1 - r].abs().sum()) == 0, step
            else:
                assert float(counts.abs().sum()) == 0, step


def row_sparse_grads(n, rows, dim, touched, rng):
    out = []
    for _ in range(n):
        x = torch.zeros(rows, dim)
        x[torch.randperm(rows, generator=rng)[:touched]] = torch.randn(touched, dim, generator=rng)
        out.append(x)
    return out


def test_a_step_that_flushes_error_memory_is_sent_but_not_counted_as_statistics():
    """Leaving top-k allgathered flushes its residual, which holds rows of every earlier step, into the next
    gradient: sent with it (nothing lost), but its counts are not the tensor's statistics
    (PlanTracker.skip): observed, they would read as a spike of many times the rows a step touches, which
    the per-rank peak keeps until the next decision and prices allgather by. The step after is observed."""
    n, rows, dim, touched = 2, 1000, 8, 20
    rng = torch.Generator().manual_seed(9)
    aggs = [AutoAggregator("w", (rows, dim), torch.float32, n, r, MODEL, lossy=True, lossy_min_bytes=0,
                           topk_ratio=0.002, first="topk_allgather", allowed=("allgather", "topk_allgather"),
                           interval=1000) for r in range(n)]
    total_in = torch.zeros(rows * dim, dtype=torch.float64)
    total_out = torch.zeros(rows * dim, dtype=torch.float64)

    def step():
        nonlocal total_in, total_out
        xs = row_sparse_grads(n, rows, dim, touched, rng)
        total_in += sum(x.double().reshape(-1) for x in xs)
        total_out += run_step(aggs, xs)[0].double().reshape(-1)
    for _ in range(6):
        step()
    held = aggs[0].topk_aggregator().residual.reshape(rows, dim)
    assert int((held != 0).any(1).sum()) > 3 * touched   # the residual's rows: many steps'
    before = (list(aggs[0].tracker.rank_keys), aggs[0].tracker.union, aggs[0].tracker.peak_rank)
    for a in aggs:
        a.strategy = "allgather"   # what a re-plan does
    step()   # the flush
    assert all(a._topk is None for a in aggs)
    assert (list(aggs[0].tracker.rank_keys), aggs[0].tracker.union, aggs[0].tracker.peak_rank) == before
    assert torch.allclose(total_out, total_in, rtol=0, atol=1e-4)   # the memory was sent
    step()   # observed again: the rows of one step
    assert aggs[0].tracker.peak_rank == touched and max(aggs[0].tracker.rank_keys) <= touched


def test_memory_an_engine_adapter_adds_is_not_counted_and_a_plain_step_clears_the_mark():
    """carry_memory() (the DDP step guard's PowerSGD trial memory added to a bucket after its verdict): the
    next encoded step's counts are skipped, the one after is observed; a plain step (the engine's own
    allreduce) in between clears the mark, so it does not fall on a later statistics step."""
    n, rows, dim, touched = 2, 500, 4, 10
    rng = torch.Generator().manual_seed(10)
    aggs = [AutoAggregator("w", (rows, dim), torch.float32, n, r, MODEL, first="allgather", allowed=("allgather",))
            for r in range(n)]
    run_step(aggs, row_sparse_grads(n, rows, dim, touched, rng))
    before = list(aggs[0].tracker.rank_keys)
    for a in aggs:
        a.carry_memory()
    run_step(aggs, row_sparse_grads(n, rows, dim, 200, rng))   # 200 rows: the memory's
    assert list(aggs[0].tracker.rank_keys) == before and aggs[0].tracker.peak_rank <= touched
    run_step(aggs, row_sparse_grads(n, rows, dim, 200, rng))
    assert aggs[0].tracker.peak_rank == 200
    dense = AutoAggregator("d", (rows, dim), torch.float32, n, 0, MODEL, first="dense", allowed=("dense",))
    dense.carry_memory()
    dense.record_plain_step(0.0)
    assert dense._carried_memory is False


def test_a_plain_step_through_encode_clears_the_mark_too():
    """carry_memory() before a step that goes plain through encode (a dense plan between its statistics steps,
    as a message or Horovod sends it): that step has no counts to skip, and the mark does not fall on the next
    statistics step, which is observed (step counts 0 and 3 carry the statistics at interval 4)."""
    n, rows, dim = 2, 500, 4
    rng = torch.Generator().manual_seed(11)
    aggs = [AutoAggregator("w", (rows, dim), torch.float32, n, r, MODEL, first="dense", allowed=("dense", "allgather"),
                           interval=4) for r in range(n)]
    run_step(aggs, row_sparse_grads(n, rows, dim, rows, rng))
    assert max(aggs[0].tracker.rank_keys) == rows
    for a in aggs:
        a.carry_memory()
    for _ in range(2):
        assert all(a.plain_step() == "dense" for a in aggs)
        run_step(aggs, row_sparse_grads(n, rows, dim, rows, rng))
    assert all(a.plain_step() is None for a in aggs) and aggs[0].plain_steps == 2
    run_step(aggs, row_sparse_grads(n, rows, dim, 30, rng))
    t = aggs[0].tracker
    w = 1 - (1 - t.alpha) ** 3   # the observation stands for the two plain steps too (PlanTracker.observe)
    assert t.steps == 2 and t.rank_keys == pytest.approx([(1 - w) * rows + w * 30] * n)


def test_leaving_thc_flushes_its_memory_uncounted_as_statistics():
    """Leaving THC, as leaving top-k: its error memory goes out with the next gradient, whose counts (the memory's
    rows among them) are not the tensor's statistics (though sent: the step's sum is the gradients' and the
    memories'); the step after is observed."""
    n, rows, dim, touched = 2, 500, 4, 10
    rng = torch.Generator().manual_seed(12)
    aggs = [AutoAggregator("w", (rows, dim), torch.float32, n, r, MODEL, lossy=True, lossy_min_bytes=0, first="thc",
                           allowed=("thc",), interval=1000) for r in range(n)]
    for _ in range(3):
        run_step(aggs, row_sparse_grads(n, rows, dim, touched, rng))
    assert aggs[0]._thc is not None and aggs[0]._thc.pending_error() is not None
    memory = sum(a._thc.pending_error().double().reshape(rows, dim) for a in aggs)
    before = (list(aggs[0].tracker.rank_keys), aggs[0].tracker.union, aggs[0].tracker.peak_rank)
    for a in aggs:
        a.strategy = "allgather"   # what a re-plan does
    xs = row_sparse_grads(n, rows, dim, touched, rng)
    out = run_step(aggs, xs)[0]   # the flush
    assert all(a._thc is None for a in aggs)
    assert torch.allclose(out.double(), sum(x.double() for x in xs) + memory, rtol=0, atol=1e-5)
    assert (list(aggs[0].tracker.rank_keys), aggs[0].tracker.union, aggs[0].tracker.peak_rank) == before
    steps = aggs[0].tracker.steps
    run_step(aggs, row_sparse_grads(n, rows, dim, touched, rng))
    assert aggs[0].tracker.steps == steps + 1 and aggs[0].tracker.peak_rank == touched


@pytest.mark.parametrize("strategy", ["fp16", "bf16"])
def test_a_half_precision_statistics_step_under_an_averaging_engine_returns_the_average(strategy):
    """Where the engine averages the first payload (the header says so), a half-precision plan's statistics
    step returns the average, in the engine's scale, though its request is a SUM: bf16's sum of the ranks'
    bfloat16 tensors divided by n; fp16's sum of x / n in float16 as it is."""
    n, numel = 2, 4096
    rng = torch.Generator().manual_seed(12)
    aggs = [AutoAggregator("w", (numel,), torch.float32, n, r, MODEL, lossy=True, lossy_min_bytes=0, first=strategy,
                           allowed=(strategy,)) for r in range(n)]
    xs = [torch.randn(numel, generator=rng) for _ in range(n)]
    ys = run_step(aggs, xs, average=True)
    half = torch.bfloat16 if strategy == "bf16" else torch.float16
    if strategy == "bf16":
        expected = sum(x.to(half).double() for x in xs).to(half).float() / n
    else:
        expected = sum((x / n).to(half).double() for x in xs).to(half).float()
    assert all(torch.equal(y, expected) for y in ys)


def test_top_k_allgathered_under_an_averaging_engine_returns_the_average_of_the_selections():
    """topk_allgather's gathered pairs are summed here (in rank order); where the engine averaged the first
    payload the value is that sum divided by n, in the engine's scale, as every other strategy's."""
    n, numel = 2, 4096
    rng = torch.Generator().manual_seed(13)
    aggs = [AutoAggregator("w", (numel,), torch.float32, n, r, MODEL, lossy=True, lossy_min_bytes=0,
                           first="topk_allgather", allowed=("topk_allgather",)) for r in range(n)]
    xs = [torch.randn(numel, generator=rng) for _ in range(n)]
    k = math.ceil(MODEL.topk_ratio * numel)
    sent = []
    for x in xs:   # the first step: no residual yet, the k largest |x|
        idx = x.abs().topk(k).indices
        sent.append(torch.zeros(numel).index_copy_(0, idx, x[idx]))
    ys = run_step(aggs, xs, average=True)
    assert all(torch.equal(y, (sent[0] + sent[1]) / n) for y in ys)
