"""Two-key stopping sets of the value sketch: two support keys whose three cells coincide.

Peeling never resolves them (neither is ever alone in a cell); the decoder solves the pair from two
of its cells unless the keys' weight ratios agree in all three (then the pair is unsolvable and
decode reports ok=False). ``sizing.sketch_table_for`` sizes small sketches on that promise
(``PAIR_UNSOLVABLE_SHARE_SIGNS`` / ``_WEIGHTS``), so both outcomes are pinned here on real colliding keys, found by
hashing every key of small layouts: exact (within the trace bound) when solvable, a reported
failure -- never a wrong answer -- when not, the C++ decoder and the reference agreeing on which.
"""
from dataclasses import replace

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import helpers
from lossless_hc import LosslessCodec
from lossless_hc.lhc import reference as reference
from lossless_hc.lhc.layout import SegmentedTable, stream_seed
from lossless_hc.lhc.sizing import (PAIR_UNSOLVABLE_SHARE_SIGNS, PAIR_UNSOLVABLE_SHARE_WEIGHTS, build_layout,
                                    expected_unsolvable_pairs, unsolvable_pairs)


def colliding_pairs(layout):
    """(solvable, proportional): lists of key pairs (a < b) with the same three sketch cells."""
    return helpers.colliding_pairs(layout.sketch, layout.num_keys)


def pair_inputs(rng, layout, pair, n, others, dist="wide"):
    """n ranks; both keys of ``pair`` held by rank 0 and the second also by the last rank (so the
    pair's values are sums), plus ``others`` random keys per rank whose cells avoid the pair's."""
    L = layout
    cells, _ = reference.key_cells(L.sketch, torch.arange(L.num_keys))
    pair_cells = set(cells[pair[0]].tolist())
    free = [k for k in range(L.num_keys) if k not in pair and not pair_cells & set(cells[k].tolist())]
    xs = []
    for r in range(n):
        keys = list(rng.choice(free, others, replace=False)) if others else []
        if r == 0:
            keys += list(pair)
        if r == n - 1:
            keys.append(pair[1])
        x = torch.zeros(L.numel)
        for k in set(keys):
            lo, hi = k * L.block, min(L.numel, (k + 1) * L.block)
            x[lo:hi] = torch.from_numpy(helpers.values(rng, dist, hi - lo)).float()
        xs.append(x)
    return xs


