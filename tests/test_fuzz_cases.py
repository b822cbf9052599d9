"""What the fuzzer's case generators draw (lossless_hc.fuzz.cases, lossless_hc.fuzz.thc_cases): a kind of case
they stop drawing, or draw from a smaller range than their docs say, passes every other test while the fuzz
runs check less."""
import random
from types import SimpleNamespace

import pytest
import torch

from lossless_hc.fuzz import thc_cases
from lossless_hc.fuzz.thc_cases import run_thc_group
from lossless_hc.thc import THCCodec


def test_a_thc_word_bit_flips_one_bit_of_one_word_and_reaches_every_bit_and_word():
    """THC's "word_bit" corruption changes exactly one bit of one 64-bit word, of a copy, in either word type;
    over 2000 draws every word and every bit, the sign bit included, is reached."""
    for dtype in (torch.float64, torch.int64):
        codec = THCCodec(3, 2, initial_norm=1.0, payload_dtype=dtype)
        clean = torch.arange(9, dtype=dtype) * 3
        kept = clean.clone()
        rng, words, bits = random.Random(0), set(), set()
        for _ in range(2000):
            diff = thc_cases._corrupt("word_bit", clean, codec, rng).view(torch.int64) ^ clean.view(torch.int64)
            changed = diff.nonzero().flatten().tolist()
            assert len(changed) == 1, changed
            flipped = int(diff[changed[0]]) % 2 ** 64
            assert flipped & (flipped - 1) == 0
            words.add(changed[0])
            bits.add(flipped.bit_length() - 1)
        assert torch.equal(clean, kept)
        assert words == set(range(9)) and bits == set(range(64)), dtype


def test_thc_sums_draw_both_word_types_and_averages_float64_words(monkeypatch):
    """A THC group's SUM runs on float64 or int64 words, an AVERAGE on float64 only (int64 words survive a SUM
    only): the first 60 groups draw all three."""
    dtypes, seen = [], set()
    monkeypatch.setattr(thc_cases, "THCCodec", lambda *a, **kw: dtypes.append(kw["payload_dtype"]) or THCCodec(*a, **kw))
    for group in range(60):
        dtypes.clear()
        how = run_thc_group(0, group)[0].how
        seen |= {(how, dtype) for dtype in dtypes}
    assert seen == {("thc_sum", torch.float64), ("thc_sum", torch.int64), ("thc_average", torch.float64)}


def test_a_thc_norm_huge_sets_one_norm_slot_and_reaches_each():
    """THC's "norm_huge" corruption sets one rank's norm slot (layout.norm_offset + r, nothing before or after
    it) to 1e300, as a float64 word or as an int64 word's float64 bits; over 200 draws every rank's slot."""
    for dtype in (torch.float64, torch.int64):
        codec = THCCodec(3, 5, initial_norm=1.0, payload_dtype=dtype)
        first = codec.layout.norm_offset
        clean = torch.zeros(codec.layout.words_offset + 2, dtype=dtype)
        rng, slots = random.Random(0), set()
        for _ in range(200):
            changed = (thc_cases._corrupt("norm_huge", clean, codec, rng) != clean).nonzero().flatten().tolist()
            assert len(changed) == 1 and first <= changed[0] < first + 5, changed
            slots.add(changed[0])
        assert slots == set(range(first, first + 5))
        p = thc_cases._corrupt("norm_huge", clean, codec, random.Random(1))
        assert float(p[first:first + 5].view(torch.float64).max()) == 1e300


