"""Sizing: a value sketch of ``sketch_table_for(N)`` peels N keys with the failure probability the
layout promises (``PEEL_FAILURE_TARGET`` = 1e-3; we require >= 99% success and a failure count
consistent with the target), measured both on the hash family's hypergraph (reference peeling,
many trials batched as disjoint copies) and end to end through the C++ decoder."""
import math

import numpy as np
import pytest
import torch

import helpers
from lossless_hc import LosslessCodec, plan_layout
from lossless_hc.lhc import reference as reference
from lossless_hc.lhc.layout import INT_FIELD_LIMIT, digit_packing, stream_seed
from lossless_hc.lhc.sizing import PEEL_FAILURE_TARGET, build_layout, multilevel_plan, sketch_table_for

# keys -> trials. Failures are Binomial(trials, p) with p <= PEEL_FAILURE_TARGET if the sizing is right.
HYPERGRAPH_TRIALS = {10: 20000, 100: 5000, 1000: 2000, 10_000: 200, 100_000: 30}
CODEC_TRIALS = {10: 1500, 100: 600, 1000: 200, 10_000: 30, 100_000: 6}


def allowed_failures(trials: int) -> int:
    """A one-sided bound on Binomial(trials, target): mean + 5 sigma + 3 (exceeded with probability
    far below 1e-5 when the sizing meets its target)."""
    mean = trials * PEEL_FAILURE_TARGET
    return int(mean + 5 * math.sqrt(mean) + 3)