@pytest.mark.parametrize("block", [1, 3])
@pytest.mark.parametrize("n", [1, 2, 4])
@pytest.mark.parametrize("averaged", [False, True])
def test_solvable_pair_decodes_exactly(block, n, averaged):
    codec = LosslessCodec(4000 * block - (block > 1), n, 8 * block, block_size=block, index="bitmap", seed=11)
    solvable, _ = colliding_pairs(codec.layout)
    assert solvable, "the layout has no colliding pair: pick another seed"
    rng = np.random.default_rng(helpers.stable_seed("pair", block, n, averaged))
    for pair in solvable[:3]:
        xs = pair_inputs(rng, codec.layout, pair, n, others=4)
        summed = helpers.sum_payloads([codec.encode(x) for x in xs], rng)
        if averaged:
            summed = helpers.average_payloads(summed, n)
        y, rep = codec.decode(summed, averaged=averaged, trace=True, error_bounds=True)
        helpers.assert_lossless(codec.layout, xs, y, rep, averaged=averaged, strict_support=False)
        assert set(pair) <= set((rep.trace[0] // 1).tolist())
        yr, info = reference.decode(codec.layout, summed, averaged=averaged)
        # The reference peels in rounds (as CUDA does), so it may read a key from another cell than the
        # C++ queue did and prove a different set inexact; both must peel everything, and agree elsewhere.
        assert info["ok"] or info["reason"] == "inexact", info["reason"]
        assert info["peeled"] == rep.peeled == rep.support
        exact = torch.ones(codec.layout.num_keys, dtype=torch.bool)
        for keys in (info["inexact_keys"], rep.inexact_keys):
            if keys is not None:
                exact[keys] = False
        mask = exact.repeat_interleave(codec.layout.block)[: codec.layout.numel]
        assert torch.allclose(yr[mask], y.double()[mask], rtol=1e-6, atol=1e-6 * float(yr.abs().max()))


@pytest.mark.parametrize("block", [1, 3])
def test_proportional_pair_is_reported_never_wrong(block):
    codec = LosslessCodec(4000 * block, 3, 8 * block, block_size=block, index="bitmap", seed=11)
    _, proportional = colliding_pairs(codec.layout)
    assert proportional, "the layout has no proportional pair: pick another seed"
    rng = np.random.default_rng(helpers.stable_seed("prop", block))
    for pair in proportional[:3]:
        xs = pair_inputs(rng, codec.layout, pair, 3, others=4)
        summed = helpers.sum_payloads([codec.encode(x) for x in xs], rng)
        y, rep = codec.decode(summed)
        assert not rep.ok and "sketch peeling failed" in rep.reason
        assert rep.peeled == rep.support - 2
        _, info = reference.decode(codec.layout, summed)
        assert not info["ok"] and info["peeled"] == rep.peeled
        # the keys peeled are still exact; the pair's coordinates are NaN, never a plausible value
        for k in pair:
            assert bool(torch.isnan(y[k * codec.layout.block:(k + 1) * codec.layout.block]).all())


@pytest.mark.parametrize("weighted", [True, False])
def test_unsolvable_pairs_counts_the_proportional_colliding_pairs(weighted):
    """sizing.unsolvable_pairs (ids hashed, then equal rows compared) against helpers.colliding_pairs
    (a lexicographic unique of the cells, then the weight test) on 300 ids in 3 x 20 cells, over 200
    streams: equal wherever no three ids share their cells; and its mean is expected_unsolvable_pairs
    (within 5 standard errors of a Poisson count)."""
    table = SegmentedTable(seg_len=20, seg_count=3, stream=0, weighted=weighted)
    counts, compared = [], 0
    for attempt in range(200):
        t = replace(table, stream=stream_seed(7, attempt))
        got = unsolvable_pairs(t, 300)
        cells, _ = reference.key_cells(t, torch.arange(300))
        if helpers.shared_cells(cells.numpy())[0].max() <= 2:
            assert got == len(helpers.colliding_pairs(t, 300)[1])
            compared += 1
        counts.append(got)
    assert compared > 150
    expected = expected_unsolvable_pairs(table, 300)
    assert abs(np.mean(counts) - expected) < 5 * np.sqrt(expected / len(counts)), (np.mean(counts), expected)


def test_planner_reseeds_a_sketch_with_an_unsolvable_pair():
    """A small tensor (2000 keys, 3 ranks, 8 non-zeros each, seed 2): the seed's own sketch stream
    hashes two pairs of keys to the same three cells with proportional weights, so every aggregate
    holding both keys of one would fail, whatever the values. The planner takes a stream whose keys
    form no such pair (the sizes unchanged): those keys then decode exactly, where the seed's own
    layout reports the failure."""
    codec = LosslessCodec(2000, 3, 8, index="bitmap", seed=2)
    raw = build_layout("bitmap", 2000, 3, 8, 1, 2)
    _, proportional = colliding_pairs(raw)
    assert len(proportional) == 2 and unsolvable_pairs(raw.sketch, raw.num_keys) == 2
    assert codec.layout.reseeded[0] > 0 and codec.layout.sketch.stream != raw.sketch.stream
    assert colliding_pairs(codec.layout)[1] == [] and unsolvable_pairs(codec.layout.sketch, raw.num_keys) == 0
    assert codec.layout.payload_numel == raw.payload_numel and codec.layout.fingerprint != raw.fingerprint
    seed_codec = helpers.codec_for(raw)
    rng = np.random.default_rng(helpers.stable_seed("reseeded sketch"))
    for pair in proportional[:2]:
        xs = pair_inputs(rng, raw, pair, 3, others=3)
        y, rep = codec.decode(helpers.sum_payloads([codec.encode(x) for x in xs], rng), trace=True, error_bounds=True)
        assert helpers.peeled_ok(rep), rep.reason
        helpers.assert_lossless(codec.layout, xs, y, rep)
        _, rep = seed_codec.decode(helpers.sum_payloads([seed_codec.encode(x) for x in xs], rng))
        assert not rep.ok and "sketch peeling failed" in rep.reason, rep.reason


def test_bloom_index_then_pair():
    """A pair among the Bloom index's candidates is solved in the value peel too."""
    codec = LosslessCodec(6000, 2, 10, index="bloom", seed=5)
    solvable, _ = colliding_pairs(codec.layout)
    rng = np.random.default_rng(5)
    xs = pair_inputs(rng, codec.layout, solvable[0], 2, others=3)
    y, rep = codec.decode(sum(codec.encode(x) for x in xs), trace=True, error_bounds=True)
    helpers.assert_lossless(codec.layout, xs, y, rep, strict_support=False)


@pytest.mark.parametrize("weighted", [True, False])
def test_unsolvable_share_matches_weight_patterns(weighted):
    """Over many colliding pairs, the share with proportional columns is what the sizing assumes:
    5/128 with weights +-1, +-2, 2/8 with signs."""
    codec = LosslessCodec(200_000, 2, 40, index="bitmap", seed=1)
    assert codec.layout.sketch.weighted  # 80 keys: a small table is weighted
    layout = codec.layout if weighted else replace(codec.layout, sketch=replace(codec.layout.sketch, weighted=False))
    solvable, proportional = colliding_pairs(layout)
    total = len(solvable) + len(proportional)
    assert total > 2000
    share = len(proportional) / total
    p = PAIR_UNSOLVABLE_SHARE_WEIGHTS if weighted else PAIR_UNSOLVABLE_SHARE_SIGNS
    assert abs(share - p) < 5 * np.sqrt(p * (1 - p) / total)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**31 - 1), n=st.integers(1, 5), block=st.sampled_from([1, 2, 5]),
       others=st.integers(0, 6), dist=st.sampled_from(["normal", "wide"]))