def test_a_thc_groups_clean_aggregate_sums_every_rank_quantized_from_the_largest_norm(monkeypatch):
    """A THC group's ranks quantize from the agreed initial_norm, the largest of their inputs' norms, and its
    clean case decodes the SUM of every rank's payload (an AVERAGE: divided by n), once each."""
    log = []

    class Recording(THCCodec):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            log.append(("codec", kwargs["initial_norm"]))

        def encode(self, x, *args, **kwargs):
            log.append(("encode", float(x.double().norm()), super().encode(x, *args, **kwargs).clone()))
            return log[-1][2]

        def decode(self, payload, averaged=False, out=None):
            log.append(("decode", payload.clone(), averaged))
            return super().decode(payload, averaged=averaged, out=out)
    monkeypatch.setattr(thc_cases, "THCCodec", Recording)
    for group in range(8):
        log.clear()
        clean = run_thc_group(0, group)[0]
        ranks = []
        for entry in log:
            if entry[0] == "decode":
                break
            if entry[0] == "encode":
                ranks.append(entry)
        decoded = next(entry for entry in log if entry[0] == "decode")
        n = len(ranks) - 1   # and rank 0 again, on the codec that decodes
        total = ranks[0][2].clone()
        for entry in ranks[1:n]:
            total += entry[2]
        assert decoded[2] == (clean.how == "thc_average")
        assert torch.equal(decoded[1], total / n if decoded[2] else total), group
        assert {entry[1] for entry in log if entry[0] == "codec"} == {max(entry[1] for entry in ranks[:n]) or 1.0}


def test_case_1_decodes_with_verify_in_every_fourth_group_and_corruptions_always():
    """The module doc's schedule: case 0 with the codec's defaults, case 1 with verify=True in groups 0, 4, 8, ..
    (VERIFY_PLAIN_EVERY) only, cases 2 and 3 (the corrupted ones) always with verify=True."""
    from lossless_hc.fuzz.cases import VERIFY_PLAIN_EVERY, group_cases
    assert VERIFY_PLAIN_EVERY == 4
    for group in range(9):
        _, codec, cases = group_cases(0, group)
        assert [(case, c.verify) for case, _, c, _, _ in cases] == \
            [(0, False), (1, group % 4 == 0), (2, True), (3, True)], group
        assert not codec.verify


def test_a_codec_without_an_rtol_is_refused_unless_one_is_given():
    """The contract's tolerance is the codec's own rtol, or --rtol; a codec stating none cannot be judged, and
    says to pass --rtol (rather than judging with a tolerance it made up)."""
    from lossless_hc.fuzz.cases import codec_rtol
    assert codec_rtol(SimpleNamespace(rtol=2.0 ** -10), None) == 2.0 ** -10
    assert codec_rtol(SimpleNamespace(rtol=2.0 ** -10), 0) == 0.0
    assert codec_rtol(SimpleNamespace(), 1e-3) == 1e-3
    with pytest.raises(RuntimeError, match="pass --rtol"):
        codec_rtol(SimpleNamespace(), None)


@pytest.mark.parametrize("how", ["index_bit", "sketch_bit", "header_bit"])
def test_an_lhc_bit_flip_flips_one_bit_of_one_word_of_its_region_and_reaches_every_bit(how):
    """LHC's bit corruptions change exactly one bit of one 32-bit word of a copy, in the index words, the
    sketch words or the header fields as named; over 1500 draws every bit, the sign bit included."""
    from lossless_hc.fuzz.cases import _corrupt
    from lossless_hc.lhc.codec import LosslessCodec
    from lossless_hc.lhc.layout import HEADER_FIELDS
    codec = LosslessCodec(64, 2, 8, 1, index="bitmap", verify=True)
    L = codec.layout
    lo, hi = {"index_bit": (HEADER_FIELDS, L.sketch_offset), "sketch_bit": (L.sketch_offset, L.payload_numel),
              "header_bit": (0, HEADER_FIELDS)}[how]
    assert 0 <= lo < hi
    clean = torch.arange(L.payload_numel, dtype=torch.float32)
    kept = clean.clone()
    rng, words, bits = random.Random(0), set(), set()
    for _ in range(1500):
        diff = _corrupt(how, clean, codec, rng).view(torch.int32) ^ clean.view(torch.int32)
        changed = diff.nonzero().flatten().tolist()
        assert len(changed) == 1 and lo <= changed[0] < hi, changed
        flipped = int(diff[changed[0]]) % 2 ** 32
        assert flipped & (flipped - 1) == 0
        words.add(changed[0])
        bits.add(flipped.bit_length() - 1)
    assert torch.equal(clean, kept)
    assert bits == set(range(32)) and len(words) > (hi - lo) // 2


