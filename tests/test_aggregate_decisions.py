"""TensorAggregator's per-tensor decisions (lossless_hc.training.aggregate), in one process, at their edges:
block sizes, capacities rounded to blocks, when the codec is used, and what a decode changes."""
import pytest
import torch

from lossless_hc.training.aggregate import TensorAggregator, default_block_size


def test_a_matrix_without_columns_hashes_keys_of_one_coordinate():
    """A 2-D tensor's keys are its rows only where a row has coordinates: a (rows, 0) gradient gets blocks
    of 1 (a block of 0 coordinates would divide by zero), and its aggregator sends it dense as it is."""
    assert default_block_size((5, 0)) == 1
    assert default_block_size((0, 3)) == 3
    agg = TensorAggregator("t", (5, 0), torch.float32, 2, 0.5)
    assert agg.block_size == 1 and not agg.compressed
    x = torch.zeros(5, 0)
    payload, ctx = agg.encode(x)
    assert payload is x and agg.decode(payload, ctx).value is x


def test_an_aggregator_built_with_its_defaults_decodes_with_one_from_the_default_lossless_spec():
    """The constructor's default seed is Compression.lossless()'s (0): a rank that builds its aggregator
    directly and one that builds it from the spec hash alike, so their summed payloads decode exactly
    (different seeds are a ConfigurationMismatch)."""
    from lossless_hc.training.adapter import LosslessSpec
    from lossless_hc.training.aggregate import AggregationStats
    spec_built = LosslessSpec(max_density=0.05).make("t", torch.zeros(1000, 16), 2, 0, AggregationStats(), "cpu")
    direct = TensorAggregator("t", (1000, 16), torch.float32, 2, 0.05)
    assert spec_built.seed == direct.seed == 0
    xs = [torch.zeros(1000, 16), torch.zeros(1000, 16)]
    xs[0][[3, 500]] = 1.5
    xs[1][[3, 999]] = 2.0
    encoded = [a.encode(x) for a, x in zip((spec_built, direct), xs)]
    total = encoded[0][0] + encoded[1][0]
    for a, (_, ctx) in zip((spec_built, direct), encoded):
        out = a.decode(total.clone(), ctx)
        assert out.report.ok and torch.equal(out.value, xs[0] + xs[1])


def step(agg, per_rank, seed, shared=False):
    """One step of one aggregator standing in for every replica: rank r holds ``per_rank[r]`` keys of
    value 1 + r (the same keys on every rank where ``shared``, else disjoint ones); the ranks' inputs and
    the decode of their payloads' sum."""
    numel = agg.numel
    perm = torch.randperm(numel, generator=torch.Generator().manual_seed(seed))
    xs, start = [], 0
    for r, k in enumerate(per_rank):
        x = torch.zeros(numel)
        x[perm[:k] if shared else perm[start:start + k]] = 1.0 + r
        start += k
        xs.append(x)
    encoded = [agg.encode(x) for x in xs]
    return xs, agg.decode(sum(p for p, _ in encoded), encoded[0][1])


def decide(n, max_density, per_rank, shared, numel=20_000):
    """Two exact steps of ``n`` ranks holding ``per_rank`` keys each (the same keys on every rank, or
    disjoint ones) under a policy deciding at the second step; the aggregator and the codec it started
    with."""
    from lossless_hc.training.capacity import CapacityPolicy
    agg = TensorAggregator("t", (numel,), torch.float32, n, max_density, seed=3, policy=CapacityPolicy(interval=2))
    first = agg.codec
    for s in range(2):
        xs, out = step(agg, (per_rank,) * n, s, shared)
        assert not out.needs_fallback and torch.equal(out.value, sum(xs))
    return agg, first


def test_a_decision_inside_the_hysteresis_band_keeps_the_codec():
    """Capacity 1,000 per rank and (no union capacity yet) 4 x 1,000 for the union: 666 disjoint keys per
    rank propose 1.5 x 666 = 999 per rank (not below 0.75 x 1,000) and 1.25 x 2,664 = 3,330 for the union
    (inside [3,000, 4,000]): nothing leaves the band, so nothing is rebuilt or recorded."""
    agg, first = decide(4, 0.05, 666, shared=False)
    assert (agg.capacity, agg.union_capacity) == (1000, None)
    assert agg.codec is first and agg.tracker.history == [] and agg.tracker.changes == 0


def test_a_decision_that_only_shrinks_the_union_rebuilds_and_records_the_new_index_kind():
    """The same 666 keys on every rank: the per-rank proposal (999) stays inside its band, the union's
    (1.25 x 666 = 833) falls below 0.75 x 4,000, which alone is enough to rebuild: capacity 999, union
    max(999, 833), and the rebuild is recorded with the new codec's index kind."""
    agg, first = decide(4, 0.05, 666, shared=True)
    assert (agg.capacity, agg.union_capacity) == (999, 999)
    assert agg.compressed and agg.codec is not first and agg.codec.layout != first.layout
    assert agg.tracker.history == [(2, 999, 999, agg.codec.index_kind)] and agg.codec.index_kind != "dense"


