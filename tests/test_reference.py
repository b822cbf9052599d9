"""The oracle itself: the torch reference hash family against an independent pure-Python-int mirror,
and the reference encoder/decoder round trip."""
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import helpers
from lossless_hc.lhc import layout as lay
from lossless_hc.lhc import reference as reference
from lossless_hc.lhc.layout import SegmentedTable
from lossless_hc.lhc.cost_model import plan_layout

M64 = (1 << 64) - 1


def py_key_cells(t: SegmentedTable, key: int):
    """lhc::key_cells written with unbounded Python ints and explicit masks (independent of torch)."""
    h = lay.mix64(key ^ t.stream)
    r32 = lambda v, n: ((v & 0xFFFFFFFF) * n) >> 32
    start = 3 * r32(h >> 32, t.seg_count // 3)
    out = []
    for j in range(3):
        hj = lay.mix64((h + 0x9E3779B97F4A7C15 * (j + 1)) & M64)
        magnitude = 1 + (hj >> 62 & 1) if t.weighted else 1
        out.append(((start + j) * t.seg_len + r32(hj, t.seg_len), -magnitude if hj >> 63 else magnitude))
    return out


def py_unmix64(z: int) -> int:
    """The inverse of ``lay.mix64`` (each step of splitmix64's finalizer is a bijection on 64 bits)."""
    z ^= z >> 31 ^ z >> 62
    z = z * pow(0x94D049BB133111EB, -1, 1 << 64) & M64
    z ^= z >> 27 ^ z >> 54
    z = z * pow(0xBF58476D1CE4E5B9, -1, 1 << 64) & M64
    return z ^ z >> 30 ^ z >> 60


def key_with_first_hash(t: SegmentedTable, hj: int) -> int:
    """The key whose hash ``h0 = mix64(h + golden)`` in ``t`` is exactly ``hj``."""
    return py_unmix64((py_unmix64(hj) - 0x9E3779B97F4A7C15) & M64) ^ t.stream


def to_i64(v: int) -> int:
    return v - (1 << 64) if v >= (1 << 63) else v


def test_mix64_known_vector():
    # splitmix64 seeded with 0: the first output is mix64(0x9e3779b97f4a7c15) = 0xe220a8397b1dcdaf.
    assert lay.mix64(0x9E3779B97F4A7C15) == 0xE220A8397B1DCDAF
    z = torch.tensor([to_i64(0x9E3779B97F4A7C15), 0, -1], dtype=torch.int64)
    got = [v & M64 for v in reference.mix64(z).tolist()]
    assert got == [0xE220A8397B1DCDAF, lay.mix64(0), lay.mix64(M64)]


@pytest.mark.parametrize("table", [
    SegmentedTable(seg_len=7, seg_count=3, stream=12345),
    SegmentedTable(seg_len=7, seg_count=3, stream=12345, weighted=True),
    SegmentedTable(seg_len=1, seg_count=3, stream=0),
    SegmentedTable(seg_len=(1 << 32) - 1, seg_count=3, stream=M64 - 4),      # reduce32 product near 2**64
    SegmentedTable(seg_len=1000, seg_count=12, stream=(1 << 63) + 7),      # 4 groups of 3 sub-tables
    SegmentedTable(seg_len=1000, seg_count=12, stream=(1 << 63) + 7, weighted=True),
    SegmentedTable(seg_len=3, seg_count=3 * (1 << 20), stream=lay.stream_seed(3, lay.SALT_BLOOM)),
])
def test_key_cells_matches_python_ints(table):
    rng = np.random.default_rng(0)
    keys = [int(k) for k in rng.integers(0, 1 << 63, size=300, dtype=np.uint64)]
    keys += [int(k) | (1 << 63) for k in rng.integers(0, 1 << 63, size=100, dtype=np.uint64)]
    keys += list(range(64)) + [M64, (1 << 63), (1 << 32) - 1, 1 << 32]
    # the sign's edges: a hash of 0 (top bit clear: positive) and of all ones (top bit set: negative)
    keys += [key_with_first_hash(table, 0), key_with_first_hash(table, M64)]
    cells, weights = reference.key_cells(table, torch.tensor([to_i64(k) for k in keys], dtype=torch.int64))
    assert cells.shape == (len(keys), 3) and weights.shape == (len(keys), 3)
    for i, k in enumerate(keys):
        assert [(int(cells[i, j]), int(weights[i, j])) for j in range(3)] == py_key_cells(table, k), k
    # the documented invariants: cell j in segment 3 g + j of the key's group g, all cells in range,
    # weights +-1, +-2 (all four; signs +-1 unweighted), and with several groups every group used
    seg = cells // table.seg_len
    assert bool((seg[:, 0] % 3 == 0).all())
    assert bool((seg[:, 1] == seg[:, 0] + 1).all()) and bool((seg[:, 2] == seg[:, 0] + 2).all())
    groups_hit = seg[:, 0].unique().numel()
    assert groups_hit == table.seg_count // 3 if table.seg_count <= 12 else groups_hit > 100
    assert int(cells.min()) >= 0 and int(cells.max()) < table.cells
    assert set(weights.unique().tolist()) == ({-2, -1, 1, 2} if table.weighted else {-1, 1})


def test_key_cells_rejects_bad_table():
    with pytest.raises(ValueError, match=r"needs 0 <= n < 2\*\*32"):   # a segment longer than 32-bit cells reach
        reference.key_cells(SegmentedTable(seg_len=1 << 32, seg_count=3, stream=0), torch.arange(3))
    with pytest.raises(ValueError, match="seg_count must be a positive multiple of 3"):
        reference.key_cells(SegmentedTable(seg_len=5, seg_count=10, stream=0), torch.arange(3))
    # no segments: every key's cells would lie outside the table's 0 cells
    with pytest.raises(ValueError, match="seg_count must be a positive multiple of 3"):
        reference.key_cells(SegmentedTable(seg_len=5, seg_count=0, stream=0), torch.arange(3))


def test_s64_is_the_two_s_complement_of_the_64_bits():
    """``hashing.s64`` at its edges: 2**63 is the most negative int64 (a stream or constant of that pattern
    would otherwise stay a Python int outside int64); values past 2**64 (key_cells' ``golden * (j + 1)``)
    reduce mod 2**64 first."""
    from lossless_hc.lhc.hashing import s64
    assert [s64(v) for v in (0, (1 << 63) - 1, 1 << 63, (1 << 64) - 1, 1 << 64)] == \
        [0, (1 << 63) - 1, -(1 << 63), -1, 0]
    assert [s64(v) for v in (3 << 63, (1 << 65) - 1, 0x9E3779B97F4A7C15 * 3)] == \
        [-(1 << 63), -1, to_i64(0x9E3779B97F4A7C15 * 3 & M64)]


def test_reduce32_covers_its_whole_range_of_n():
    """``hashing.reduce32(h, n)`` for every ``0 <= n < 2**32``: ``n = 0`` maps every hash to 0, the
    largest n keeps the exact ``((h & 0xffffffff) * n) >> 32``; any n outside is refused."""
    from lossless_hc.lhc.hashing import reduce32
    hs = [0, 1, -1, (1 << 32) - 1, 1 << 40, -(1 << 63), (1 << 63) - 1]
    h = torch.tensor(hs, dtype=torch.int64)
    assert reduce32(h, 0).tolist() == [0] * len(hs)
    n = (1 << 32) - 1
    assert reduce32(h, n).tolist() == [((v & 0xFFFFFFFF) * n) >> 32 for v in hs]
    for bad in (-1, 1 << 32):
        with pytest.raises(ValueError, match=r"reduce32 needs 0 <= n < 2\*\*32"):
            reduce32(h, bad)


def test_peel_rounds_stops_at_two_core():
    # keys 0 and 1 share all three cells (a 2-core); key 2 is free and peels; key 3 hangs off key 2
    cells = torch.tensor([[0, 1, 2], [0, 1, 2], [3, 4, 5], [5, 6, 7]])
    rounds, resolved = reference.peel_rounds(cells, 8)
    assert resolved.tolist() == [False, False, True, True]
    assert sum(r[0].numel() for r in rounds) == 2


def ref_report(info):
    return SimpleNamespace(ok=info["ok"], reason=info["reason"], trace=info["trace"], support=info["support"])


@pytest.mark.parametrize("index", ["bitmap", "bloom", "dense"])
@pytest.mark.parametrize("block", [1, 3])
@pytest.mark.parametrize("pattern", helpers.PATTERNS)
def test_reference_round_trip(index, block, pattern):
    rng = np.random.default_rng(helpers.stable_seed(index, block, pattern))
    n, numel, k = 5, 997, 12
    L = plan_layout(numel, n, k * block, block, seed=11, index=index)
    assert L.index_kind == index
    xs = helpers.make_inputs(rng, numel, block, n, k, pattern, "normal", zero_lanes=0.3)
    summed = helpers.sum_payloads([reference.encode(L, x) for x in xs], rng, "tree")
    y, info = reference.decode(L, summed)
    helpers.assert_lossless(L, xs, y, ref_report(info))


def test_reference_bloom_false_positives_are_exact_zeros():
    # a Bloom filter sized for 16 ranks x 40 keys, every rank holding its 40 (634 distinct of 640):
    # at that load plenty of candidates are false positives (154 of 788 measured); each must get
    # count 0 and output exactly 0.
    rng = np.random.default_rng(5)
    n, numel, k = 16, 20000, 40
    L = plan_layout(numel, n, k, 1, seed=1, index="bloom")
    xs = helpers.make_inputs(rng, numel, 1, n, k, "random", "normal")
    y, info = reference.decode(L, helpers.sum_payloads([reference.encode(L, x) for x in xs], rng))
    assert info["ok"] or info["reason"] == "inexact", info["reason"]   # every key peeled; bounds are test_exactness's
    assert info["false_positives"] == info["candidates"] - info["support"]
    assert info["false_positives"] >= 50, info["false_positives"]   # the case under test occurs (154)
    truth = helpers.dense_sum64(xs)
    assert info["support"] == int((truth != 0).sum())
    assert bool((y[truth == 0] == 0).all())


def three_keys() -> torch.Tensor:
    """The small input of the header and refusal checks below: 500 coordinates, 1.0 at keys 3, 99 and 400."""
    x = torch.zeros(500)
    x[[3, 99, 400]] = 1.0
    return x


def test_reference_detects_config_and_count_errors():
    L = plan_layout(500, 3, 20, 1, seed=0, index="bitmap")
    x = three_keys()
    p = reference.encode(L, x)
    assert not reference.decode(L, p)[1]["ok"]                         # 1 contributor, expected 3
    assert reference.decode(L, p * 3)[1]["ok"]
    bad = p * 3
    bad[L.index_offset] += 1.0                                         # one key counted once more
    assert not reference.decode(L, bad)[1]["ok"]
    other = plan_layout(500, 3, 20, 1, seed=1, index="bitmap")
    mixed = reference.encode(L, x) * 2 + reference.encode(other, x)
    assert "mismatch" in reference.decode(L, mixed)[1]["reason"]


@pytest.mark.parametrize("index", ["bitmap", "bloom", "multilevel"])
@pytest.mark.parametrize("field,delta", [(lay.HDR_KEYS_LO, 0.25), (lay.HDR_KEYS_LO, 1.0), (lay.HDR_KEYS_LO, -1.0),
                                         (lay.HDR_OVERLOADED, 0.5), (lay.HDR_SATURATED, 1.0), ("pad", 1.0),
                                         ("word", 1.0), (lay.HDR_FP_LO, 1.0), (lay.HDR_FP_HI, 1.0)])
def test_reference_refuses_what_the_codec_refuses(index, field, delta):
    """The oracle's own checks: a SUM's header field that is not an integer, a saturation flag, either
    half of the configuration fingerprint off by one, a key
    count the index disagrees with, a count past the last key, or an index word past its digits fails in the
    reference as in the kernels (the round-trip tests compare valid payloads only, so these paths of the
    reference are checked here)."""
    from lossless_hc import LosslessCodec
    codec = LosslessCodec(500, 3, 20, seed=0, index=index)
    x = three_keys()
    summed = codec.encode(x) * 3
    assert reference.decode(codec.layout, summed)[1]["ok"] and codec.decode(summed)[1].ok
    bad = summed.clone()
    if field == "pad":   # a count in the last index word's padding digit, past the last key (or node)
        P = codec.layout.index
        if P.digits % P.per_word == 0:
            pytest.skip("this layout's index words have no padding digit")
        field, delta = codec.layout.index_offset + P.words - 1, float(P.base ** (P.digits % P.per_word))
        bad[lay.HDR_KEYS_LO] += 1.0   # and the key count agrees with it: only the position is wrong
    elif field == "word":   # an index word of exactly base**per_word: not a packed count (its digits look fine)
        P, at = codec.layout.index, codec.layout.index_offset
        field = at + int((summed[at: at + P.words] == 0).nonzero()[0])
        delta = float(P.base ** P.per_word)
    bad[field] += delta
    assert not codec.decode(bad)[1].ok
    assert not reference.decode(codec.layout, bad)[1]["ok"]


def test_within_rtol_leaves_room_for_the_float32_rounding():
    """reference_peel.within_rtol is lhc::within_rtol: err (1 + rtol) + u |v| <= rtol |v|, so that the
    float32 output is within rtol of the true sum. At v = 1 the largest error it accepts is
    (rtol - u) / (1 + rtol); an error just above that is not within rtol (though it is below rtol)."""
    from lossless_hc.lhc.reference_peel import within_rtol
    rtol, u = 2.0 ** -10, 2.0 ** -24
    edge = (rtol - u) / (1 + rtol)
    v = torch.ones(2, dtype=torch.float64)
    err = torch.tensor([edge * (1 - 1e-9), edge * (1 + 1e-6)], dtype=torch.float64)
    assert within_rtol(v, err, rtol).tolist() == [True, False]


def test_reference_encode_refuses_what_it_cannot_encode():
    """The oracle's input checks (``_flat_float32``, ``pack_digits``): a non-tensor, a tensor of another
    size than the layout's numel, or a dtype other than float32/float16/bfloat16 is refused by name; a
    digit that would make an index word reach 2**24 (not exact in float32) is refused too."""
    L = plan_layout(100, 2, 5, 1, seed=0, index="bitmap")
    with pytest.raises(TypeError, match="x must be a torch.Tensor, got list"):
        reference.encode(L, [0.0] * 100)
    with pytest.raises(ValueError, match="x has 99 elements, the layout is for numel=100"):
        reference.encode(L, torch.zeros(99))
    with pytest.raises(TypeError, match="x has dtype torch.float64"):
        reference.encode(L, torch.zeros(100, dtype=torch.float64))
    assert reference.encode(L, torch.zeros(10, 10, dtype=torch.bfloat16)).shape == (L.payload_numel,)
    assert reference.pack_digits(L, torch.tensor([1, 0, 2])).tolist()[0] == 1 + 2 * L.index.base ** 2
    with pytest.raises(ValueError, match="index word does not fit float32 exactly"):
        reference.pack_digits(L, torch.tensor([1 << 24]))


@pytest.mark.parametrize("index", ["bitmap", "dense"])
def test_reference_reads_the_header_counts_and_flags(index):
    """The key count is ``LO + MID 2**11 + HI 2**22`` of the summed chunks (info's total_keys, also where
    it then disagrees with the index); a rank over capacity fails the aggregate as "overloaded" once
    every key has peeled; and a rank's NaN/Inf sets its non-finite flag, which fails the aggregate with
    "non-finite input" (the dense kind too)."""
    n = 3
    L = plan_layout(500, n, 20, 1, seed=0, index=index)
    x = three_keys()
    summed = reference.encode(L, x) * n
    if index == "bitmap":
        assert reference.decode(L, summed)[1]["total_keys"] == 3 * n
        for field, more in ((lay.HDR_KEYS_MID, 1 << 11), (lay.HDR_KEYS_HI, 1 << 22)):
            bad = summed.clone()
            bad[field] += 2.0
            info = reference.decode(L, bad)[1]
            assert info["total_keys"] == 3 * n + 2 * more
            assert info["reason"] == "index corrupt: counts disagree with the header"
    if index == "bitmap":   # a rank over capacity (20 keys): every key still peels, the aggregate fails
        many = torch.zeros(500)
        many[100:125] = 2.0
        info = reference.decode(L, summed + reference.encode(L, many) - reference.encode(L, x))[1]
        assert info["peeled"] == info["support"] == 28 and info["overloaded_ranks"] == 1
        assert info["reason"] == "overloaded: 1 rank(s) over capacity"
    y = x.clone()
    y[7] = float("inf")
    p = reference.encode(L, y)
    assert p[lay.HDR_NON_FINITE] == 1.0
    info = reference.decode(L, p + reference.encode(L, x) * (n - 1))[1]
    assert not info["ok"] and info["reason"] == "non-finite input"


def test_reference_decode_refuses_what_is_not_a_payload():
    """``reference.decode`` takes a 1-D float32 tensor of exactly ``payload_numel`` elements: anything
    else is refused by name (a right-sized 2-D tensor included), not decoded."""
    L = plan_layout(100, 2, 5, 1, seed=0, index="bitmap")
    p = reference.encode(L, torch.zeros(100)) * 2
    assert reference.decode(L, p)[1]["ok"]
    with pytest.raises(TypeError, match="payload must be a torch.Tensor, got list"):
        reference.decode(L, p.tolist())
    with pytest.raises(TypeError, match="payload must be float32, got torch.float64"):
        reference.decode(L, p.double())
    for bad in (p.reshape(1, -1), p[:-1], torch.cat([p, p[:1]])):
        with pytest.raises(ValueError, match=f"payload must be 1-D with {L.payload_numel} elements"):
            reference.decode(L, bad)


def test_node_patterns_by_hand():
    """``reference.node_patterns`` on a two-level plan (level 0: nodes of 81 keys with 9 children of 9
    keys; level 1: nodes of 9 keys), base 4, one pattern word per node: child ``c`` adds ``count 4**c``.
    Keys 0, 1, 9, 80, 81 are children 0, 1 of node 0, 0 of node 1, 8 of node 8 and 0 of node 9 at
    level 1; at level 0 children 0, 1, 8 of node 0 and 0 of node 1."""
    L = plan_layout(100000, 3, 50, 1, seed=0, index="multilevel")
    assert [(lv.span, lv.children, lv.words_per_group) for lv in L.multilevel.levels] == [(81, 9, 1), (9, 9, 1)]
    assert L.index.base == 4
    keys = torch.tensor([0, 1, 9, 80, 81])
    nodes, words = reference.node_patterns(L, 1, keys)
    assert nodes.tolist() == [0, 1, 8, 9] and words.tolist() == [[1 + 4], [1], [4 ** 8], [1]]
    nodes, words = reference.node_patterns(L, 1, keys, counts=torch.tensor([2, 1, 3, 1, 1]))
    assert nodes.tolist() == [0, 1, 8, 9] and words.tolist() == [[2 + 4], [3], [4 ** 8], [1]]
    nodes, words = reference.node_patterns(L, 0, keys)
    assert nodes.tolist() == [0, 1] and words.tolist() == [[1 + 4 + 4 ** 8], [1]]


def test_reference_reports_nothing_decoded_when_the_header_fails():
    """A payload refused at its header leaves every count of info at its empty value: not ok, no
    contributors, keys, candidates, support or trace, no error bounds (decode's documented fields)."""
    L = plan_layout(100, 2, 5, 1, seed=0, index="bitmap")
    bad = reference.encode(L, torch.zeros(100)) * 2
    bad[lay.HDR_CONTRIBUTORS] = 0.5
    y, info = reference.decode(L, bad)
    assert y.tolist() == [0.0] * 100 and y.dtype == torch.float64
    assert info.pop("reason") == "header fields are not non-negative integers"
    assert info.pop("support_keys").tolist() == [] and info.pop("inexact_keys").tolist() == []
    assert info == dict(ok=False, contributors=0, total_keys=0, overloaded_ranks=0, candidates=0,
                        false_positives=0, support=0, peeled=0, trace=None, error_bound=None)


@pytest.mark.parametrize("support,reason", [
    (255, "sketch peeling failed"), (256, "sketch peeling failed: a cell holds 256 support keys, more than 255")])
def test_reference_cell_degree_limit_is_inclusive(support, reason):
    """lhc::kMaxCellDegree: a cell may hold 255 support keys (then peeling fails as it does), 256 is
    refused up front. A sketch of three one-cell segments puts every key in all three cells."""
    from dataclasses import replace
    L = plan_layout(1000, 1, 300, 1, seed=0, index="bitmap")
    L = replace(L, sketch=replace(L.sketch, seg_len=1, seg_count=3))
    x = torch.zeros(1000)
    x[:support] = 1.0
    info = reference.decode(L, reference.encode(L, x))[1]
    assert info["support"] == support and info["reason"] == reason


@pytest.mark.parametrize("index", ["bitmap", "dense"])
def test_reference_refuses_a_sketch_that_overflowed(index):
    """Every rank's input was finite (its header says so), so a NaN/Inf in the aggregate's value sketch or
    mass channel (or a dense value) is an overflow, refused by name instead of peeled."""
    L = plan_layout(500, 2, 20, 1, seed=0, index=index)
    x = three_keys()
    summed = reference.encode(L, x) * 2
    assert reference.decode(L, summed)[1]["ok"]
    starts = [lay.HEADER_FIELDS] if index == "dense" else [L.sketch_offset, L.mass_offset]
    for start in starts:
        bad = summed.clone()
        bad[start + 3] = float("inf")
        info = reference.decode(L, bad)[1]
        assert info["reason"] == ("sketch overflow: a dense value is NaN/Inf" if index == "dense" else
                                  "sketch overflow: a sketch cell is NaN/Inf")


def test_reference_encodes_an_empty_dense_tensor():
    """numel 0 (dense): a header alone, one contributor, the fingerprint, and no non-finite flag."""
    L = plan_layout(0, 2, 0, 1, seed=0, index="dense")
    p = reference.encode(L, torch.zeros(0))
    mask = (1 << lay.CHUNK_BITS) - 1
    assert p.tolist() == [1.0, L.fingerprint & mask, L.fingerprint >> lay.CHUNK_BITS] + [0.0] * 8
    assert reference.decode(L, p * 2)[1]["ok"]


@pytest.mark.parametrize("pattern", ["negated", -1, 4 ** 9])
def test_reference_refuses_a_pure_fine_cell_that_is_no_pattern(pattern):
    """Multilevel: one key, so each fine level holds one node, alone in its three cells; its first cell
    read as a negative pattern (negated, or -1) or as one of base**digits_per_word = 4**9 (a digit past
    the word) is no node pattern (refused as such, not peeled on)."""
    L = plan_layout(100000, 3, 50, 1, seed=0, index="multilevel")
    x = torch.zeros(100000)
    x[4321] = 1.0
    summed = reference.encode(L, x) * 3
    assert reference.decode(L, summed)[1]["ok"]
    lv = L.multilevel.levels[0]
    assert (L.index.base, lv.digits_per_word, lv.words_per_group) == (4, 9, 1)
    cells, signs = reference.key_cells(lv.table, torch.tensor([4321 // lv.span]))
    bad = summed.clone()
    at = L.level_offsets[0] + int(cells[0, 0])
    bad[at] = -bad[at] if pattern == "negated" else pattern * int(signs[0, 0])
    assert reference.decode(L, bad)[1]["reason"] == "index corrupt: a pure fine cell is not a node pattern"


@pytest.mark.parametrize("value,reason", [(-1.0, "header fields are not non-negative integers"),
                                          (2.0 ** 53, "header fields are not non-negative integers"),
                                          (2.0 ** 52, "overloaded: 4503599627370496 rank(s) over capacity")])
def test_reference_header_fields_are_integers_in_0_to_2_pow_53(value, reason):
    """A summed header field is an integer in [0, 2**53) (float64's exact integers): -1 and 2**53 are
    refused as fields, 2**52 is read as the count it is (here of overloaded ranks)."""
    L = plan_layout(500, 2, 20, 1, seed=0, index="bitmap")
    x = three_keys()
    bad = reference.encode(L, x) * 2
    bad[lay.HDR_OVERLOADED] = value
    assert reference.decode(L, bad)[1]["reason"] == reason


def test_reference_empty_support_has_an_empty_trace():
    """All-zero inputs: ok, no support, and a trace of two empty int64 tensors."""
    L = plan_layout(500, 2, 20, 1, seed=0, index="bitmap")
    y, info = reference.decode(L, reference.encode(L, torch.zeros(500)) * 2)
    assert info["ok"] and info["support"] == 0 and y.abs().sum() == 0
    assert [(t.shape, t.dtype) for t in info["trace"]] == [((0,), torch.int64)] * 2


def test_reference_flags_a_nan_of_any_payload():
    """NaN is any exponent-all-ones pattern with a non-zero mantissa: one whose lowest mantissa bit is set
    (0x7FC00001, 0xFF800001) is non-finite like the default NaN and Inf."""
    L = plan_layout(500, 2, 20, 1, seed=0, index="bitmap")
    for bits in (0x7FC00001, 0x7F800001, -0x007FFFFF, 0x7F800000):
        x = torch.zeros(500)
        x[7:8] = torch.tensor([bits], dtype=torch.int32).view(torch.float32)
        assert reference.encode(L, x)[lay.HDR_NON_FINITE] == 1.0, hex(bits)


@pytest.mark.parametrize("word,reason", [(2.0 ** 22, "index overflow: a fine word reached 2**22 in magnitude"),
                                         (-(2.0 ** 22), "index overflow: a fine word reached 2**22 in magnitude"),
                                         (2.0 ** 21, "index corrupt: fine words left after peeling")])
def test_reference_fine_words_stay_below_2_pow_22(word, reason):
    """A multilevel fine word (a signed sum of node patterns) is below 2**22 in magnitude: one of 2**22
    is an overflow; one of 2**21 in a cell no node hashes to is read, and left over after peeling."""
    L = plan_layout(100000, 3, 50, 1, seed=0, index="multilevel")
    x = torch.zeros(100000)
    x[4321] = 1.0
    bad = reference.encode(L, x) * 3
    lv = L.multilevel.levels[0]
    used = set(reference.key_cells(lv.table, torch.tensor([4321 // lv.span]))[0][0].tolist())
    free = next(c for c in range(lv.table.cells) if c not in used)
    bad[L.level_offsets[0] + free * lv.words_per_group] = word
    assert reference.decode(L, bad)[1]["reason"] == reason


def test_reference_refuses_a_child_past_the_last_node():
    """Level 0's last node (1234, keys 99954..99999 of 100000) has children 11106..11114 at level 1, whose
    last node is 11111: key 99999 is its child 5; moved to child 6 (node 11112, past the last) in all
    three of the node's cells, the pattern is refused as such."""
    L = plan_layout(100000, 3, 50, 1, seed=0, index="multilevel")
    lv = L.multilevel.levels[0]
    assert (lv.span, lv.children, L.index.base, lv.words_per_group) == (81, 9, 4, 1)
    x = torch.zeros(100000)
    x[99999] = 1.0
    bad = reference.encode(L, x) * 3                          # count 3: child 5's digit is 3 * 4**5
    cells, signs = reference.key_cells(lv.table, torch.tensor([1234]))
    for c, s in zip(cells[0].tolist(), signs[0].tolist()):
        bad[L.level_offsets[0] + c] += s * 3 * (4 ** 6 - 4 ** 5)
    assert reference.decode(L, bad)[1]["reason"] == "index corrupt: a child past the last"


def test_reference_bloom_counter_may_reach_world_size_times_its_cap():
    """A Bloom counter sums ranks' counts of at most digit_cap each (more saturates the rank), so n *
    digit_cap is a valid aggregate: two ranks each holding the same 5 = digit_cap keys of one cell."""
    L = plan_layout(2000, 2, 40, 1, seed=0, index="bloom")
    assert L.digit_cap == 5
    cells, _ = reference.key_cells(L.bloom, torch.arange(L.num_keys))
    crowded = int(torch.bincount(cells[:, 0]).argmax())
    x = torch.zeros(2000)
    x[(cells[:, 0] == crowded).nonzero().reshape(-1)[:5]] = 1.0
    p = reference.encode(L, x)
    assert p[lay.HDR_SATURATED] == 0
    summed = p * 2
    index = summed[L.index_offset: L.fine_offset]
    assert int(reference.unpack_digits(L, index.to(torch.int64)).max()) == 10
    y, info = reference.decode(L, summed)
    assert info["ok"] and torch.equal(y, 2 * x.double())


def test_reference_reports_a_bloom_index_that_does_not_peel():
    """A Bloom filter of three 2-cell segments (8 possible cell triples) holding two keys of the same
    three cells: no cell is pure, so the exact counter peeling stalls and is reported as such."""
    from dataclasses import replace
    L = plan_layout(2000, 2, 40, 1, seed=0, index="bloom")
    L = replace(L, bloom=replace(L.bloom, seg_len=2))
    cells, _ = reference.key_cells(L.bloom, torch.arange(9))
    a, b = next((a, b) for a in range(9) for b in range(a) if cells[a].tolist() == cells[b].tolist())
    x = torch.zeros(2000)
    x[[a, b]] = 1.0
    assert reference.decode(L, reference.encode(L, x) * 2)[1]["reason"] == "index peeling failed"


def test_reference_refuses_an_unknown_index_kind():
    """encode and decode name an index kind they do not know instead of writing or reading some payload."""
    from dataclasses import replace
    L = plan_layout(500, 2, 20, 1, seed=0, index="bitmap")
    p = reference.encode(L, torch.zeros(500)) * 2
    with pytest.raises(ValueError, match="unknown index kind 'weird'"):
        reference.encode(replace(L, index_kind="weird"), torch.zeros(500))
    with pytest.raises(ValueError, match="unknown index kind 'weird'"):
        reference.decode(replace(L, index_kind="weird"), p)