def test_the_other_lhc_corruptions_change_what_they_name():
    """"zero_sketch" zeroes every sketch word and nothing else; "wrong_sum" moves one sketch word; "header_keys"
    moves the key count's low field by exactly 1, either way over 50 draws."""
    from lossless_hc.fuzz.cases import _corrupt
    from lossless_hc.lhc.codec import LosslessCodec
    from lossless_hc.lhc.layout import HDR_KEYS_LO
    codec = LosslessCodec(64, 2, 8, 1, index="bitmap", verify=True)
    L = codec.layout
    clean = torch.arange(L.payload_numel, dtype=torch.float32) + 1
    p = _corrupt("zero_sketch", clean, codec, random.Random(0))
    assert (p != clean).nonzero().flatten().tolist() == list(range(L.sketch_offset, L.payload_numel))
    assert not p[L.sketch_offset:].any()
    rng, moves = random.Random(0), set()
    for _ in range(50):
        changed = (_corrupt("wrong_sum", clean, codec, rng) != clean).nonzero().flatten().tolist()
        assert len(changed) == 1 and L.sketch_offset <= changed[0] < L.payload_numel, changed
        p = _corrupt("header_keys", clean, codec, rng)
        assert (p != clean).nonzero().flatten().tolist() == [HDR_KEYS_LO]
        moves.add(float(p[HDR_KEYS_LO] - clean[HDR_KEYS_LO]))
    assert moves == {1.0, -1.0}