def test_a_decision_whose_codec_would_not_be_smaller_sends_the_tensor_dense_and_records_it():
    """8 ranks of 600 disjoint keys: capacity 1.5 x 600 = 900, union 1.25 x 4,800 = 6,000 of 20,000
    coordinates, for which the codec would not be smaller than the dense tensor: the tensor goes dense, and
    the rebuild is recorded as 'dense'."""
    agg, first = decide(8, 0.03, 600, shared=False)
    assert first is not None and not agg.compressed
    assert (agg.capacity, agg.union_capacity) == (900, 6000)
    assert agg.tracker.history == [(2, 900, 6000, "dense")]


def test_the_observed_support_counts_keys_at_a_zero_partial_last_key_a_short_tensor_and_integers():
    """What a policy observes of a dense aggregate: keys of block_size coordinates holding a non-zero, the last
    key partial and counted only where it holds one, a tensor shorter than one block as one partial key, and
    integer gradients (dense, still observed; the backends' row scan reads only floats) counted alike."""
    from lossless_hc.training.capacity import CapacityPolicy
    for dtype in (torch.float32, torch.bfloat16, torch.float64, torch.int32, torch.int64, torch.int16):
        x = torch.tensor([0, 5, 6, 0, 0, 0, -1, 0, 0, 7], dtype=dtype)
        zero_tail = x.clone()
        zero_tail[9] = 0
        for block, want, want_zero_tail in ((1, 4, 3), (3, 3, 2), (4, 3, 2), (5, 2, 2), (10, 1, 1)):
            agg = TensorAggregator("t", (10,), dtype, 2, 0.1, block_size=block, policy=CapacityPolicy())
            assert agg._key_support(x) == want, (dtype, block)
            assert agg._key_support(zero_tail) == want_zero_tail, (dtype, block)
            assert agg._key_support(torch.zeros(10, dtype=dtype)) == 0
        short = TensorAggregator("t", (2,), dtype, 2, 0.5, block_size=3, policy=CapacityPolicy())
        assert short._key_support(torch.zeros(2, dtype=dtype)) == 0
        assert short._key_support(torch.tensor([0, 1], dtype=dtype)) == 1
        if not dtype.is_floating_point:   # sent dense, and observed at its decode
            payload, ctx = agg.encode(x)
            assert not agg.compressed and agg.decode(2 * payload, ctx).value is not None and agg.tracker.steps == 1


def test_a_rank_just_over_capacity_doubles_it_and_teaches_a_policy_the_skew_in_keys():
    """c <- max(2c, ceil(1.25 K / n) b): two ranks of 60 rows over a capacity of 50 rows (800 coordinates)
    give K = 120 keys, whose share ceil(1.25 x 120 / 2) = 75 rows is below 2c = 100 rows, so the capacity
    doubles (the other term is tests/test_aggregate.py's overload test). A policy learns the skew from
    the capacity in keys (rows), not coordinates: 2 x 50 / (1.5 x 60)."""
    from lossless_hc.training.capacity import CapacityPolicy
    n = 2
    for policy in (None, CapacityPolicy()):
        aggs = [TensorAggregator("t", (1000, 16), torch.float32, n, 0.05, policy=policy) for _ in range(n)]
        assert aggs[0].capacity == 800
        xs = [torch.zeros(1000, 16) for _ in range(n)]
        for r, x in enumerate(xs):
            x[r * 60:(r + 1) * 60] = 1.0 + r
        encoded = [a.encode(x) for a, x in zip(aggs, xs)]
        total = encoded[0][0] + encoded[1][0]
        for a, (_, ctx) in zip(aggs, encoded):
            out = a.decode(total.clone(), ctx)
            assert out.needs_fallback and out.report.overloaded_ranks and out.report.total_keys == 120
            assert a.capacity == 1600 and a.union_capacity is None and a.stats.capacity_growths == 1
            if policy is not None:
                assert a.tracker.skew == 2.0 * 50 / (1.5 * 60.0)


def test_an_overload_grows_a_learnt_union_capacity_by_its_largest_term():
    """With a union capacity U (a policy's decision), a failure grows it to max(2U, c, ceil(1.25 K) b):
    after a decision to c = 600, U = 2,000 (4 ranks of 400 disjoint keys), one rank of 700 keys overloads
    (K = 700): U doubles to 4,000; four ranks of 1,000 keys (K = 4,000): 1.25 K = 5,000 wins
    (and c = max(2 x 600, ceil(1.25 K / 4)) = 1,250)."""
    from lossless_hc.training.capacity import CapacityPolicy
    n, numel = 4, 20_000
    for overload, want in (((700, 0, 0, 0), (1200, 4000)), ((1000,) * 4, (1250, 5000))):
        agg = TensorAggregator("t", (numel,), torch.float32, n, 0.05, seed=3, policy=CapacityPolicy(interval=2))
        for seed in range(2):
            assert not step(agg, (400,) * n, seed)[1].needs_fallback
        assert (agg.capacity, agg.union_capacity) == (600, 2000)
        out = step(agg, overload, 2)[1]
        assert out.needs_fallback and out.report.overloaded_ranks and out.report.total_keys == sum(overload)
        assert (agg.capacity, agg.union_capacity) == want