def test_pairs_property(seed, n, block, others, dist):
    """Random small layouts, a random colliding pair (solvable or not) among random keys: the C++
    decoder and the reference agree on ok and on what was peeled; ok means lossless."""
    rng = np.random.default_rng(seed)
    numel = int(rng.integers(500, 3000)) * block
    codec = LosslessCodec(numel, n, (others + 2) * block, block_size=block, index="bitmap", seed=seed)
    solvable, proportional = colliding_pairs(codec.layout)
    pool = solvable + proportional
    if not pool:
        return
    pair = pool[int(rng.integers(len(pool)))]
    xs = pair_inputs(rng, codec.layout, pair, n, others=others, dist=dist)
    summed = helpers.sum_payloads([codec.encode(x) for x in xs], rng)
    y, rep = codec.decode(summed, trace=True, error_bounds=True)
    _, info = reference.decode(codec.layout, summed)
    assert (rep.ok, rep.peeled) == (info["ok"], info["peeled"])
    assert helpers.peeled_ok(rep) == helpers.peeled_ok(info), (rep.reason, info["reason"])
    if pair in proportional:
        assert not rep.ok
    if helpers.peeled_ok(rep):   # OK, or INEXACT: exact (within the bound) outside the listed keys
        helpers.assert_lossless(codec.layout, xs, y, rep, strict_support=False)


@pytest.mark.parametrize("block", [1, 3])
def test_verify_lists_both_keys_of_a_solved_pair(block):
    """With verify a solved pair's keys are listed inexact, both of them: one check cell cannot verify
    two values (lhc::verification_bound), so neither key has a verification bound. The C++ decoder and
    the reference list the same pair keys, and every other key keeps the contract."""
    codec = LosslessCodec(4000 * block - (block > 1), 2, 8 * block, block_size=block, index="bitmap", seed=11,
                          verify=True)
    solvable, _ = colliding_pairs(codec.layout)
    rng = np.random.default_rng(helpers.stable_seed("pair-verify", block))
    for pair in solvable[:3]:
        xs = pair_inputs(rng, codec.layout, pair, 2, others=4)
        summed = helpers.sum_payloads([codec.encode(x) for x in xs], rng)
        y, rep = codec.decode(summed)
        assert rep.status == helpers.INEXACT and rep.peeled == rep.support, rep.reason
        assert set(pair) <= set(rep.inexact_keys.tolist()), (pair, rep.inexact_keys)
        helpers.assert_contract(codec.layout, xs, y, rep.inexact_keys, codec.rtol)
        _, info = reference.decode(codec.layout, summed, verify=True)
        assert set(pair) <= set(info["inexact_keys"].tolist())


def brute_force_unsolvable_pairs(table, ids):
    """Pairs a < b of ids in [0, ids) with the same three cells and proportional weights, pair by pair."""
    cells, weights = reference.key_cells(table, torch.arange(ids))
    cells, w = cells.tolist(), weights.tolist()
    return sum(cells[a] == cells[b] and all(w[a][j] * w[b][0] == w[a][0] * w[b][j] for j in range(3))
               for a in range(ids) for b in range(a + 1, ids))