def test_each_support_kind_draws_what_it_names():
    """_supports: "shared" gives every rank the same k keys, "hot" k keys each from one pool of 2k (heavy
    overlap, not identical), "disjoint" min(k, keys / n) keys each that no other rank holds, "independent" k
    keys each drawn apart (more distinct keys than a pool of 2k)."""
    from lossless_hc.fuzz.cases import _supports
    n, k, num_keys = 8, 6, 1000
    drawn = {kind: _supports(SimpleNamespace(keys_per_rank=k, world_size=n, support=kind), random.Random(1), num_keys)
             for kind in ("shared", "hot", "disjoint", "independent")}
    for kind, supports in drawn.items():
        assert len(supports) == n and all(len(set(keys)) == len(keys) == k for keys in supports), kind
        assert all(0 <= key < num_keys for keys in supports for key in keys), kind
    assert all(keys == drawn["shared"][0] for keys in drawn["shared"])
    hot = [set(keys) for keys in drawn["hot"]]
    assert len(set().union(*hot)) <= 2 * k and len({frozenset(keys) for keys in hot}) > 1
    assert len(set().union(*map(set, drawn["disjoint"]))) == n * k
    assert len(set().union(*map(set, drawn["independent"]))) > 2 * k
    few = _supports(SimpleNamespace(keys_per_rank=k, world_size=n, support="disjoint"), random.Random(1), 20)
    assert [len(keys) for keys in few] == [20 // n] * n and len(set().union(*map(set, few))) == n * (20 // n)


@pytest.mark.parametrize("kind", ["normal", "range", "integers", "big_small", "cancel", "near_cancel"])
def test_each_value_kind_draws_both_signs_over_its_range(kind):
    """_values: every kind draws positive and negative values; "range" (and the cancelling kinds' base values)
    log-uniform over range_decades decades centred on 1, "big_small" ones and a few 10^(4 + decades / 2),
    "integers" -8 to 8."""
    from lossless_hc.fuzz.cases import _values
    g = SimpleNamespace(values=kind, range_decades=10.0)
    v = _values(g, random.Random(0), 4000, torch.Generator().manual_seed(0))
    assert v.dtype == torch.float64 and v.shape == (4000,)
    assert bool((v > 0).any()) and bool((v < 0).any())
    m = v.abs()
    if kind in ("range", "cancel", "near_cancel"):
        assert float(m.min()) >= 1e-5 and float(m.max()) <= 1e5
        assert float(m.min()) < 1e-4 and float(m.max()) > 1e4 and 0.4 < float((m < 1).double().mean()) < 0.6
    elif kind == "big_small":
        assert set(m.unique().tolist()) == {1.0, 1e9} and 0.01 < float((m > 1).double().mean()) < 0.03
    elif kind == "integers":
        assert set(v.unique().tolist()) == set(range(-8, 9))
    else:
        assert 0.9 < float(v.std()) < 1.1 and abs(float(v.mean())) < 0.1


def test_every_cancelling_group_cancels_on_rank_0s_support():
    """In every "cancel" and "near_cancel" group (and in no other) ranks cancel on rank 0's keys: with 2 ranks
    rank 1 holds -x0 (near: -(1 + 2^-20) x0); with 3 (only where n >= 3) rank 1 holds a share of x0 up to 3x
    either way and rank 2 the rest, so the three sum to 0 (near: -2^-20 x0) up to their float32 roundings."""
    from lossless_hc.fuzz.cases import draw_group
    ranks = set()
    for group in range(300):
        g = draw_group(0, group)
        if g.values not in ("cancel", "near_cancel"):
            assert g.cancel_ranks == 0
            continue
        assert g.cancel_ranks in ((2, 3) if g.world_size >= 3 else (2,)), (group, g.cancel_ranks)
        ranks.add((g.cancel_ranks, g.world_size == 3))
        x = [t.double() for t in g.xs[:g.cancel_ranks]]
        held = (x[0] != 0) & x[0].isfinite() & (x[0].abs() < 1e29) & x[1].isfinite()
        if g.dtype != torch.float32 or not bool(held.any()):
            continue
        x = [t[held] for t in x]
        near = 2.0 ** -20 if g.values == "near_cancel" else 0.0
        if g.cancel_ranks == 2:
            assert bool(((x[1] / x[0] + 1 + near).abs() <= 2.0 ** -23).all()), group
        else:
            share = x[1] / x[0]
            assert bool((share.abs() <= 3).all() and (share != 0).all()), group
            residue = x[0] + x[1] + x[2] + near * x[0]
            assert bool((residue.abs() <= 2.0 ** -22 * (x[0].abs() + x[1].abs() + x[2].abs())).all()), group
    assert ranks == {(2, False), (3, False), (2, True), (3, True)}


def test_a_thc_level_corruption_moves_one_level_word_or_zeroes_them_all():
    """THC's "level_off" moves one level word by a non-zero integer of up to 2^20, either way (exact in either
    word type); "zero_levels" zeroes every level word and nothing before them."""
    codec = THCCodec(3, 2, initial_norm=1.0, payload_dtype=torch.int64)
    first = codec.layout.words_offset
    clean = torch.arange(first + 4, dtype=torch.int64) + 7
    rng, moves = random.Random(0), []
    for _ in range(300):
        p = thc_cases._corrupt("level_off", clean, codec, rng)
        changed = (p != clean).nonzero().flatten().tolist()
        assert len(changed) == 1 and changed[0] >= first, changed
        moves.append(int(p[changed[0]] - clean[changed[0]]))
    assert all(0 < abs(m) <= 2 ** 20 for m in moves) and min(moves) < -2 ** 19 and max(moves) > 2 ** 19
    p = thc_cases._corrupt("zero_levels", clean, codec, rng)
    assert torch.equal(p[:first], clean[:first]) and not p[first:].any()


def test_cancelling_ranks_keep_their_own_keys_off_rank_0s_support():
    """The cancellation rewrites ranks 1 (and 2) on rank 0's keys only: in a "disjoint" group they still hold
    their own keys off rank 0's support, and ranks 1 and 2 none in common there."""
    from lossless_hc.fuzz.cases import draw_group
    checked = 0
    for group in range(300):
        g = draw_group(0, group)
        if not g.cancel_ranks or g.support != "disjoint" or g.non_finite or g.dtype != torch.float32:
            continue
        off = g.xs[0] == 0
        if g.keys_per_rank == 0 or -(-g.numel // g.block) // g.world_size == 0:
            continue
        assert all(bool((g.xs[r][off] != 0).any()) for r in range(1, g.cancel_ranks)), group
        if g.cancel_ranks == 3:
            assert not bool(((g.xs[1] != 0) & (g.xs[2] != 0) & off).any()), group
        checked += 1
    assert checked >= 3
