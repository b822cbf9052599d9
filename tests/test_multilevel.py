"""The multilevel index (coarse counting bitmap over groups + a peeled fine table of group patterns):
exact when ok, failures reported (never a wrong answer), deterministic, bit-exact with the reference,
robust to fuzzed payloads."""
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import helpers
from lossless_hc import LosslessCodec, plan_layout
from lossless_hc.lhc import reference as reference
from lossless_hc.lhc.layout import INT_FIELD_LIMIT, LAYOUT_WORDS
from lossless_hc.lhc.reference_peel import pair_cells
from lossless_hc.lhc.sizing import build_layout, multilevel_plan, unsolvable_pairs
from lossless_hc.lhc.status import DecodeStatus


def bits(t):
    b = t.contiguous().view(torch.int32).clone()
    b[torch.isnan(t)] = 0x7FC00000
    return b


def case(numel, n, k, block=1, pattern="random", seed=0, data_seed=0, union_nnz=None, threads=0):
    rng = np.random.default_rng(data_seed)
    codec = LosslessCodec(numel, n, k * block, block_size=block, seed=seed, index="multilevel",
                          union_nnz=union_nnz, num_threads=threads)
    xs = helpers.make_inputs(rng, numel, block, n, k, pattern, "normal")
    return codec, xs, rng


@pytest.mark.parametrize("pattern", helpers.PATTERNS)
@pytest.mark.parametrize("numel,n,k,block", [(20_000, 2, 200, 1), (50_000, 8, 300, 1), (9_999, 16, 40, 1),
                                             (32 * 700 + 7, 4, 30, 32), (3_000, 64, 10, 1)])
def test_exact_when_ok(pattern, numel, n, k, block):
    codec, xs, rng = case(numel, n, k, block, pattern, data_seed=helpers.stable_seed(pattern, numel, n))
    assert codec.index_kind == "multilevel"
    payloads = [codec.encode(x) for x in xs]
    summed = helpers.sum_payloads(payloads, rng)
    y, rep = codec.decode(summed, trace=True, error_bounds=True)
    helpers.assert_lossless(codec.layout, xs, y, rep)
    assert rep.false_positives == 0 and rep.candidates == rep.support
    ya, repa = codec.decode(helpers.average_payloads(summed, n), averaged=True, trace=True, error_bounds=True)
    helpers.assert_lossless(codec.layout, xs, ya, repa, averaged=True)


def test_cpp_encode_is_bit_exact_with_reference_and_decode_agrees():
    for numel, n, k, block, seed in [(30_000, 3, 500, 1, 1), (4_001, 16, 100, 1, 2), (32 * 300 + 5, 5, 20, 32, 3),
                                     (100, 2, 100, 1, 4), (1, 1, 1, 1, 5)]:
        codec, xs, rng = case(numel, n, k, block, seed=seed, data_seed=seed)
        for x in xs[:3]:
            assert torch.equal(bits(codec.encode(x)), bits(reference.encode(codec.layout, x)))
        summed = helpers.sum_payloads([codec.encode(x) for x in xs], rng)
        y, rep = codec.decode(summed, trace=True, error_bounds=True)
        yr, info = reference.decode(codec.layout, summed)
        assert rep.ok == info["ok"], (rep.reason, info["reason"])
        assert helpers.peeled_ok(rep) == helpers.peeled_ok(info), (rep.reason, info["reason"])
        assert (rep.candidates, rep.support, rep.false_positives) == \
            (info["candidates"], info["support"], info["false_positives"])
        # Every case peels: OK, or INEXACT (the first three). (32 * 300 + 5, 5, 20, 32, seed 3) used to
        # fail index peeling for most data seeds, as its seed's fine stream holds an unsolvable pair:
        # the planner re-seeds that table (test_planner_reseeds_a_table_with_an_unsolvable_pair).
        assert helpers.peeled_ok(rep), (numel, rep.reason)
        helpers.assert_lossless(codec.layout, xs, y, rep)
        helpers.assert_contract(codec.layout, xs, yr, info["inexact_keys"], codec.rtol)
        assert torch.equal(y != 0, yr.to(torch.float32) != 0)