@pytest.mark.parametrize("keys", sorted(HYPERGRAPH_TRIALS))
def test_hypergraph_peels(keys):
    trials = HYPERGRAPH_TRIALS[keys]
    table = sketch_table_for(keys, stream_seed(keys, 0x5EED))
    C = table.cells
    assert C >= 1.2 * keys
    g = torch.Generator().manual_seed(keys)
    per_batch = max(1, 200_000 // keys)
    failures = done = stalled_pairs = 0
    while done < trials:
        b = min(per_batch, trials - done)
        # distinct random keys per trial (collisions among 62-bit draws are negligible and harmless:
        # a duplicate key would only make peeling harder)
        k = torch.randint(0, 2 ** 62, (b * keys,), generator=g)
        cells, weights = reference.key_cells(table, k)
        cells = cells + (torch.arange(b).repeat_interleave(keys) * C).unsqueeze(1)   # disjoint copies
        _, resolved = reference.peel_rounds(cells, b * C)
        pairs = reference.solvable_pairs(cells, weights, resolved)    # what the decoder solves after a stall
        stalled_pairs += int(pairs.shape[0])
        resolved[pairs.reshape(-1)] = True
        failures += int((~resolved.reshape(b, keys).all(dim=1)).sum())
        done += b
    assert trials - failures >= 0.99 * trials, f"{failures}/{trials} failed"
    assert failures <= allowed_failures(trials), f"{failures}/{trials} failed; target {PEEL_FAILURE_TARGET}"


@pytest.mark.parametrize("keys", sorted(CODEC_TRIALS))
def test_codec_decodes_at_capacity(keys):
    """One rank at exactly its capacity (union = N keys): the C++ decoder peels in >= 99% of trials."""
    trials = CODEC_TRIALS[keys]
    numel = max(20 * keys, 1000)
    codec = LosslessCodec(numel, 1, keys, index="bitmap", seed=keys)
    assert codec.layout.union_keys == keys and codec.layout.sketch.cells == sketch_table_for(keys).cells
    rng = np.random.default_rng(keys)
    failures = 0
    for t in range(trials):
        x = torch.zeros(numel)
        x[torch.from_numpy(rng.choice(numel, keys, replace=False))] = torch.from_numpy(
            helpers.values(rng, "normal", keys))
        y, rep = codec.decode(codec.encode(x), trace=t == 0)
        if helpers.peeled_ok(rep):   # peeling succeeded (INEXACT keys are the bound's, not the sizing's)
            inexact = torch.zeros_like(x, dtype=torch.bool)
            inexact[rep.inexact_keys] = True
            assert torch.equal((y != 0) | inexact, (x != 0) | inexact)
            if t == 0:  # the rigorous bound once per size (its Python loop is slow at 100k keys)
                helpers.assert_lossless(codec.layout, [x], y, rep)
            else:
                assert float((y - x).abs()[~inexact].max()) <= 1e-4
        else:
            assert "sketch peeling failed" in rep.reason, rep.reason
            failures += 1
    assert trials - failures >= 0.99 * trials, f"{failures}/{trials} failed"
    assert failures <= allowed_failures(trials)


@pytest.mark.parametrize("num_keys,union", [(20_000, 50), (20_000, 2000), (100_000, 500)])
def test_bloom_false_positives_stay_bounded(num_keys, union):
    """The Bloom index is sized so that E[false positives] <= max(U/4, 16); they all decode to exact
    zeros, and the decode is still exact: the true keys decode to the dense sum (under the contract)."""
    n = 5
    codec = LosslessCodec(num_keys, n, union // n, index="bloom", seed=1)
    assert codec.layout.union_keys == union
    rng = np.random.default_rng(union)
    fps = []
    for t in range(8):
        xs = helpers.make_inputs(rng, num_keys, 1, n, union // n, "disjoint", "normal")
        y, rep = codec.decode(helpers.sum_payloads([codec.encode(x) for x in xs], rng))
        assert helpers.peeled_ok(rep), rep.reason   # INEXACT keys are listed, not wrong (test_exactness)
        assert rep.support == union and rep.candidates == union + rep.false_positives
        truth = helpers.dense_sum64(xs)
        assert bool((y[truth == 0] == 0).all())
        # and the non-zeros are the dense sum's: exactly its support, and every coordinate outside the
        # reported inexact keys within the codec's rtol of it (the contract, as test_exactness checks it)
        assert torch.equal(y != 0, truth != 0)
        helpers.assert_contract(codec.layout, xs, y, rep.inexact_keys, codec.rtol)
        fps.append(rep.false_positives)
    assert np.mean(fps) <= 1.5 * max(union / 4, 16) + 4, fps


# (numel, world_size, max_nnz): small configurations where Bloom twins (a key whose three cells equal a
# true key's) dominate the failure rate unless the sizing accounts for them.
BLOOM_CONFIGS = [(1000, 3, 2), (5000, 4, 10)]


@pytest.mark.parametrize("numel,n,cap", BLOOM_CONFIGS)
def test_bloom_index_peels_at_target_rate(numel, n, cap):
    """Over 100 seeds (layouts) x 20 random supports at capacity, the exact Bloom count peeling fails
    no more often than PEEL_FAILURE_TARGET allows."""
    failures = trials = 0
    for seed in range(100):
        codec = LosslessCodec(numel, n, cap, seed=seed, index="bloom")
        rng = np.random.default_rng(seed)
        for _ in range(20):
            xs = helpers.make_inputs(rng, numel, 1, n, cap, "random", "normal")
            y, rep = codec.decode(helpers.sum_payloads([codec.encode(x) for x in xs], rng))
            trials += 1
            if not helpers.peeled_ok(rep):
                assert "peeling failed" in rep.reason, rep.reason
                failures += "index peeling" in rep.reason
    assert failures <= allowed_failures(trials), f"{failures}/{trials} Bloom index peeling failures"


def test_sketch_table_for_refuses_bad_arguments():
    with pytest.raises(TypeError, match="keys must be an int, got float"):
        sketch_table_for(1.5)
    with pytest.raises(TypeError, match="stream must be an int, got bool"):
        sketch_table_for(10, True)
    with pytest.raises(ValueError, match="keys must be >= 0"):
        sketch_table_for(-1)
    with pytest.raises(ValueError, match=r"stream must be an integer in \[0, 2\*\*64\)"):
        sketch_table_for(10, 1 << 64)
    assert sketch_table_for(10, (1 << 64) - 1).stream == (1 << 64) - 1


def test_value_sketches_past_two_group_sizes_split_into_groups():
    """A value sketch of up to 2 * GROUP_KEYS keys is one group (one decoding thread); one key more
    splits it into ceil(keys / GROUP_KEYS) groups, each sized for its Binomial share plus 4 standard
    deviations at 1.25 cells per key, which costs a few percent of cells."""
    from lossless_hc.lhc.sizing import GROUP_KEYS
    one = sketch_table_for(2 * GROUP_KEYS)
    split = sketch_table_for(2 * GROUP_KEYS + 1)
    assert one.seg_count == 3
    assert split.seg_count == 3 * math.ceil((2 * GROUP_KEYS + 1) / GROUP_KEYS)
    groups = split.seg_count // 3
    share = (2 * GROUP_KEYS + 1) / groups
    assert 3 * split.seg_len >= 1.25 * (share + 4 * math.sqrt(share))   # a group: its share and 4 sigmas
    assert 1.0 < split.cells / one.cells < 1.06


@pytest.mark.parametrize("max_aggregate", [1, 3, 15, 2047, 2048, 4095])
def test_digit_packing_is_as_dense_as_exactness_allows(max_aggregate):
    """per_word is the largest p with base**p <= 2**22 (a word's largest value base**p - 1 stays below
    2**22): a power-of-two base that divides 2**22 packs its last digit too (base 2: 22 digits)."""
    P = digit_packing(max_aggregate, 100)
    assert P.base == max_aggregate + 1
    assert P.base ** P.per_word <= INT_FIELD_LIMIT < P.base ** (P.per_word + 1)


def test_digit_packing_takes_counters_up_to_the_exact_float32_range():
    """The largest aggregate a float32 field holds exactly is 2**22 - 1 (base 2**22, one digit per word);
    one more is a ValueError naming it, not a packing of no digit per word."""
    P = digit_packing(INT_FIELD_LIMIT - 1, 5)
    assert (P.base, P.per_word, P.words) == (INT_FIELD_LIMIT, 1, 5)
    with pytest.raises(ValueError, match=f"a counter of up to {INT_FIELD_LIMIT} does not fit an exact float32"):
        digit_packing(INT_FIELD_LIMIT, 5)


def test_digit_packing_takes_as_many_words_as_its_digits_fill():
    """``words`` is ``ceil(digits / per_word)``: no word for no digit (an empty tensor's bitmap), one for a
    single digit, and one more as soon as a word is full."""
    assert [digit_packing(1, d).words for d in (0, 1, 22, 23, 44, 45)] == [0, 1, 1, 2, 2, 3]   # 22 per word
    assert plan_layout(0, 2, 0, index="bitmap").index.words == 0


def test_an_empty_value_sketch_is_one_cell_per_segment():
    """No candidate keys: the smallest table there is (three segments of one cell), on the stream given
    (0 by default), not an error."""
    from lossless_hc.lhc.layout import SegmentedTable
    assert sketch_table_for(0) == SegmentedTable(seg_len=1, seg_count=3, stream=0)
    assert sketch_table_for(0, 7) == SegmentedTable(seg_len=1, seg_count=3, stream=7)
    assert sketch_table_for(10).stream == 0


@pytest.mark.parametrize("keys", [3000, 6000, 10_000, 20_000, 2 ** 15])
def test_a_single_group_sketch_is_1_25_cells_per_key_plus_its_margin(keys):
    """Where the small stopping sets do not bind (a few thousand keys up to the split at 2^15), a value
    sketch is one group of three segments of exactly ceil((1.25 N + 3 sqrt(N) + 8) / 3) signed cells
    (sketch_table_for's doc): no more, since every cell is wire."""
    table = sketch_table_for(keys)
    assert (table.seg_count, table.weighted) == (3, False)
    assert table.seg_len == math.ceil((1.25 * keys + 3 * math.sqrt(keys) + 8) / 3)


@pytest.mark.parametrize("keys", [500, 700, 879])
def test_small_sketches_are_weighted_at_no_more_than_1_6_cells_per_key(keys):
    """A small single-group sketch takes weights +-1, +-2 where that is smaller than the signed table,
    loaded at most 1 / 1.6: from a few hundred keys that load is what sizes it, ceil(1.6 N / 3) cells
    per segment. At 880 keys the weighted table would be as large as the signed one (470 cells per
    segment): no smaller, so the table stays signed (the more accurate of the two)."""
    table = sketch_table_for(keys)
    assert table.weighted and table.seg_count == 3
    assert table.seg_len == math.ceil(1.6 * keys / 3)
    at_880 = sketch_table_for(880)
    assert not at_880.weighted and at_880.seg_len == math.ceil(1.6 * 880 / 3) == 470


def test_value_sketches_split_into_groups_above_2_to_the_15_keys():
    """GROUP_KEYS is 2^14 (docs/DESIGN.md, "Groups"): a sketch of 2^15 keys is one group, one of
    2^15 + 1 keys three (ceil(N / 2^14), below the pair cap)."""
    assert sketch_table_for(2 ** 15).seg_count == 3
    assert sketch_table_for(2 ** 15 + 1).seg_count == 9


def test_the_unsolvable_pair_shares_are_the_weight_patterns_proportional_share():
    """The shares the sizing assumes, derived as the module says: with signs +-1 two of the eight sign
    patterns of a colliding pair are proportional; with weights uniform on {+1, +2, -1, -2} a ratio is
    +-1 with probability 1/4 each and +-2, +-1/2 with 1/8 each, so 2 (1/4)^3 + 4 (1/8)^3 = 5/128."""
    from lossless_hc.lhc.sizing import PAIR_UNSOLVABLE_SHARE_SIGNS, PAIR_UNSOLVABLE_SHARE_WEIGHTS
    assert PAIR_UNSOLVABLE_SHARE_SIGNS == 2 / 8
    assert PAIR_UNSOLVABLE_SHARE_WEIGHTS == 2 * (1 / 4) ** 3 + 4 * (1 / 8) ** 3 == 5 / 128


@pytest.mark.parametrize("keys,groups", [(32_769, 3), (100_000, 7), (1_000_000, 23), (5_370_000, 55)])
def test_grouped_sketches_size_each_group_for_its_share_and_four_sigmas(keys, groups):
    """Past 2^15 keys: G = min(ceil(N / 2^14), int(sqrt(1e-3 N / (7 * 1/4)))) groups (the pair cap sets G
    from ~150k keys: 23 groups at 1M keys, 55 at 5.37M, docs/DESIGN.md "Groups"), each of three segments of
    ceil((1.25 m + 3 sqrt(m) + 8) / 3) cells for its share m = N/G + 4 sqrt(N/G)."""
    table = sketch_table_for(keys)
    assert table.seg_count == 3 * groups
    assert groups == min(math.ceil(keys / 2 ** 14), int(math.sqrt(1e-3 * keys / (7 * 0.25))))
    m = keys / groups + 4 * math.sqrt(keys / groups)
    assert table.seg_len == math.ceil((1.25 * m + 3 * math.sqrt(m) + 8) / 3)


@pytest.mark.parametrize("nodes,groups", [(2049, 1), (7000, 2), (20_000, 3)])
def test_fine_tables_of_large_nodes_are_capped_in_groups_by_the_pair_bound(nodes, groups):
    """fine_table_for aims at GROUP_KEYS * 4 / (3 + words) nodes per group (1024 for 61-word nodes),
    but the pair bound int(sqrt(1e-3 N / (7 / 4))) caps the groups: 2049 nodes stay one group (sized
    without a margin), 7000 take two and 20000 three, each sized for N/G plus 4 sqrt(N/G) nodes."""
    from lossless_hc.lhc.sizing import fine_table_for
    t = fine_table_for(nodes, 61)
    assert t.seg_count == 3 * groups
    m = nodes / groups + (4 * math.sqrt(nodes / groups) if groups > 1 else 0)
    assert t.seg_len == math.ceil((1.25 * m + 3 * math.sqrt(m) + 8) / 3)


def test_small_stopping_sets_is_the_documented_sum_of_pairs_and_4_and_6_key_sets():
    """pair_share u^2 / (2 t^3) + 27 u^4 / (24 t^6) + 3375 u^6 / (720 t^9), every term checked apart
    (pair_share 1 by default)."""
    from lossless_hc.lhc.sizing import small_stopping_sets
    u, t = 10.0, 10.0
    pairs, fours, sixes = u * u / (2 * t ** 3), 27 * u ** 4 / (24 * t ** 6), 3375 * u ** 6 / (720 * t ** 9)
    assert small_stopping_sets(u, t) == pytest.approx(pairs + fours + sixes, rel=1e-12)
    assert small_stopping_sets(u, t, 0.5) == pytest.approx(0.5 * pairs + fours + sixes, rel=1e-12)
    assert small_stopping_sets(u, t, 0.0) == pytest.approx(fours + sixes, rel=1e-12)
    assert small_stopping_sets(40, 20, 0.0) == pytest.approx(27 * 40 ** 4 / (24 * 20 ** 6)
                                                             + 3375 * 40 ** 6 / (720 * 20 ** 9), rel=1e-12)


@pytest.mark.parametrize("nodes", [10, 100, 1000, 5000])
def test_small_tables_are_the_smallest_whose_stopping_sets_meet_the_target(nodes):
    """A one-group table is 1.25 cells per id plus 3 sqrt + 8, or, where its small stopping sets
    (pairs a quarter unsolvable: signed fine tables) would exceed 1e-3, the smallest segment that
    brings them to 1e-3: one cell fewer per segment would not."""
    from lossless_hc.lhc.sizing import fine_table_for, small_stopping_sets
    t = fine_table_for(nodes, 1)
    assert t.seg_count == 3
    base = math.ceil((1.25 * nodes + 3 * math.sqrt(nodes) + 8) / 3)
    assert small_stopping_sets(nodes, t.seg_len, 0.25) <= 1e-3
    if t.seg_len != base:
        assert t.seg_len > base and small_stopping_sets(nodes, t.seg_len - 1, 0.25) > 1e-3
    else:
        assert small_stopping_sets(nodes, base, 0.25) <= 1e-3
    # the weighted value sketch of 100 keys: its stopping sets (5/128 of pairs unsolvable), not 1.6 per key
    small = sketch_table_for(100)
    assert small.weighted and small.seg_len > math.ceil(1.6 * 100 / 3)
    assert small_stopping_sets(100, small.seg_len, 5 / 128) <= 1e-3
    assert small_stopping_sets(100, small.seg_len - 1, 5 / 128) > 1e-3


def _poisson_tail_exact(lam, q):
    return sum(math.exp(-lam + i * math.log(lam) - math.lgamma(i + 1)) for i in range(q + 1, q + 400))


@pytest.mark.parametrize("lam,q", [(0.5, 0), (0.5, 3), (2.0, 1), (3.0, 6), (10.0, 12), (0.01, 5), (0.2, 12),
                                   (1e-4, 2)])
def test_poisson_tail_is_the_probability_above_q(lam, q):
    """_poisson_tail(lam, q) = P(Poisson(lam) > q) (the Bloom counters' and fine cells' caps rest on it);
    where 1 - cdf has lost its digits it is an upper bound within a few percent of the tail."""
    from lossless_hc.lhc.sizing import _poisson_tail
    exact = _poisson_tail_exact(lam, q)
    got = _poisson_tail(lam, q)
    if exact > 1e-8:
        assert got == pytest.approx(exact, rel=1e-6)
    else:
        assert exact <= got <= 1.05 * exact
    assert _poisson_tail(0.0, 3) == 0.0 and _poisson_tail(-1.0, 0) == 0.0


def _bloom_rules_hold(num_keys, union, cells):
    """bloom_table_for's three rules at ``cells`` counters: E[FP] <= max(U / 4, 16), twins <= 1e-3, and
    room to peel the U + FP candidates (+ 4 sigmas of FP) as a value sketch would."""
    u, others, t = max(1, union), max(0, num_keys - union), cells / 3
    fp = others * (1 - math.exp(-u / t)) ** 3
    twins = (u * others + (u + fp) ** 2 / 2) / t ** 3
    return (fp <= max(0.25 * u, 16) and twins <= 1e-3
            and cells >= sketch_table_for(u + math.ceil(fp + 4 * math.sqrt(fp))).cells)


def _bloom_cap(capacity, n, t):
    """The smallest per-rank cap q >= 1 with n * 3t * P(Poisson(capacity / t) > q) <= 1e-6."""
    q = 1
    while n * 3 * t * _poisson_tail_exact(max(1, capacity) / t, q) > 1e-6:
        q += 1
    return q


# (num_keys, union, capacity, world_size): a union of one key (sized for exactly one); twins set the
# size of the small ones, false positives (U / 4) of the larger
BLOOM_SIZES = [(1000, 1, 1, 2), (1000, 6, 2, 3), (5000, 40, 10, 4), (20000, 50, 10, 5), (20000, 2000, 400, 5),
               (100000, 500, 100, 5)]


@pytest.mark.parametrize("num_keys,union,capacity,n", BLOOM_SIZES)
def test_bloom_table_is_the_smallest_feasible_or_one_that_packs_into_fewer_words(num_keys, union, capacity, n):
    """bloom_table_for's rules (its doc): the smallest counter count meeting the false-positive, twin
    and peeling rules, or 1.25, 1.5 or 2 times it where the smaller per-rank cap q packs the counters into
    fewer words (the fewest words, then the smallest table, wins); q is the smallest cap whose
    saturation probability over every rank's counters is at most 1e-6."""
    from lossless_hc.lhc.sizing import bloom_table_for
    table, q = bloom_table_for(num_keys, union, capacity, n, stream=9)
    assert (table.seg_count, table.stream, table.weighted) == (3, 9, False)
    assert bloom_table_for(num_keys, union, capacity, n)[0].stream == 0   # the default stream
    lo, hi = 3, 3 * union
    while not _bloom_rules_hold(num_keys, union, hi):
        hi *= 2
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if _bloom_rules_hold(num_keys, union, mid) else (mid + 1, hi)
    candidates = [-(-int(lo * f) // 3) for f in (1.0, 1.25, 1.5, 2.0)]

    def words(t):
        return digit_packing(n * _bloom_cap(capacity, n, t), 3 * t).words

    assert table.seg_len == min(candidates, key=lambda t: (words(t), t))
    assert q == _bloom_cap(capacity, n, table.seg_len)


@pytest.mark.parametrize("groups,keys,expected", [(100, 100, 98), (1000, 1000, 735), (10_000, 10_000, 6642),
                                                  (1_000_000, 1_000_000, 635_303)])
def test_expected_nonzero_groups_is_the_random_mean_plus_four_sigmas_plus_two(groups, keys, expected):
    """Uncapped, the planned non-zero groups are ceil(mean + 4 sqrt(mean) + 2) for the mean number of
    groups hit by ``keys`` uniform keys, G (1 - (1 - 1/G)^U)."""
    from lossless_hc.lhc.sizing import expected_nonzero_groups
    mean = groups * (1 - (1 - 1 / groups) ** keys)
    assert expected == math.ceil(mean + 4 * math.sqrt(mean) + 2)
    assert expected_nonzero_groups(groups, keys) == expected


@pytest.mark.parametrize("groups,keys,expected", [(10, 5, 5), (1000, 100, 100), (10, 1000, 10), (100, 1000, 100),
                                                  (2, 1, 1), (1, 1, 1), (1, 1000, 1), (3, 2, 2)])
def test_expected_nonzero_groups_is_capped_by_the_groups_and_the_keys(groups, keys, expected):
    """Never more groups than there are, nor than keys to hit them (one group: exactly one)."""
    from lossless_hc.lhc.sizing import expected_nonzero_groups
    assert expected_nonzero_groups(groups, keys) == expected


@pytest.mark.parametrize("groups,keys", [(0, 5), (-1, 5), (5, 0), (5, -1), (0, 0), (-3, -3), (1, 0)])
def test_expected_nonzero_groups_of_no_groups_or_no_keys_is_zero(groups, keys):
    """No groups or no keys (either non-positive): zero groups to size for, an int."""
    from lossless_hc.lhc.sizing import expected_nonzero_groups
    got = expected_nonzero_groups(groups, keys)
    assert got == 0 and type(got) is int


@pytest.mark.parametrize("nodes,words,groups", [(32_768, 1, 1), (32_769, 1, 3), (26_214, 2, 1), (39_322, 2, 4),
                                                (65_536, 2, 6), (16_384, 5, 1), (16_385, 5, 3), (7000, 100_000, 2)])
def test_fine_tables_of_few_words_split_at_twice_their_group_size(nodes, words, groups):
    """A fine group aims at GROUP_KEYS * 4 // (3 + words) nodes, at least one (16384 for one word, 13107
    for two, 8192 for five): a table of more than twice that many nodes takes ceil(N / that) groups (six
    for 65536 nodes of two words), capped by the pair bound int(sqrt(1e-3 N / (7 / 4))) (two groups for
    7000 nodes of 100000 words)."""
    from lossless_hc.lhc.sizing import GROUP_KEYS, fine_table_for
    aim = max(1, GROUP_KEYS * 4 // (3 + words))
    expected = 1 if nodes <= 2 * aim else min(math.ceil(nodes / aim), int(math.sqrt(1e-3 * nodes / 1.75)))
    assert expected == groups
    assert fine_table_for(nodes, words).seg_count == 3 * groups


@pytest.mark.parametrize("numel,n,max_nnz,block,union_nnz,keys,capacity,union", [
    (1000, 3, 25, 4, None, 250, 7, 21), (1001, 3, 25, 4, None, 251, 7, 21), (1000, 3, 25, 4, 30, 250, 7, 8),
    (1000, 3, 25, 4, 10 ** 6, 250, 7, 250), (1000, 3, 25, 4, 0, 250, 7, 0), (1000, 2, 5000, 1, None, 1000, 1000, 1000),
    (100, 64, 10, 1, None, 100, 10, 100), (5, 2, 0, 1, None, 5, 0, 0), (33, 5, 33, 32, 1, 2, 2, 1)])
def test_build_layout_derives_keys_capacity_and_union_from_its_arguments(numel, n, max_nnz, block, union_nnz, keys,
                                                                        capacity, union):
    """Every kind: ceil(numel / block) keys, a per-rank capacity of ceil(max_nnz / block) keys (at most all
    of them), and a union of n times that, or ceil(union_nnz / block) where given, at most all the keys."""
    for kind in ("dense", "bitmap", "bloom", "multilevel"):
        L = build_layout(kind, numel, n, max_nnz, block, 7, union_nnz)
        if L is None:
            assert kind == "bloom"
            continue
        assert (L.index_kind, L.numel, L.block, L.world_size, L.seed) == (kind, numel, block, n, 7)
        assert (L.num_keys, L.capacity, L.union_keys) == (keys, capacity, union)


@pytest.mark.parametrize("numel,n,max_nnz,block,seed,union_nnz,words", [
    (1000, 3, 25, 4, 7, None, 1), (50_000, 8, 300, 1, 2 ** 64 - 1, 2000, (2, 1)),
    (32 * 300 + 5, 5, 640, 32, 3, None, 3)])
def test_build_layout_assembles_each_kind_from_the_sizing_rules(numel, n, max_nnz, block, seed, union_nnz, words):
    """The value sketch is sketch_table_for(union) on the seed's sketch stream for every kind; bitmap packs one
    base-(n+1) digit per key, bloom the table and per-rank cap of bloom_table_for (base n q + 1), multilevel
    the coarse level of multilevel_plan on the fine stream; dense has no index. The fingerprint is the
    layout's own."""
    from dataclasses import replace as dc_replace
    from lossless_hc.lhc.layout import (SALT_BLOOM, SALT_FINE, SALT_SKETCH, DigitPacking, digit_packing,
                                        layout_fingerprint, stream_seed)
    from lossless_hc.lhc.sizing import bloom_table_for, sketch_table_for
    layouts = {k: build_layout(k, numel, n, max_nnz, block, seed, union_nnz, words)
               for k in ("dense", "bitmap", "bloom", "multilevel")}
    keys, union = layouts["dense"].num_keys, layouts["dense"].union_keys
    for kind, L in layouts.items():
        assert L.sketch == sketch_table_for(union, stream_seed(seed, SALT_SKETCH))
        assert L.fingerprint == layout_fingerprint(dc_replace(L, fingerprint=0)) != 0
        assert (L.bloom is None) == (kind != "bloom") and (L.multilevel is None) == (kind != "multilevel")
    assert (layouts["dense"].index, layouts["dense"].digit_cap) == (DigitPacking(1, 1, 0), 0)
    assert (layouts["bitmap"].index, layouts["bitmap"].digit_cap) == (digit_packing(n, keys), 1)
    bloom, q = bloom_table_for(keys, union, layouts["dense"].capacity, n, stream_seed(seed, SALT_BLOOM))
    L = layouts["bloom"]
    assert (L.bloom, L.digit_cap, L.index) == (bloom, q, digit_packing(n * q, bloom.cells))
    L = layouts["multilevel"]
    assert L.multilevel == multilevel_plan(keys, union, n, words, stream_seed(seed, SALT_FINE))
    assert (L.index, L.digit_cap) == (L.multilevel.coarse, 1)
    assert len({L.fingerprint for L in layouts.values()}) == 4


def test_build_layout_defaults_are_block_1_seed_0_no_union_one_word():
    """The documented defaults: block_size 1, seed 0, union_nnz None (n * capacity), one fine word per group;
    and fine_table_for's and multilevel_plan's streams default to 0."""
    from lossless_hc.lhc.sizing import fine_table_for
    for kind in ("dense", "bitmap", "bloom", "multilevel"):
        assert build_layout(kind, 5000, 3, 40) == build_layout(kind, 5000, 3, 40, 1, 0, None, 1)
    assert build_layout("bitmap", 5000, 3, 40).num_keys == 5000
    assert fine_table_for(300, 2) == fine_table_for(300, 2, 0)
    assert multilevel_plan(5000, 120, 3, 2) == multilevel_plan(5000, 120, 3, 2, 0)


def test_build_layout_refuses_bad_arguments_and_unknown_kinds():
    """build_layout checks its arguments as plan_layout does (ValueError naming the argument) and refuses an
    unknown index kind; an index of no keys is None, a dense layout of no keys is built."""
    with pytest.raises(ValueError, match="numel must be >= 0"):
        build_layout("dense", -1, 2, 10)
    with pytest.raises(ValueError, match="block_size must be >= 1"):
        build_layout("multilevel", 100, 2, 10, 0)
    with pytest.raises(ValueError, match="max_nnz must be >= 0"):
        build_layout("bitmap", 100, 2, -1)
    with pytest.raises(ValueError, match="union_nnz must be >= 0"):
        build_layout("bloom", 100, 2, 10, 1, 0, -1)
    with pytest.raises(ValueError, match="world_size must be in"):
        build_layout("dense", 100, 0, 10)
    for bad in ("sparse", "Dense", ""):
        with pytest.raises(ValueError, match="index must be one of"):
            build_layout(bad, 100, 2, 10)
    for kind in ("bitmap", "bloom", "multilevel"):
        assert build_layout(kind, 0, 2, 0) is None
    empty = build_layout("dense", 0, 2, 0)
    assert (empty.num_keys, empty.index_kind) == (0, "dense")