def test_a_tensor_sent_dense_decodes_to_what_the_engine_returned_never_marked_averaged():
    """A tensor sent as it is: its outcome is the engine's result itself (its sum or its average), with no
    report or partial keys, and averaged False whatever the engine did (only a codec payload is scaled)."""
    agg = TensorAggregator("t", (100,), torch.float64, 2, 0.05)
    agg.engine_averages = True
    x = torch.arange(100, dtype=torch.float64)
    payload, ctx = agg.encode(x)
    assert not ctx.compressed
    averaged = (payload + payload) / 2
    out = agg.decode(averaged, ctx)
    assert out.value is averaged and not out.averaged and out.report is None and not out.needs_partial


def test_partial_max_fraction_defaults_to_half_and_takes_every_fraction_from_zero_to_one():
    """The default is PARTIAL_MAX_FRACTION, one half of the tensor; 0 and 1 (the whole tensor) are allowed
    bounds."""
    from lossless_hc.training.aggregate import PARTIAL_MAX_FRACTION
    assert TensorAggregator("t", (100,), torch.float32, 2, 0.1).partial_max_fraction == PARTIAL_MAX_FRACTION == 0.5
    for fraction in (0, 0.0, 0.25, 1, 1.0):
        agg = TensorAggregator("t", (100,), torch.float32, 2, 0.1, partial_max_fraction=fraction)
        assert agg.partial_max_fraction == fraction and isinstance(agg.partial_max_fraction, float)


def test_a_policy_observes_a_fallback_s_dense_sum():
    """A failed decode's step still counts for the policy: finish_fallback feeds it the dense sum's keys
    (two ranks' 60 disjoint rows: 120) and the header's mean per rank (120 / 2), exactly once."""
    from lossless_hc.training.capacity import CapacityPolicy
    n = 2
    agg = TensorAggregator("t", (1000, 16), torch.float32, n, 0.05, policy=CapacityPolicy())
    xs = [torch.zeros(1000, 16) for _ in range(n)]
    for r, x in enumerate(xs):
        x[r * 60:(r + 1) * 60] = 1.0 + r
    encoded = [agg.encode(x) for x in xs]
    out = agg.decode(encoded[0][0] + encoded[1][0], encoded[0][1])
    assert out.needs_fallback and agg.tracker.steps == 0
    summed = xs[0] + xs[1]
    assert torch.equal(agg.finish_fallback(summed.clone(), out), summed)
    assert (agg.tracker.steps, agg.tracker.union, agg.tracker.per_rank) == (1, 120.0, 60.0)


def test_a_shape_whose_sizes_are_not_ints_is_refused_where_the_aggregator_is_built():
    """Fractional sizes, float sizes and bools would give a wrong numel (2.5 coordinates, True as 1): a
    TypeError at construction, for TensorAggregator and the row form alike; negative sizes a ValueError."""
    from lossless_hc.training.rows import TensorRows
    for bad in ((2.5,), (4, 2.0), (True, 3)):
        with pytest.raises(TypeError, match="each dimension of shape must be an int"):
            TensorAggregator("t", bad, torch.float32, 2, 0.1)
        with pytest.raises(TypeError, match="each dimension of shape must be an int"):
            TensorRows("t", bad, torch.float32, 2, 0, sparse=False)
    with pytest.raises(ValueError, match="sizes >= 0"):
        TensorAggregator("t", (4, -1), torch.float32, 2, 0.1)
    assert TensorAggregator("t", torch.Size([4, 0]), torch.float32, 2, 0.1).shape == (4, 0)


def test_the_engine_s_known_op_decides_averaging_over_the_payload_s_contributor_word():
    """payload_is_averaged answers a bool: False for one rank (a sum and an average are the same), the
    engine's op where its plugin says it (whatever the contributor word reads), else the word (n after a
    SUM, 1 after an AVERAGE)."""
    from lossless_hc.training.aggregate import payload_is_averaged
    agg = TensorAggregator("t", (1000, 16), torch.float32, 4, max_density=0.05)
    x = torch.zeros(1000, 16)
    x[7] = 1.0
    p, _ = agg.encode(x)
    summed, averaged = 4 * p, p.clone()
    assert payload_is_averaged(p, 1) is False and payload_is_averaged(p, 1, True) is False
    for payload in (summed, averaged):
        assert payload_is_averaged(payload, 4, True) is True
        assert payload_is_averaged(payload, 4, False) is False
    assert payload_is_averaged(summed, 4) is False and payload_is_averaged(averaged, 4) is True