@pytest.mark.parametrize("weighted", [True, False])
@pytest.mark.parametrize("seg_len,seg_count", [(1, 3), (2, 3), (2, 6), (3, 3)])
def test_unsolvable_pairs_equals_the_pair_by_pair_count_on_crowded_tables(weighted, seg_len, seg_count):
    """On tables so small that many ids share all three cells (several per cell triple), unsolvable_pairs
    is exactly the number of pairs with the same cells and proportional weights (w_j(a) w_0(b) ==
    w_0(a) w_j(b) for every j): ratios +-1/2 of opposite signs (weights +-2 over +-1) are not proportional."""
    for stream in range(4):
        table = SegmentedTable(seg_len=seg_len, seg_count=seg_count, stream=stream_seed(11, stream), weighted=weighted)
        assert unsolvable_pairs(table, 40) == brute_force_unsolvable_pairs(table, 40)
    assert unsolvable_pairs(table, 0) == unsolvable_pairs(table, 1) == 0


def chosen_attempt(table, ids, attempts):
    """What _solvable_stream promises of ``attempts`` tries (attempt 0: the table's own stream, attempt a:
    stream_seed(own, a)): the first attempt free of unsolvable pairs, else the first of the fewest (the
    first of the least count either way); its count, table and number."""
    tried = [table] + [replace(table, stream=stream_seed(table.stream, a)) for a in range(1, attempts)]
    counts = [unsolvable_pairs(t, ids) for t in tried]
    best = counts.index(min(counts))
    return counts[best], tried[best], best


def test_solvable_stream_takes_the_first_stream_without_an_unsolvable_pair():
    """Two ids in one three-cell table always share their cells; where their signs are proportional on the
    table's own stream, _solvable_stream takes the first later stream where they are not (2 ids is in
    bounds); where they are not, the table keeps its stream (attempt 0, the same table)."""
    from lossless_hc.lhc.sizing import _solvable_stream
    tables = [SegmentedTable(seg_len=1, seg_count=3, stream=stream_seed(5, s)) for s in range(40)]
    bad = [t for t in tables if unsolvable_pairs(t, 2) == 1]
    good = [t for t in tables if unsolvable_pairs(t, 2) == 0]
    assert bad and good
    for t in bad[:4]:
        pairs, want, attempt = chosen_attempt(t, 2, 32)
        assert pairs == 0 and attempt >= 1
        assert _solvable_stream(t, 2) == (want, attempt)
    for t in good[:4]:
        got, attempt = _solvable_stream(t, 2)
        assert got is t and attempt == 0


def test_solvable_stream_takes_the_first_of_the_fewest_where_none_is_free():
    """Six ids in one three-cell table: four sign classes, so every stream has an unsolvable pair (3.75
    expected, within the bound of 4): the table takes the first of the 32 attempts with the fewest."""
    from lossless_hc.lhc.sizing import _solvable_stream
    for s in range(6):
        t = SegmentedTable(seg_len=1, seg_count=3, stream=stream_seed(9, s))
        pairs, want, attempt = chosen_attempt(t, 6, 32)
        assert pairs >= 1
        assert _solvable_stream(t, 6) == (want, attempt)


def test_solvable_stream_scans_up_to_four_expected_pairs_and_two_to_the_16_ids():
    """The bounds are inclusive: 32 ids in 31 one-cell groups expect exactly 4.0 unsolvable pairs and are
    scanned (32 attempts); 2^16 ids in 3 x 512 cells expect 3.99997 and are scanned, with 2^19 // 2^16 = 8
    attempts; past them (7 ids in 3 cells: 5.25 expected; 2^16 + 1 ids; fewer than 2 ids) the table keeps
    its stream."""
    from lossless_hc.lhc.sizing import PAIR_SCAN_MAX_EXPECTED, _solvable_stream
    t = SegmentedTable(seg_len=1, seg_count=93, stream=stream_seed(3, 1))
    assert expected_unsolvable_pairs(t, 32) == PAIR_SCAN_MAX_EXPECTED == 4.0
    pairs, want, attempt = chosen_attempt(t, 32, 32)
    assert unsolvable_pairs(t, 32) > 0 and attempt > 0
    assert _solvable_stream(t, 32) == (want, attempt)
    big = SegmentedTable(seg_len=512, seg_count=3, stream=stream_seed(3, 1))
    assert 3.9999 < expected_unsolvable_pairs(big, 2 ** 16) <= 4.0
    pairs, want, attempt = chosen_attempt(big, 2 ** 16, 8)
    assert unsolvable_pairs(big, 2 ** 16) > 0 and attempt > 0
    assert _solvable_stream(big, 2 ** 16) == (want, attempt)
    small = SegmentedTable(seg_len=1, seg_count=3, stream=stream_seed(3, 3))
    assert expected_unsolvable_pairs(small, 7) == 5.25 and unsolvable_pairs(small, 7) > 0
    for table, ids in ((small, 7), (big, 2 ** 16 + 1), (small, 1), (small, 0)):
        got, attempt = _solvable_stream(table, ids)
        assert got is table and attempt == 0


