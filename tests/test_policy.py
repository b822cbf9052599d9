"""CapacityPolicy / DensityTracker: decisions only every `interval` steps, hysteresis, growth and
shrinking, identical decisions for identical observations, payload shapes that always match."""
import math

import numpy as np
import pytest
import torch

from lossless_hc.training.aggregate import TensorAggregator
from lossless_hc.training.topk_aggregate import TopKAggregator
from lossless_hc.training.capacity import CapacityPolicy
from lossless_hc.training.checkpoint import aggregator_state_dict, load_aggregator_state_dict


def test_decisions_only_at_interval_steps():
    tr = CapacityPolicy(interval=4).tracker()
    due = [tr.observe(10, 5.0) for _ in range(12)]
    assert due == [False, False, False, True] * 3


def test_warmup_and_validation():
    tr = CapacityPolicy(interval=2, warmup=5).tracker()
    assert [tr.observe(1, 1.0) for _ in range(8)] == [False, False, False, False, False, True, False, True]
    for bad in (dict(interval=0), dict(alpha=0.0), dict(alpha=1.5), dict(union_headroom=0.5), dict(hysteresis=1.0),
                dict(rank_headroom=float("nan")), dict(union_headroom=float("inf")), dict(warmup=-1),
                # bools were numbers (True: a headroom of 1, alpha 1.0); a string raised from inside a comparison
                dict(alpha=True), dict(union_headroom=True), dict(rank_headroom="2"), dict(hysteresis=False)):
        with pytest.raises(ValueError, match=f"{next(iter(bad))} must be"):   # the option's own check
            CapacityPolicy(**bad)
    for bad in (dict(interval=2.5), dict(interval=True), dict(warmup=1.5)):   # were truncated silently
        with pytest.raises(TypeError, match=f"{next(iter(bad))} must be an int"):
            CapacityPolicy(**bad)
    assert CapacityPolicy(warmup=0).warmup == 0 and CapacityPolicy(interval=4).warmup == 4
    assert CapacityPolicy(union_headroom=np.float32(2.0), hysteresis=np.float64(0.5)).union_headroom == 2.0


def test_ewma_peaks_and_hysteresis():
    p = CapacityPolicy(interval=4, alpha=0.5, union_headroom=1.25, rank_headroom=1.5, hysteresis=0.25)
    tr = p.tracker()
    for u, k in [(100, 40), (100, 40), (200, 80), (100, 40)]:
        tr.observe(u, k)
    rank, union = tr.propose()
    assert union == 250 and rank == 120          # the peak of the interval wins over the EWMA
    assert tr.peak_union == 0 and tr.peak_rank == 0.0
    assert tr.accept(100, 101) and not tr.accept(100, 80) and tr.accept(100, 74)
    assert not tr.accept(100, 100) and not tr.accept(100, 75)   # the band's edges stay inside it
    for u, k in [(100, 40)] * 4:   # the next interval: no peak above the EWMAs, which now decide
        tr.observe(u, k)
    # union 100, 100, 150, 125 then 112.5, 106.25, 103.125, 101.5625; per rank 40, 40, 60, 50 then 45 ... 40.625
    assert tr.propose() == (math.ceil(1.5 * 40.625), math.ceil(1.25 * 101.5625))


def make(policy, numel=20_000, n=4, density=0.05, name="t"):
    return TensorAggregator(name, (numel,), torch.float32, n, density, seed=3, policy=policy)


def run_steps(agg, n, steps, per_rank, seed=0):
    """``steps`` exact steps of ``n`` ranks holding ``per_rank`` random non-zeros each (an int, or one
    count per rank); the payload sizes, step by step."""
    counts = [per_rank] * n if isinstance(per_rank, int) else list(per_rank)
    g = torch.Generator().manual_seed(seed)
    shapes = []
    for s in range(steps):
        xs = []
        for k in counts:
            x = torch.zeros(agg.numel)
            x[torch.randperm(agg.numel, generator=g)[:k]] = torch.randn(k, generator=g)
            xs.append(x)
        encoded = [agg.encode(x) for x in xs]            # one aggregator stands in for every rank's replica
        payload = sum(p for p, _ in encoded)
        out = agg.decode(payload, encoded[0][1])
        dense = sum(xs)
        if out.needs_fallback:   # the engine's dense SUM of what the ranks encoded: that sum, unscaled
            assert torch.equal(agg.finish_fallback(dense.clone(), out), dense)
        else:
            assert torch.allclose(out.value, dense, atol=1e-5)
        shapes.append(encoded[0][0].numel())
    return shapes