def test_property_round_trip_and_reference():
    """Random workloads (hypothesis draws the seeds): the C++ encode is bit-exact with the reference,
    both decoders agree, a decode that peels meets the bound; sized for the worst-case union, peeling
    failures must stay rare (PEEL_FAILURE_TARGET is 1e-3 per decode; measured: 1 of the 25 examples, a
    sketch peeling failure with one rank holding 26 keys, a shape that fails about 1 decode in 300)."""
    runs, failed = [], []

    @settings(max_examples=25, deadline=None, derandomize=True)
    @given(seed=st.integers(0, 2 ** 31 - 1), pattern=st.sampled_from(helpers.PATTERNS),
           block=st.sampled_from([1, 1, 3, 32]), averaged=st.booleans())
    def one(seed, pattern, block, averaged):
        rng = np.random.default_rng(seed)
        n, numel, density = helpers.draw_sizes(rng, max_n=16, max_numel=4000)
        num_keys = -(-numel // block)
        k = max(0, int(density * num_keys))
        codec = LosslessCodec(numel, n, max(1, k) * block, block_size=block, seed=seed % 1000, index="multilevel")
        xs = helpers.make_inputs(rng, numel, block, n, k, pattern, "normal")
        for x in xs[:2]:
            assert torch.equal(bits(codec.encode(x)), bits(reference.encode(codec.layout, x)))
        summed = helpers.sum_payloads([codec.encode(x) for x in xs], rng)
        payload = helpers.average_payloads(summed, n) if averaged else summed
        y, rep = codec.decode(payload, averaged=averaged, trace=True, error_bounds=True)
        yr, info = reference.decode(codec.layout, payload, averaged=averaged)
        assert helpers.peeled_ok(rep) == helpers.peeled_ok(info) and rep.support == info["support"]
        runs.append(seed)
        if helpers.peeled_ok(rep):
            helpers.assert_lossless(codec.layout, xs, y, rep, averaged=averaged)
        else:  # sized for the worst case union: only a rare peeling failure is acceptable
            assert "peeling" in rep.reason, rep.reason
            failed.append((seed, pattern, block, rep.reason))

    one()
    assert len(runs) >= 20, len(runs)
    assert len(failed) <= 1, failed   # rare: at most one of the examples


def test_more_support_than_planned_is_reported():
    """union_nnz too small for the real aggregate: the fine table or the sketch cannot peel, and decode
    says so (many trials, never ok with a wrong support)."""
    rng = np.random.default_rng(7)
    failures = 0
    for trial in range(40):
        codec = LosslessCodec(20_000, 4, 400, seed=trial, index="multilevel", union_nnz=200)
        xs = helpers.make_inputs(rng, 20_000, 1, 4, 400, "disjoint", "normal")
        y, rep = codec.decode(helpers.sum_payloads([codec.encode(x) for x in xs], rng), trace=True)
        if rep.ok:
            helpers.assert_lossless(codec.layout, xs, y, rep)
        else:
            failures += 1
            assert "peeling" in rep.reason or "overflow" in rep.reason, rep.reason
    assert failures == 40


def test_overload_is_reported():
    codec, xs, rng = case(5_000, 3, 20)
    xs[0] = helpers.make_inputs(rng, 5_000, 1, 1, 200, "random", "normal")[0]
    y, rep = codec.decode(helpers.sum_payloads([codec.encode(x) for x in xs], rng))
    assert not rep.ok and rep.overloaded_ranks == 1 and "overload" in rep.reason


def test_fine_word_overflow_is_reported_not_decoded():
    codec, xs, rng = case(20_000, 4, 100)
    L = codec.layout
    summed = helpers.sum_payloads([codec.encode(x) for x in xs], rng)
    bad = summed.clone()
    cell = int(torch.nonzero(bad[L.fine_offset:L.sketch_offset])[0]) + L.fine_offset
    bad[cell] += float(INT_FIELD_LIMIT)
    y, rep = codec.decode(bad)
    assert not rep.ok and "overflow" in rep.reason, rep.reason
    assert not reference.decode(L, bad)[1]["ok"]


def test_load_cap_headroom_is_respected():
    """The word headroom really covers load_cap groups of full patterns."""
    for n in (1, 2, 7, 16, 64, 255):
        for wpg in (1, 4, 32):
            m = multilevel_plan(1 << 22, 40_000, n, wpg)
            assert len(m.levels) == 1
            assert m is not None
            assert max(1, m.load_cap) * ((n + 1) ** m.digits_per_word - 1) < INT_FIELD_LIMIT
            assert m.group_keys == m.digits_per_word * wpg
            assert m.coarse.base == n + 1


def test_deterministic_across_threads_and_runs():
    codec1, xs, rng = case(200_000, 4, 3_000, threads=1)
    codec2 = LosslessCodec(200_000, 4, 3_000, index="multilevel", num_threads=2)
    p1 = [codec1.encode(x) for x in xs]
    p2 = [codec2.encode(x) for x in xs]
    for a, b in zip(p1, p2):
        assert torch.equal(bits(a), bits(b))
    summed = helpers.sum_payloads(p1, rng)
    outs = [c.decode(summed)[0] for c in (codec1, codec2, codec1)]
    assert all(torch.equal(bits(outs[0]), bits(o)) for o in outs[1:])


@settings(max_examples=40, deadline=None, derandomize=True)
@given(seed=st.integers(0, 2 ** 31 - 1), where=st.sampled_from(["coarse", "fine", "all"]),
       specials=st.booleans(), averaged=st.booleans())
def test_fuzzed_index_never_crashes_or_lies(seed, where, specials, averaged):
    codec, xs, rng = case(6_000, 5, 60, data_seed=seed % 97)
    L = codec.layout
    summed = helpers.sum_payloads([codec.encode(x) for x in xs], rng)
    lo, hi = {"coarse": (L.index_offset, L.fine_offset), "fine": (L.fine_offset, L.sketch_offset),
              "all": (0, L.payload_numel)}[where]
    bad = summed.clone()
    m = max(1, (hi - lo) // 20)
    pos = torch.from_numpy(rng.integers(lo, hi, size=m))
    vals = rng.choice([0.0, 1.0, 2.0, 5.0, 1e6, 0.5, -1.0, 4194303.0], size=m).astype(np.float32)
    if specials:
        vals[0] = rng.choice([np.nan, np.inf, -np.inf])
    bad[pos] = torch.from_numpy(vals)
    if averaged:
        bad = bad / 5
    y, rep = codec.decode(bad, averaged=averaged)
    _, info = reference.decode(L, bad, averaged=averaged)
    if helpers.peeled_ok(rep):  # only if the changes kept a consistent aggregate: then it decodes the sum
        assert helpers.peeled_ok(info) and rep.ok == info["ok"]
        assert rep.support == info["support"]
        helpers.assert_contract(L, xs, y, rep.inexact_keys, codec.rtol, averaged=averaged)
    # random float noise anywhere
    noise = summed + torch.from_numpy(rng.standard_normal(L.payload_numel).astype(np.float32))
    assert not codec.decode(noise)[1].ok


def test_auto_plans_multilevel_for_every_device():
    """Both backends decode the multilevel index, so ``auto`` picks it where it is smallest whatever the
    device (ranks on CPUs and GPUs then plan the same payload), and the CUDA backend takes its layout."""
    from lossless_hc.backends import cuda_lhc as _cuda
    L = plan_layout(1 << 20, 2, 10_000, 1, 0, "auto", union_nnz=10_000)
    assert L.index_kind == "multilevel"
    native = _cuda.CudaLayout(L, torch.device("cpu"))   # the kernels' layout words (no GPU needed)
    assert native.words.numel() == len(LAYOUT_WORDS) and native.node_caps
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="CUDA device"):
            LosslessCodec(1000, 2, 10, device="cuda", index="multilevel")


@pytest.mark.parametrize("shape", [(1, 1), (2, 1), (1, 1, 1), (1, 2, 4), (4, 1, 1, 2)])
@pytest.mark.parametrize("numel,n,k,block,pattern", [(300_000, 2, 60, 1, "random"), (100_000, 16, 30, 1, "clustered"),
                                                     (32 * 5000 + 3, 5, 12, 32, "random"), (50_000, 3, 2_000, 1, "identical")])
def test_several_fine_levels(shape, numel, n, k, block, pattern):
    from lossless_hc.lhc.sizing import build_layout
    rng = np.random.default_rng(helpers.stable_seed(shape, numel, n))
    L = build_layout("multilevel", numel, n, k * block, block, 9, None, shape)
    assert L is not None and len(L.multilevel.levels) == len(shape)
    spans = [lv.span for lv in L.multilevel.levels]
    assert spans == sorted(spans, reverse=True) and L.multilevel.coarse.digits == -(-L.num_keys // spans[0])
    codec = helpers.codec_for(L)
    xs = helpers.make_inputs(rng, numel, block, n, k, pattern, "normal")
    for x in xs[:2]:
        assert torch.equal(bits(codec.encode(x)), bits(reference.encode(L, x)))
    summed = helpers.sum_payloads([codec.encode(x) for x in xs], rng)
    for averaged in (False, True):
        payload = helpers.average_payloads(summed, n) if averaged else summed
        y, rep = codec.decode(payload, averaged=averaged, trace=True)
        yr, info = reference.decode(L, payload, averaged=averaged)
        assert rep.ok == info["ok"] and rep.support == info["support"], (rep.reason, info["reason"])
        helpers.assert_lossless(L, xs, y, rep, averaged=averaged)
    # fuzz every level's table: never a crash, never ok unless the reference agrees
    for off, lv in zip(L.level_offsets, L.multilevel.levels):
        bad = summed.clone()
        pos = torch.from_numpy(rng.integers(off, off + lv.numel, size=3))
        bad[pos] += torch.tensor([1.0, 3.0, 7.0])
        _, rep = codec.decode(bad)
        assert rep.ok == reference.decode(L, bad)[1]["ok"]
        assert not rep.ok


def test_a_plan_s_shortcuts_are_its_finest_level_s_shape():
    """MultilevelPlan's shortcuts (group_keys, digits_per_word, words_per_group, load_cap, fine) read the
    last (finest) level, whose children are keys, and num_groups is the coarse bitmap's node count: three
    levels that differ in every field tell the finest one from the others."""
    from lossless_hc.lhc.layout import DigitPacking, FineLevel, MultilevelPlan, SegmentedTable
    levels = tuple(FineLevel(digits_per_word=d, words_per_group=w, span=span, num_nodes=-(-10_000 // span),
                             planned_nodes=p, load_cap=cap, table=SegmentedTable(seg_len=t, seg_count=3, stream=t))
                   for d, w, span, p, cap, t in ((5, 1, 1000, 4, 7, 11), (4, 2, 100, 9, 8, 13), (3, 4, 12, 20, 9, 17)))
    m = MultilevelPlan(levels=levels, coarse=DigitPacking(base=3, per_word=13, digits=10))
    assert (m.group_keys, m.digits_per_word, m.words_per_group, m.load_cap) == (12, 3, 4, 9)
    assert m.fine == SegmentedTable(seg_len=17, seg_count=3, stream=17) and m.num_groups == 10
    assert m.fine_numel == 33 * 1 + 39 * 2 + 51 * 4


def test_low_density_auto_uses_several_levels():
    L = plan_layout(1 << 24, 2, 1700, 1, 0, "multilevel", union_nnz=1700)
    assert len(L.multilevel.levels) >= 2


def test_large_fine_tables_are_grouped():
    """Fine tables past 2 * GROUP_KEYS nodes are split into groups like the value sketch; the word
    headroom still covers load_cap nodes per cell."""
    from lossless_hc.lhc import sizing as lay
    m = multilevel_plan(1 << 26, 5_368_712, 8, 1)
    lv = m.levels[0]
    assert lv.table.seg_count > 3 and lv.table.seg_count % 3 == 0
    groups = lv.table.seg_count // 3
    # as many groups as GROUP_KEYS asks for (in nodes of this size), or as the pair bound allows
    group_nodes = lay.GROUP_KEYS * 4 // (3 + lv.words_per_group)
    pair_cap = int(math.sqrt(lay.PEEL_FAILURE_TARGET * lv.planned_nodes / (7.0 * lay.PAIR_UNSOLVABLE_SHARE_SIGNS)))
    assert groups == min(math.ceil(lv.planned_nodes / group_nodes), pair_cap)
    assert max(1, lv.load_cap) * ((8 + 1) ** lv.digits_per_word - 1) < INT_FIELD_LIMIT
    # each group has room for its Binomial share plus the margin, at >= 1.25 cells per node
    assert lv.table.cells >= 1.25 * lv.planned_nodes
    # small tables keep one group; a table of one-word nodes splits past 2 * GROUP_KEYS of them
    assert multilevel_plan(1 << 22, 10_000, 4, 1).levels[0].table.seg_count == 3
    assert lay.fine_table_for(2 * lay.GROUP_KEYS, 1).seg_count == 3
    assert lay.fine_table_for(2 * lay.GROUP_KEYS + 1, 1).seg_count > 3


@pytest.mark.parametrize("shape,n,k,pattern", [((1,), 4, 20_000, "random"), ((2, 1), 3, 25_000, "clustered"),
                                               ((4,), 2, 30_000, "identical")])
def test_grouped_fine_tables_match_reference(monkeypatch, shape, n, k, pattern):
    """Grouped fine tables (made small here) decode exactly, bit-exact with the reference, the same
    with 1 and 2 threads; a fuzzed group is reported, never decoded."""
    from lossless_hc.lhc import sizing as lay
    monkeypatch.setattr(lay, "GROUP_KEYS", 2048)
    numel = 1 << 21
    L = lay.build_layout("multilevel", numel, n, k, 1, 5, None, shape)
    assert L is not None and L.multilevel.levels[-1].table.seg_count >= 6, L.multilevel
    rng = np.random.default_rng(helpers.stable_seed(shape, n, k))
    codec = helpers.codec_for(L)
    xs = helpers.make_inputs(rng, numel, 1, n, k, pattern, "normal")
    for x in xs[:2]:
        assert torch.equal(bits(codec.encode(x)), bits(reference.encode(L, x)))
    summed = helpers.sum_payloads([codec.encode(x) for x in xs], rng)
    outs = []
    for threads in (1, 2):
        codec.num_threads = threads
        y, rep = codec.decode(summed, trace=True)
        helpers.assert_lossless(L, xs, y, rep)
        outs.append(bits(y))
    assert torch.equal(outs[0], outs[1])
    yr, info = reference.decode(L, summed)
    assert helpers.peeled_ok(info) and rep.support == info["support"]
    ya, repa = codec.decode(helpers.average_payloads(summed, n), averaged=True, trace=True)
    helpers.assert_lossless(L, xs, ya, repa, averaged=True)
    # a changed word in the last group of each level: reported, and the reference agrees
    for off, lv in zip(L.level_offsets, L.multilevel.levels):
        for delta in (1.0, float(INT_FIELD_LIMIT), float("nan")):
            bad = summed.clone()
            bad[off + lv.numel - 1 - int(rng.integers(0, 3 * lv.table.seg_len * lv.words_per_group))] += delta
            _, rep = codec.decode(bad)
            assert not rep.ok and not reference.decode(L, bad)[1]["ok"]


def pair_node_inputs(L, pair, n, rng):
    """n ranks: every rank holds keys under both nodes of ``pair`` (a random child of each, so the
    patterns differ; one non-zero coordinate per key), rank 0 also under one more node whose cells
    avoid the pair's."""
    lv = L.multilevel.levels[0]
    cells, _ = reference.key_cells(lv.table, torch.arange(lv.num_nodes))
    pc = set(cells[pair[0]].tolist())
    other = next(v for v in range(lv.num_nodes) if v not in pair and not pc & set(cells[v].tolist()))
    xs = []
    for r in range(n):
        x = torch.zeros(L.numel)
        for v in list(pair) + ([other] if r == 0 else []):
            lo, hi = v * lv.span, min(L.num_keys, (v + 1) * lv.span)   # the node's keys
            k = int(rng.integers(lo, hi))
            x[k * L.block] = float(rng.standard_normal()) + 3.0
        xs.append(x)
    return xs


def test_planner_reseeds_a_table_with_an_unsolvable_pair():
    """(32 * 300 + 5 coordinates, 5 ranks, 640 non-zeros each, block 32, seed 3): the seed's own
    stream hashes fine nodes 15 and 36 (of 43) to the same three cells with proportional signs, so
    every aggregate holding both failed index peeling (164 of 200 data seeds). The planner takes
    another stream for that table, with the same sizes: data holding both nodes decodes exactly, the
    seed's own layout reports the failure, and a rank left on it fails the fingerprint check instead
    of adding into other cells."""
    numel, n, max_nnz, block, seed = 32 * 300 + 5, 5, 640, 32, 3
    codec = LosslessCodec(numel, n, max_nnz, block_size=block, seed=seed, index="multilevel")
    planned = codec.layout
    shape = tuple(lv.words_per_group for lv in planned.multilevel.levels)
    raw = build_layout("multilevel", numel, n, max_nnz, block, seed, None, shape)
    lv, lv_raw = planned.multilevel.levels[0], raw.multilevel.levels[0]
    assert helpers.colliding_pairs(lv_raw.table, lv_raw.num_nodes)[1] == [(15, 36)]
    assert unsolvable_pairs(lv_raw.table, lv_raw.num_nodes) == 1
    assert planned.reseeded == (0, 1) and lv.table.stream != lv_raw.table.stream
    assert helpers.colliding_pairs(lv.table, lv.num_nodes)[1] == [] and unsolvable_pairs(lv.table, lv.num_nodes) == 0
    assert planned.payload_numel == raw.payload_numel and planned.fingerprint != raw.fingerprint
    seed_codec = helpers.codec_for(raw)
    rng = np.random.default_rng(helpers.stable_seed("reseeded fine table"))
    for _ in range(3):
        xs = pair_node_inputs(raw, (15, 36), n, rng)
        summed = helpers.sum_payloads([codec.encode(x) for x in xs], rng)
        y, rep = codec.decode(summed, trace=True, error_bounds=True)
        assert helpers.peeled_ok(rep), rep.reason
        helpers.assert_lossless(planned, xs, y, rep)
        assert torch.equal(bits(codec.encode(xs[0])), bits(reference.encode(planned, xs[0])))
        _, rep = seed_codec.decode(helpers.sum_payloads([seed_codec.encode(x) for x in xs], rng))
        assert rep.status == DecodeStatus.INDEX_PEEL_FAILED, rep.reason
        mixed = [(seed_codec if r == 0 else codec).encode(x) for r, x in enumerate(xs)]
        _, rep = codec.decode(helpers.sum_payloads(mixed, rng))
        assert not rep.ok and "mismatch" in rep.reason, rep.reason


@pytest.mark.parametrize("n", [2, 5])
def test_fine_table_pairs_solved_or_reported(n):
    """Two non-zero nodes sharing all three cells of a fine table: solved exactly (C++ and the
    reference agree) unless their signs are proportional, then 'index peeling failed' on both; a
    solved pair's cells, corrupted, are reported, never decoded."""
    from lossless_hc.lhc.sizing import build_layout
    L = build_layout("multilevel", 400_000, n, 40, 1, 3, None, (1,))
    assert L is not None and len(L.multilevel.levels) == 1
    solvable, proportional = helpers.colliding_pairs(L.multilevel.levels[0].table, L.multilevel.levels[0].num_nodes)
    assert solvable and proportional, "no colliding node pairs of both kinds: pick another seed"
    codec = helpers.codec_for(L)
    rng = np.random.default_rng(helpers.stable_seed("finepair", n))
    for pair in solvable[:4]:
        xs = pair_node_inputs(L, pair, n, rng)
        payloads = [codec.encode(x) for x in xs]
        assert torch.equal(bits(payloads[0]), bits(reference.encode(L, xs[0])))
        summed = helpers.sum_payloads(payloads, rng)
        for averaged in (False, True):
            payload = helpers.average_payloads(summed, n) if averaged else summed
            y, rep = codec.decode(payload, averaged=averaged, trace=True)
            _, info = reference.decode(L, payload, averaged=averaged)
            assert rep.ok and info["ok"], (rep.reason, info["reason"])
            helpers.assert_lossless(L, xs, y, rep, averaged=averaged)
        # Corrupt one word by an even amount (still an integer, still divisible by det = +-2) in a
        # cell whose relative sign s_j(a) s_j(b) another of the pair's cells shares: the two cells
        # then disagree, whichever two of the three solve the pair. (The one cell with the other
        # relative sign is the pair's only equation of its kind: a change there shifts both patterns
        # consistently, and only the range or the expansion checks can catch it, as for a pure cell.)
        lv = L.multilevel.levels[0]
        cells, signs = reference.key_cells(lv.table, torch.tensor(list(pair)))
        rel = (signs[0] * signs[1]).tolist()
        j = next(j for j in range(3) if rel.count(rel[j]) == 2)
        bad = summed.clone()
        bad[L.level_offsets[0] + int(cells[0, j]) * lv.words_per_group] += 2.0
        _, rep = codec.decode(bad)
        _, info = reference.decode(L, bad)
        assert not rep.ok and not info["ok"]
        assert "index corrupt" in rep.reason and "index corrupt" in info["reason"], (rep.reason, info["reason"])
    for pair in proportional[:2]:
        xs = pair_node_inputs(L, pair, n, rng)
        summed = helpers.sum_payloads([codec.encode(x) for x in xs], rng)
        _, rep = codec.decode(summed)
        _, info = reference.decode(L, summed)
        assert not rep.ok and rep.reason.startswith("index peeling failed"), rep.reason
        assert info["reason"] == "index peeling failed"


def test_a_solved_fine_pair_s_third_cell_is_checked():
    """A solved pair of fine nodes is computed from two of its cells (pair_cells: the largest |det|);
    its patterns must also explain the third. Moving only that third cell by one leaves the solved
    patterns, hence the support and the index checksum, as they were: only that consistency check sees
    it, and the C++ decoder and the reference report INDEX_CORRUPT."""
    n = 2
    L = build_layout("multilevel", 400_000, n, 40, 1, 3, None, (1,))
    lv = L.multilevel.levels[0]
    solvable, _ = helpers.colliding_pairs(lv.table, lv.num_nodes)
    codec = helpers.codec_for(L)
    rng = np.random.default_rng(helpers.stable_seed("finepair third cell"))
    for pair in solvable[:4]:
        xs = pair_node_inputs(L, pair, n, rng)
        summed = helpers.sum_payloads([codec.encode(x) for x in xs], rng)
        _, rep = codec.decode(summed)
        assert rep.ok, rep.reason
        cells, signs = reference.key_cells(lv.table, torch.tensor(list(pair)))
        p, q, det = pair_cells(signs[0].tolist(), signs[1].tolist())
        assert det != 0
        third = L.level_offsets[0] + int(cells[0, 3 - p - q]) * lv.words_per_group
        for delta in (1.0, -1.0):
            bad = summed.clone()
            bad[third] += delta
            _, rep = codec.decode(bad)
            _, info = reference.decode(L, bad)
            assert rep.status == DecodeStatus.INDEX_CORRUPT, (pair, delta, rep.reason)
            assert info["reason"] == "index corrupt: a solved fine pair is not a pair of node patterns", info["reason"]


@pytest.mark.parametrize("num_keys,union,n,shape", [
    (1_000_000, 1000, 4, (1,)), (1_000_000, 1000, 4, (1, 2)), (5000, 5000, 2, (3,)), (100_000, 300, 255, (2,)),
    (10_000_000, 100_000, 16, (2, 1, 1)), (1000, 1000, 1, (4,)), (100_000, 40, 3, (1,)), (1_000_000, 10, 2 ** 11, (1,)),
    (100_000, 0, 4, (1, 1)), (300, 300, 7, (5, 1, 2, 1)), (9_605, 3200, 5, (1,)), (50_000, 2400, 8, (2, 3))])
def test_multilevel_plan_is_the_documented_rule(num_keys, union, n, shape):
    """Every level of multilevel_plan meets its docstring's rule, finest first: a span of the level below's
    span * w * words, its planned nodes expected_nonzero_groups(ceil(num_keys / span), union), its table
    fine_table_for(planned, words, mix64(seed_stream + depth)) (one 3-cell table for none), a load cap that
    is the fewest nodes per cell (1 to planned) whose overflow over every cell is at most
    FINE_OVERFLOW_TARGET, and load_cap * ((n + 1)^w - 1) below 2**22; the coarse bitmap counts the top
    level's nodes. For one and several levels, no non-zero keys, bases from 2 to 2**21 + 1."""
    from lossless_hc.lhc.layout import SegmentedTable, digit_packing, mix64
    from lossless_hc.lhc.sizing import FINE_OVERFLOW_TARGET, _poisson_tail, expected_nonzero_groups, fine_table_for
    plan = multilevel_plan(num_keys, union, n, shape, seed_stream=11)
    assert plan is not None and tuple(lv.words_per_group for lv in plan.levels) == shape
    below = 1
    for depth, lv in enumerate(reversed(plan.levels)):
        stream, w, planned = mix64(11 + depth), lv.digits_per_word, lv.planned_nodes
        assert lv.span == below * w * lv.words_per_group and lv.num_nodes == -(-num_keys // lv.span)
        assert planned == expected_nonzero_groups(lv.num_nodes, union)
        if planned == 0:
            assert (lv.table, lv.load_cap) == (SegmentedTable(seg_len=1, seg_count=3, stream=stream), 0)
        else:
            assert lv.table == fine_table_for(planned, lv.words_per_group, stream)
            lam = planned / (lv.table.seg_count // 3 * lv.table.seg_len)

            def enough(cap):
                return cap == planned or lv.table.cells * _poisson_tail(lam, cap) <= FINE_OVERFLOW_TARGET
            assert 1 <= lv.load_cap <= planned and enough(lv.load_cap)
            assert lv.load_cap == 1 or not enough(lv.load_cap - 1)
        assert max(1, lv.load_cap) * ((n + 1) ** w - 1) < INT_FIELD_LIMIT
        below = lv.span
    assert plan.coarse == digit_packing(n, plan.levels[0].num_nodes)
    assert plan.levels[-1].span == plan.levels[-1].digits_per_word * shape[-1]


@pytest.mark.parametrize("n,w", [(1, 22), (3, 11), (4, 9), (2047, 2), (2 ** 21, 1), (2 ** 22 - 1, 1)])
def test_a_fine_level_of_one_non_zero_node_packs_every_digit_a_word_holds(n, w):
    """One non-zero key plans one non-zero node per level, so a cell holds at most one pattern (load cap
    1): a word packs the most base-(n+1) digits below 2**22 -- 22 for one rank, 11 for three (4^11 = 2**22
    itself still fits: a digit is at most n), one for 2**22 - 1 ranks."""
    plan = multilevel_plan(1_000_000, 1, n, 1)
    (lv,) = plan.levels
    assert (lv.planned_nodes, lv.load_cap, lv.digits_per_word, lv.span) == (1, 1, w, w)
    assert (n + 1) ** w - 1 < INT_FIELD_LIMIT <= (n + 1) ** (w + 1) - 1


def test_multilevel_plan_refuses_what_it_cannot_build():
    """None for no keys, no level or more than MAX_FINE_LEVELS (4), a level of fewer than one word, a base
    n + 1 past 2**22, or no w that the load cap leaves room for; four levels and a base of exactly 2**22
    (one non-zero key) are built."""
    assert multilevel_plan(0, 0, 2, 1) is None and multilevel_plan(-5, 1, 2, 1) is None
    assert multilevel_plan(100, 5, 2, ()) is None and multilevel_plan(100, 5, 2, (1,) * 5) is None
    assert multilevel_plan(100, 5, 2, 0) is None and multilevel_plan(100, 5, 2, (2, 0)) is None
    assert multilevel_plan(100, 5, INT_FIELD_LIMIT, 1) is None
    assert len(multilevel_plan(100, 5, 2, (1,) * 4).levels) == 4
    assert len(multilevel_plan(100, 5, 2, (1, 1)).levels) == 2
    assert multilevel_plan(100, 1, INT_FIELD_LIMIT - 1, 1).levels[0].digits_per_word == 1
    # two nodes to a cell could overflow even a one-digit word of base 2**21 + 1
    assert multilevel_plan(1_000_000, 10, 2 ** 21, 1) is None
    assert multilevel_plan(1, 1, 2, 1).levels[0].num_nodes == 1


@pytest.mark.parametrize("to", ["negative", "limit", "two words"])
def test_a_solved_fine_pair_must_be_a_pair_of_patterns(to):
    """A solved pair of fine nodes whose three cells agree on a pattern that no node has -- -1, or
    base**digits_per_word (one past the word's digits) -- is refused as such by the reference: its
    cells are consistent, only the range of a node pattern tells it apart. A pattern word of 0 is a
    pattern (two words per node, one rank holding one child of each: one word of each node is 0), solved
    and decoded."""
    from lossless_hc.lhc.reference_peel import pair_numerators
    n = 1 if to == "two words" else 2
    L = build_layout("multilevel", 400_000, n, 40, 1, 3, None, (2,) if to == "two words" else (1,))
    lv = L.multilevel.levels[0]
    solvable, _ = helpers.colliding_pairs(lv.table, lv.num_nodes)
    rng = np.random.default_rng(helpers.stable_seed("finepair range", to))
    pair = solvable[0]
    xs = pair_node_inputs(L, pair, n, rng)
    summed = sum(reference.encode(L, x) for x in xs)
    assert reference.decode(L, summed)[1]["ok"]
    if to == "two words":
        assert lv.words_per_group == 2
        return
    cells, signs = reference.key_cells(lv.table, torch.tensor(list(pair)))
    at = L.level_offsets[0] + cells[0] * lv.words_per_group
    num_a, _, det = pair_numerators(summed[at].to(torch.int64).reshape(3, 1), torch.arange(3), signs[0], signs[1])
    pa = int(num_a) // det
    want = -1 if to == "negative" else L.index.base ** lv.digits_per_word
    bad = summed.clone()
    bad[at] += (signs[0] * (want - pa)).to(torch.float32)
    assert reference.decode(L, bad)[1]["reason"] == "index corrupt: a solved fine pair is not a pair of node patterns"