def test_with_solvable_streams_returns_a_layout_needing_no_new_stream_as_is():
    """A dense layout, and one whose tables have no unsolvable pair on their own streams, come back as the
    very same layout (reseeded empty); one that needs a stream records the attempts."""
    from lossless_hc.lhc.sizing import with_solvable_streams
    dense = build_layout("dense", 2000, 3, 8, 1, 2)
    assert with_solvable_streams(dense) is dense
    fine = build_layout("multilevel", 3000, 4, 200, 1, 1)
    assert unsolvable_pairs(fine.sketch, fine.num_keys) == 0
    assert [unsolvable_pairs(lv.table, lv.num_nodes) for lv in fine.multilevel.levels] == [0]
    assert with_solvable_streams(fine) is fine and fine.reseeded == ()
    raw = build_layout("bitmap", 2000, 3, 8, 1, 2)
    out = with_solvable_streams(raw)
    assert out.reseeded[0] > 0 and out.sketch.stream != raw.sketch.stream
    assert (out.sketch.seg_len, out.sketch.seg_count) == (raw.sketch.seg_len, raw.sketch.seg_count)


def test_a_solved_pairs_third_cell_still_checks_the_sum():
    """After a pair is solved from cells p, q its third cell r keeps a check: its bound grows by the
    pair's errors (``acc += |w_r(a)| E(a) + |w_r(b)| E(b)``), so a word added there that is far beyond
    rounding fails "sketch corrupt" in the reference as in the C++ decoder. The reference's trace lists
    the pair's keys as well, and its error bounds of the pair's keys are the C++ decoder's (which rounds
    them up to float32)."""
    codec = LosslessCodec(4000, 2, 8, index="bitmap", seed=11)
    L = codec.layout
    solvable, _ = colliding_pairs(L)
    rng = np.random.default_rng(helpers.stable_seed("pair-third-cell"))
    for pair in solvable[:3]:
        xs = pair_inputs(rng, L, pair, 2, others=4, dist="normal")
        summed = helpers.sum_payloads([codec.encode(x) for x in xs], rng)
        info = reference.decode(L, summed)[1]
        rep = codec.decode(summed, error_bounds=True)[1]
        assert info["peeled"] == rep.support
        # the pair's error bounds (cells p, q hold the pair alone: both decoders take the same formula,
        # the C++ rounding up to float32 along the way)
        keys, E = rep.error_bounds
        for k in pair:
            ref = float(info["error_bound"][info["support_keys"].tolist().index(k)])
            cpp = float(E[keys.tolist().index(k)])
            assert 0 < ref <= cpp <= ref * (1 + 2.0 ** -20), (k, ref, cpp)
        # the trace lists a solved pair's keys too, each with its first cell (the pair is read from all)
        trace_keys, trace_cells = info["trace"]
        assert sorted(trace_keys.tolist()) == info["support_keys"].tolist()
        cells, weights = reference.key_cells(L.sketch, torch.tensor(pair))
        assert dict(zip(trace_keys.tolist(), trace_cells.tolist()))[pair[1]] == int(cells[1, 0])
        p, q, _ = reference.pair_cells(weights[0].tolist(), weights[1].tolist())
        bad = summed.clone()
        bad[L.sketch_offset + int(cells[0, 3 - p - q])] += 1.0
        assert codec.decode(bad)[1].reason.startswith("sketch corrupt")
        reason = reference.decode(L, bad)[1]["reason"]
        assert reason == "sketch corrupt: a cell is not zero within its bound after peeling"