def test_capacity_shrinks_to_the_observed_density_and_stays_exact():
    agg = make(CapacityPolicy(interval=4))
    start = agg.codec.wire_bytes
    shapes = run_steps(agg, 4, 16, per_rank=50)
    assert agg.tracker.changes >= 1
    assert agg.stats.fallbacks == 0   # shrunk to what the steps hold, every step still decoded by the codec
    assert agg.capacity < 1000 and agg.codec.wire_bytes < start / 4
    # shapes change only at decision steps (after steps 4, 8, ...), never in between
    for i in range(1, len(shapes)):
        if shapes[i] != shapes[i - 1]:
            assert i % 4 == 0, shapes


def test_capacity_grows_when_density_rises():
    agg = make(CapacityPolicy(interval=4), density=0.002)
    run_steps(agg, 4, 8, per_rank=30)
    small = agg.capacity
    run_steps(agg, 4, 12, per_rank=300, seed=1)
    assert agg.capacity > small
    assert agg.stats.fallbacks >= 1 or agg.tracker.changes >= 2


def test_replicas_take_identical_decisions():
    """Two replicas fed the same aggregates (as every rank is) keep identical layouts at every step."""
    a, b = make(CapacityPolicy(interval=3)), make(CapacityPolicy(interval=3))
    g = torch.Generator().manual_seed(5)
    for step in range(15):
        per_rank = 20 + 40 * (step // 5)
        xs = [torch.zeros(20_000) for _ in range(4)]
        for x in xs:
            x[torch.randperm(20_000, generator=g)[:per_rank]] = 1.0
        outs = []
        for agg in (a, b):
            enc = [agg.encode(x) for x in xs]
            outs.append((agg.decode(sum(p for p, _ in enc), enc[0][1]), enc))
        for agg, (out, enc) in zip((a, b), outs):
            if out.needs_fallback:
                agg.finish_fallback(sum(xs), out)
        assert (a.capacity, a.union_capacity) == (b.capacity, b.union_capacity)
        assert (a.codec.layout if a.codec else None) == (b.codec.layout if b.codec else None)
    assert a.tracker.history == b.tracker.history and a.tracker.changes >= 1


def test_a_tensor_keeps_its_last_decisions_and_counts_them_all():
    """A resize (DensityTracker) or re-plan (AutoAggregator) history grew by one entry per decision for the
    whole run, and went whole into every stats() and checkpoint (374 entries after 6000 steps of a tensor
    whose density alternated): the last HISTORY_KEEP are kept, every one counted."""
    from lossless_hc.training.capacity import HISTORY_KEEP, append_recent
    tracker = CapacityPolicy().tracker()
    for i in range(3 * HISTORY_KEEP):
        tracker.steps = i
        tracker.record_rebuild(10 + i, 20 + i, "bitmap")
    assert tracker.changes == 3 * HISTORY_KEEP and len(tracker.history) == HISTORY_KEEP
    assert tracker.history[0] == (2 * HISTORY_KEEP, 10 + 2 * HISTORY_KEEP, 20 + 2 * HISTORY_KEEP, "bitmap")
    history = []
    for i in range(HISTORY_KEEP + 5):
        append_recent(history, (i, "dense"))
    assert history == [(i, "dense") for i in range(5, HISTORY_KEEP + 5)]
    # a checkpoint keeps the count (one from before it, which has none, counts its history)
    agg = TensorAggregator("t", (1000,), torch.float32, 2, 0.01, policy=CapacityPolicy())
    agg.tracker.history, agg.tracker.rebuilds = list(tracker.history), tracker.rebuilds
    state = aggregator_state_dict(agg)
    again = TensorAggregator("t", (1000,), torch.float32, 2, 0.01, policy=CapacityPolicy())
    load_aggregator_state_dict(again, state)
    assert again.tracker.changes == 3 * HISTORY_KEEP and again.tracker.history == tracker.history
    del state["tracker"]["rebuilds"]
    load_aggregator_state_dict(again, state)
    assert again.tracker.changes == HISTORY_KEEP


def test_topk_keeps_capacity_k_and_adapts_the_union():
    """One TopKAggregator per rank (each keeps its own residual), all decoding the same aggregate."""
    n = 8
    aggs = [TopKAggregator("w", (50_000,), torch.float32, n, 0.01, policy=CapacityPolicy(interval=2))
            for _ in range(n)]
    k = aggs[0].k
    g = torch.Generator().manual_seed(0)
    base = torch.randn(50_000, generator=g)
    for step in range(6):   # ranks' gradients are similar: their top-k overlap heavily
        xs = [base + 0.01 * torch.randn(50_000, generator=g) for _ in range(n)]
        enc = [a.encode(x) for a, x in zip(aggs, xs)]
        payload = sum(p for p, _ in enc)
        outs = [a.decode(payload, e[1]) for a, e in zip(aggs, enc)]
        for a, out in zip(aggs, outs):
            if out.needs_fallback:
                a.finish_fallback(sum(e[1].dense_value for e in enc), out)
            else:
                assert torch.allclose(out.value, sum(e[1].dense_value for e in enc), atol=1e-4)
    assert len({(a.capacity, a.union_capacity, a.codec.layout) for a in aggs}) == 1
    assert aggs[0].capacity >= k
    # the aggregate holds at least one rank's keys: the union the codec is sized for is never below the capacity
    assert aggs[0].union_capacity is not None and aggs[0].capacity <= aggs[0].union_capacity < n * k


def test_topk_capacity_stays_k_while_the_gradients_are_sparser_than_k():
    """Every rank may send k non-zeros at any step, so the policy never sizes a top-k codec below k, even
    after steps whose gradients held fewer non-zeros than k: the first dense step after them decodes
    without a fallback."""
    n, numel = 2, 20_000
    aggs = [TopKAggregator("w", (numel,), torch.float32, n, 0.01, policy=CapacityPolicy(interval=2))
            for _ in range(n)]
    k = aggs[0].k
    g = torch.Generator().manual_seed(1)
    for step in range(7):
        xs = [torch.zeros(numel) for _ in range(n)]
        for x in xs:   # 10 non-zeros per rank while k is 200, then dense
            x[torch.randperm(numel, generator=g)[:10] if step < 6 else slice(None)] = 1.0
        enc = [a.encode(x) for a, x in zip(aggs, xs)]
        payload = sum(p for p, _ in enc)
        outs = [a.decode(payload.clone(), e[1]) for a, e in zip(aggs, enc)]
        assert not any(o.needs_fallback for o in outs), step
        assert all(a.capacity >= k for a in aggs), step


def test_dense_tensor_can_become_compressed():
    """A tensor sent dense (codec not smaller) is observed too: when it turns sparse it compresses."""
    agg = make(CapacityPolicy(interval=2), numel=4000, density=0.9)
    assert not agg.compressed
    for _ in range(4):
        x = torch.zeros(4000)
        x[:10] = 1.0
        payload, ctx = agg.encode(x)
        agg.decode(payload * 4, ctx)
    assert agg.compressed


@pytest.mark.parametrize("block", [1, 3, 32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_the_observed_support_counts_every_key_holding_a_non_zero(block, dtype):
    """What a dense-sent tensor's aggregate shows the tracker: keys (the last one partial) holding a value
    other than +-0.0, NaN and infinities included, as torch's element-wise tests count them."""
    numel = 100_003
    agg = TensorAggregator("t", (numel,), dtype, 4, 0.01, block_size=block, policy=CapacityPolicy())
    gen = torch.Generator().manual_seed(block)
    x = torch.zeros(numel, dtype=dtype)
    x[torch.randperm(numel, generator=gen)[:700]] = torch.randn(700, generator=gen).to(dtype)
    x[:4] = torch.tensor([-0.0, float("nan"), float("-inf"), 0.0]).to(dtype)
    x[numel - 1] = 1.0                                   # the partial last key (numel is not a multiple of 3, 32)
    pad = (-numel) % block
    want = int((torch.cat([x, x.new_zeros(pad)]).reshape(-1, block) != 0).any(dim=1).sum())
    assert agg._key_support(x) == want
    assert agg._key_support(x.reshape(-1, 1)) == want   # any shape


def test_a_rank_holding_more_keys_than_the_others_overloads_once_not_at_every_decision():
    """Rank 0 holds 4x the keys of the other three (its data's share of the rows). The aggregate gives
    only the mean count (1,750), so each decision proposed 1.5 x the mean (2,625 keys) and rank 0
    overloaded at the next step, fell back densely and grew again: a fallback every interval. The
    overloads now teach the tracker the skew, and after the first steps' two growths every step
    decodes, exactly, through 12 decisions."""
    agg = make(CapacityPolicy(interval=4), numel=100_000, density=0.01)
    run_steps(agg, 4, 2, per_rank=(4000, 1000, 1000, 1000))
    assert agg.stats.fallbacks == 2   # the first two steps: capacity 1,000, then 2,188
    run_steps(agg, 4, 46, per_rank=(4000, 1000, 1000, 1000), seed=1)
    assert agg.stats.fallbacks == 2
    assert agg.capacity >= 4000 and agg.tracker.skew > 1.6


def test_overloads_on_every_rank_alike_leave_the_skew_at_one():
    """An overload at capacity C with mean m raises the skew to 2 C / (h_K m) (the proposal then keeps
    the 2 C the growth gave); a density above the guess on every rank (m above C) leaves it at 1."""
    tr = CapacityPolicy(rank_headroom=1.5).tracker()
    tr.observe_overload(1000, 5000.0)
    assert tr.skew == 1.0
    tr.observe_overload(2625, 1750.0)
    assert tr.skew == 2.0
    tr.observe_overload(1000, 1750.0)   # never falls
    assert tr.skew == 2.0
    tr.observe(8000, 1750.0)
    assert tr.propose()[0] == 5250


def test_a_checkpoint_carries_the_learnt_skew():
    """The skew is part of the tracker's state (a resumed run would otherwise overload again); a
    checkpoint written before the skew existed restores none learnt (1)."""
    from lossless_hc.training.checkpoint import aggregator_state_dict, load_aggregator_state_dict
    agg = make(CapacityPolicy(interval=4))
    agg.tracker.observe_overload(2625, 1750.0)
    state = aggregator_state_dict(agg)
    fresh = make(CapacityPolicy(interval=4))
    load_aggregator_state_dict(fresh, state)
    assert fresh.tracker.skew == 2.0
    del state["tracker"]["skew"]
    load_aggregator_state_dict(fresh, state)
    assert fresh.tracker.skew == 1.0


def test_default_policy_is_the_documented_one_and_the_closed_ends_of_its_ranges_are_accepted():
    """CapacityPolicy()'s defaults are its docstring's (interval 16, alpha 0.25, union headroom 1.25, rank headroom
    1.5, hysteresis 0.25, warmup = interval); the closed ends of the option ranges are accepted: an interval of 1,
    headrooms of exactly 1 (no margin), hysteresis 0 (shrink at any drop), alpha 1 (the newest step only)."""
    p = CapacityPolicy()
    assert (p.interval, p.alpha, p.union_headroom, p.rank_headroom, p.hysteresis, p.warmup) == (16, 0.25, 1.25, 1.5,
                                                                                                0.25, 16)
    edge = CapacityPolicy(interval=1, alpha=1.0, union_headroom=1.0, rank_headroom=1.0, hysteresis=0.0)
    assert (edge.interval, edge.alpha, edge.union_headroom, edge.rank_headroom, edge.hysteresis) == (1, 1.0, 1.0, 1.0,
                                                                                                     0.0)
    tr = edge.tracker()
    assert tr.observe(100, 40.0) and tr.propose() == (40, 100)
    assert tr.accept(100, 99) and not tr.accept(100, 100)


def test_a_negative_hysteresis_is_refused_as_its_documented_range_says():
    """hysteresis is a number in [0, 1) (CapacityPolicy's doc): a negative one would put the shrink band above
    the current capacity (accept() would take any proposal below 1.25x it, a rebuild at nearly every
    decision), so it is refused like 1.0 is, however slightly below 0."""
    for bad in (-0.25, -1e-9):
        with pytest.raises(ValueError, match=r"hysteresis must be a number in \[0, 1\)"):
            CapacityPolicy(hysteresis=bad)


def test_overloads_raise_the_skew_by_the_documented_rule():
    """observe_overload(C, m) raises the skew to max(s, 2 C / (h_K m)) and never lowers it; a mean of 0 keys
    changes nothing (no division by it). The per-rank proposal is ceil(h_K s max(EWMA, peak)), and neither
    proposal goes below 1 key."""
    tr = CapacityPolicy(interval=1, rank_headroom=1.5, union_headroom=1.25).tracker()
    tr.observe_overload(60, 0.0)
    assert tr.skew == 1.0
    tr.observe_overload(60, 20.0)          # 2 * 60 / (1.5 * 20)
    assert tr.skew == 4.0
    tr.observe_overload(30, 20.0)          # 2.0: below the skew already reached
    assert tr.skew == 4.0
    assert tr.observe(100, 20.0)
    assert tr.propose() == (math.ceil(1.5 * 4.0 * 20.0), math.ceil(1.25 * 100))
    empty = CapacityPolicy(interval=1).tracker()
    assert empty.observe(0, 0.0) and empty.propose() == (1, 1)
    sparse = CapacityPolicy(rank_headroom=1.5).tracker()
    sparse.observe_overload(3, 0.5)        # a mean below one key (one key among two ranks) counts as well
    assert sparse.skew == 8.0
