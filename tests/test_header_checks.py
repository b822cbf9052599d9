"""The decoders' header checks name the exact failure (LHC: ``DecodeReport.status``; THC: a ValueError
naming the field; ``auto``'s statistics header: a ConfigurationMismatch), and the LHC header's integer
fields, capacity and key counts mean what the docs say: one test per rule, each with the status a caller
branches on (a wrong but still non-ok status would send a caller down another path)."""
import pytest
import torch

from lossless_hc import LosslessCodec
from lossless_hc.lhc.layout import (HDR_CONTRIBUTORS, HDR_FP_HI, HDR_INDEX_CHECK0, HDR_KEYS_HI, HDR_KEYS_LO,
                                    HDR_KEYS_MID, HDR_NON_FINITE, HDR_OVERLOADED, HDR_SATURATED,
                                    INDEX_CHECK_PRIMES)
from lossless_hc.lhc.status import DecodeStatus, message
from lossless_hc.thc.layout import HDR_CHECKSUM as THC_CHECKSUM, HDR_NON_FINITE as THC_NON_FINITE
from lossless_hc.training.aggregate import ConfigurationMismatch
from lossless_hc.training.plan_stats import stats_header_words
from lossless_hc.training.strategies import AutoAggregator
from test_planner import sparse_rows
from test_planner_cost import MODEL

N, NUMEL = 3, 1000


def summed(index: str):
    codec = LosslessCodec(NUMEL, N, 50, seed=1, index=index)
    g = torch.Generator().manual_seed(0)
    xs = []
    for _ in range(N):
        x = torch.zeros(NUMEL)
        x[torch.randperm(NUMEL, generator=g)[:40]] = torch.randn(40, generator=g)
        xs.append(x)
    return codec, sum(codec.encode(x) for x in xs), xs


def set_key_count(p: torch.Tensor, total: int) -> None:
    p[HDR_KEYS_LO], p[HDR_KEYS_MID], p[HDR_KEYS_HI] = total & 2047, (total >> 11) & 2047, total >> 22


@pytest.mark.parametrize("index", ["bitmap", "bloom", "multilevel"])
@pytest.mark.parametrize("edit,status", [
    # a SUM of integer fields is an exact integer: a fraction is a corrupted word, not a rounding
    (lambda p, L: p.__setitem__(HDR_KEYS_LO, p[HDR_KEYS_LO] + 0.25), "HEADER_CORRUPT"),
    (lambda p, L: p.__setitem__(HDR_INDEX_CHECK0, p[HDR_INDEX_CHECK0] + 0.5), "HEADER_CORRUPT"),
    # a 0/1 flag summed over n ranks is at most n
    (lambda p, L: p.__setitem__(HDR_OVERLOADED, N + 1), "HEADER_CORRUPT"),
    (lambda p, L: p.__setitem__(HDR_NON_FINITE, -1), "HEADER_CORRUPT"),   # and none is below 0
    (lambda p, L: p.__setitem__(HDR_NON_FINITE, N), "NON_FINITE_INPUT"),
    (lambda p, L: p.__setitem__(HDR_NON_FINITE, N + 1), "HEADER_CORRUPT"),
    (lambda p, L: p.__setitem__(HDR_SATURATED, N + 1), "HEADER_CORRUPT"),
    # an 11-bit chunk summed over n ranks is at most n * 2047, an index checksum at most n * (p - 1)
    (lambda p, L: p.__setitem__(HDR_KEYS_MID, N * 2047), "KEY_COUNT_CORRUPT"),
    (lambda p, L: p.__setitem__(HDR_KEYS_MID, N * 2047 + 1), "HEADER_CORRUPT"),
    (lambda p, L: p.__setitem__(HDR_INDEX_CHECK0, N * (INDEX_CHECK_PRIMES[0] - 1)), "INDEX_CORRUPT"),
    (lambda p, L: p.__setitem__(HDR_INDEX_CHECK0, N * (INDEX_CHECK_PRIMES[0] - 1) + 1), "HEADER_CORRUPT"),
    (lambda p, L: p.__setitem__(HDR_SATURATED, 1), "INDEX_SATURATED"),
    (lambda p, L: p.__setitem__(HDR_FP_HI, p[HDR_FP_HI] + 1), "CONFIGURATION_MISMATCH"),
    # n ranks hold at most n * num_keys keys
    (lambda p, L: set_key_count(p, N * L.num_keys + 1), "KEY_COUNT_CORRUPT"),
])
def test_header_field_out_of_its_range_is_named(index, edit, status):
    codec, s, _ = summed(index)
    assert codec.decode(s)[1].status == DecodeStatus.OK
    p = s.clone()
    edit(p, codec.layout)
    y, rep = codec.decode(p)
    assert rep.status == DecodeStatus[status] and not rep.ok, (rep.status, rep.reason)
    if status != "INDEX_CORRUPT":   # refused from the header, before a key is decoded (the checksum comes after)
        assert bool(torch.isnan(y).all())


def test_a_header_refusal_names_its_ranks_and_an_overload_first():
    """A header flag's reason says on how many ranks it was set; with overloaded ranks the overload is
    named first and the refusal in parentheses (the key count's too, which carries no count)."""
    codec, s, _ = summed("bitmap")
    L = codec.layout
    overload = f"overloaded: 1 rank(s) had more than capacity={L.capacity} non-zero keys; grow max_nnz"
    edits = [({HDR_NON_FINITE: 2}, "non-finite input (NaN/Inf) on 2 rank(s)"),
             ({HDR_SATURATED: 3}, "index counter saturated on 3 rank(s)"),
             ({HDR_OVERLOADED: 1, HDR_NON_FINITE: 2}, f"{overload} (non-finite input (NaN/Inf) on 2 rank(s))"),
             ({HDR_OVERLOADED: 1, "keys": N * L.num_keys + 1},
              f"{overload} ({message(DecodeStatus.KEY_COUNT_CORRUPT)})")]
    for edit, reason in edits:
        p = s.clone()
        for field, value in edit.items():
            if field == "keys":
                set_key_count(p, value)
            else:
                p[field] = value
        rep = codec.decode(p)[1]
        assert rep.reason == reason, rep.reason


@pytest.mark.parametrize("value,status", [(2.0 ** 52, "WRONG_CONTRIBUTORS"), (2.0 ** 53, "HEADER_CORRUPT"),
                                          (2.0 ** 60, "HEADER_CORRUPT"), (float("nan"), "HEADER_CORRUPT"),
                                          (float("inf"), "HEADER_CORRUPT"), (-1.0, "HEADER_CORRUPT"),
                                          (0.0, "WRONG_CONTRIBUTORS")])
def test_a_contributor_count_is_an_integer_float64_holds_exactly(value, status):
    """The contributors field is read as an integer only below 2**53, where float64 holds every integer:
    2**52 is a count of contributions other than world_size (named in the reason); from 2**53 up, like
    NaN and Inf, it is no integer and the header is corrupt (no count reported). A negative count is no
    sum of ranks' 1s either: corrupt, not a wrong number of contributions; 0 (no rank) is a wrong count."""
    codec, s, _ = summed("bitmap")
    p = s.clone()
    p[HDR_CONTRIBUTORS] = value
    y, rep = codec.decode(p)
    assert rep.status == DecodeStatus[status] and bool(torch.isnan(y).all()), (rep.status, rep.reason)
    if status == "WRONG_CONTRIBUTORS":
        assert rep.contributors == int(value) and f"aggregates {int(value)} contributions" in rep.reason
    else:
        assert rep.contributors == 0


@pytest.mark.parametrize("bad", [None, float("nan"), float("inf")])
def test_a_dense_payload_s_header_is_one_rank_s(bad):
    """The dense layout's header, written by encode itself: one contributor, the fingerprint's two
    chunks, no key counts or overload, the non-finite flag 1 exactly when the input holds a NaN or
    an infinity (one is enough), and nothing else set."""
    codec = LosslessCodec(100, 2, 100, index="dense")
    fp = codec.layout.fingerprint
    x = torch.zeros(100)
    x[3] = 1.0
    if bad is not None:
        x[7] = bad
    p = codec.encode(x)
    assert p[:11].tolist() == [1, fp & 2047, fp >> 11, 0, 0, 0, 0, int(bad is not None), 0, 0, 0]


def test_averaged_header_fields_take_half_a_unit():
    """An AVERAGE's integer fields are within 1/2 of an integer after scaling back by n (float32
    division rounds): the same payload averaged decodes ok, to the average."""
    codec, s, xs = summed("bitmap")
    y, rep = codec.decode(s / N, averaged=True)
    assert rep.ok
    truth = sum(xs) / N
    assert torch.allclose(y, truth, rtol=2 ** -10, atol=0)


def test_key_counts_beyond_two_chunks_are_read_whole():
    """The header's key count is three 11-bit chunks: a rank with 2**22 + 5 non-zero keys reads back
    as that many (the top chunk weighs 2**22)."""
    numel = (1 << 22) + 5
    codec = LosslessCodec(numel, 2, numel, index="bitmap")
    p = codec.encode(torch.ones(numel))
    assert float(p[HDR_KEYS_HI]) == 1.0
    assert codec.encoded_keys(p) == numel


@pytest.mark.parametrize("index", ["bitmap", "bloom", "multilevel"])
def test_every_rank_holding_every_key_is_the_most_a_header_counts(index):
    """n ranks each non-zero at every key send n * num_keys keys, the bound KEY_COUNT_CORRUPT starts
    above: that aggregate decodes, exactly."""
    codec = LosslessCodec(64, N, 64, index=index)
    xs = [torch.arange(1.0, 65.0) * (r + 1) for r in range(N)]
    y, rep = codec.decode(sum(codec.encode(x) for x in xs))
    assert rep.ok and rep.total_keys == N * codec.layout.num_keys == 3 * 64, rep.reason
    assert torch.equal(y, sum(xs))


def test_capacity_rounds_max_nnz_up_to_whole_blocks():
    """max_nnz counts coordinates; capacity is ceil(max_nnz / block) keys: 3 non-zeros in 2 blocks of 2
    fit max_nnz=3: the rank is not overloaded, and its keys decode (a key the table's rounding bound
    leaves unproven is INEXACT, never OVERLOADED)."""
    codec = LosslessCodec(100, 2, 3, block_size=2, index="bitmap")
    assert codec.layout.capacity == 2
    x = torch.zeros(100)
    x[:3] = torch.tensor([1.0, 2.0, 3.0])
    y, rep = codec.decode(codec.encode(x) + codec.encode(torch.zeros(100)))
    assert rep.overloaded_ranks == 0 and rep.status in (DecodeStatus.OK, DecodeStatus.INEXACT), rep.reason
    assert rep.peeled == 2


def test_union_nnz_rounds_up_to_whole_blocks():
    """union_nnz counts coordinates too: 3 of them span at least ceil(3 / 2) = 2 keys of block 2, and
    the sketch is sized for 2 (not 1): an aggregate of 3 coordinates in 2 blocks decodes."""
    codec = LosslessCodec(1000, 2, 4, block_size=2, index="bitmap", union_nnz=3)
    assert codec.layout.union_keys == 2
    x = torch.zeros(1000)
    x[[0, 1, 500]] = torch.tensor([1.0, 2.0, 3.0])
    y, rep = codec.decode(codec.encode(x) + codec.encode(torch.zeros(1000)))
    assert rep.status in (DecodeStatus.OK, DecodeStatus.INEXACT) and rep.peeled == 2, rep.reason


@pytest.mark.parametrize("rtol", [1.0, -0.5, float("nan")])
def test_rtol_outside_zero_one_is_refused(rtol):
    """rtol is in [0, 1): 1 would accept any value with the right sign as within tolerance."""
    with pytest.raises(ValueError, match=r"rtol must be a number in \[0, 1\)"):
        LosslessCodec(100, 2, 10, rtol=rtol)


def test_rtol_zero_is_accepted_and_proves_no_key():
    """rtol's range is closed at 0: rtol=0 builds, joins the fingerprint, and (no float rounding bound is
    0) lists every key INEXACT, with the exact values still decoded."""
    codec = LosslessCodec(1000, 2, 10, rtol=0.0)
    assert codec.rtol == 0.0
    assert codec.layout.fingerprint != LosslessCodec(1000, 2, 10).layout.fingerprint
    x = torch.zeros(1000)
    x[[3, 50]] = torch.tensor([1.0, 2.0])
    y, rep = codec.decode(codec.encode(x) + codec.encode(x))
    assert rep.status == DecodeStatus.INEXACT and not rep.ok, rep.reason
    assert rep.inexact_keys.tolist() == [3, 50]
    assert torch.equal(y, 2 * x)


def test_weighted_and_signed_sketches_of_one_size_do_not_mix():
    """union_nnz 878 and 879 give value sketches of the same 3 x 469 cells, signed (+-1) and weighted
    (+-1, +-2): the weighting joins the fingerprint, so ranks configured apart are told apart instead
    of summing cells of different weights."""
    kw = dict(numel=10000, world_size=2, max_nnz=500, seed=5, index="bitmap")
    a, b = LosslessCodec(union_nnz=878, **kw), LosslessCodec(union_nnz=879, **kw)
    assert (a.layout.sketch.seg_len, a.layout.sketch.seg_count) == (b.layout.sketch.seg_len, b.layout.sketch.seg_count)
    assert (a.layout.sketch.weighted, b.layout.sketch.weighted) == (False, True)
    x = torch.zeros(10000)
    x[::25] = torch.arange(400.0) + 1
    assert b.decode(a.encode(x) + b.encode(x))[1].status == DecodeStatus.CONFIGURATION_MISMATCH


def test_message_of_an_unknown_status_names_it():
    """A status code outside csrc/lhc_status.h's list (a newer or corrupted report) reads as unknown,
    with its number, never as the empty message of OK."""
    code = max(DecodeStatus) + 1
    assert message(code) == f"unknown decode status {code}"
    assert message(DecodeStatus.OK) == ""


# -- THC -------------------------------------------------------------------------------------------

def thc_inputs(n: int = 3, numel: int = 64):
    """The ranks' inputs of :func:`thc_summed` and the codecs' arguments."""
    g = torch.Generator().manual_seed(2)
    xs = [torch.randn(numel, generator=g) for _ in range(n)]
    return xs, dict(initial_norm=max(float(x.norm()) for x in xs), seed=1)


def thc_summed(n: int = 3, numel: int = 64):
    """A fresh rank-0 THC codec that encoded its input (ready to decode) and the float64 SUM of the
    ranks' payloads."""
    from lossless_hc import THCCodec
    xs, kw = thc_inputs(n, numel)
    payloads = [THCCodec(numel, n, rank=r, **kw).encode(x) for r, x in enumerate(xs)]
    c = THCCodec(numel, n, rank=0, **kw)
    c.encode(xs[0])
    return c, sum(payloads)


def test_thc_clean_sum_decodes():
    """The control of the corruption tests below: the clean sum decodes to the ranks' sum, within the
    rounding error the table predicts (tests/thc_reference.py, as tests/test_thc.py's unbiasedness test
    uses it), not merely to finite numbers."""
    import math

    import thc_reference as ref
    from lossless_hc import THCCodec, _C
    xs, kw = thc_inputs()
    n, numel = len(xs), xs[0].numel()
    c, s = thc_summed(n, numel)
    y = c.decode(s).double()
    assert torch.isfinite(y).all()
    fresh = [THCCodec(numel, n, rank=r, **kw) for r in range(n)]   # at the step the payloads were encoded
    pred = ref.predicted_sq_error(xs, fresh, kw["initial_norm"])
    # What the decode is unbiased for: the sum of each rank's rotated input clipped at the table's range
    # (initial_norm is the largest input's norm, no headroom: a few coordinates clip, and error feedback
    # keeps the clipped part for the next step).
    L, T, stream = c.layout, c.threshold, _C.thc_sign_stream(kw["seed"], 0)
    unit = kw["initial_norm"] / math.sqrt(L.padded)
    clipped = sum(ref.inverse_rht((ref.rht(x, L, stream) / unit).clamp(-T, T) * unit, L, stream) for x in xs)
    # One draw of 3 x 64 independent rounding errors: measured 0.6 x pred here (0.6 to 1.1 over 20 input
    # seeds); a decode 1.5x the sum is ~19 x pred off, zeros ~70 x.
    err = float((y - clipped).pow(2).sum())
    assert err <= 2.0 * pred, (err, pred)
    truth = sum(x.double() for x in xs)
    assert float((y - truth).norm()) <= 0.2 * float(truth.norm()), (y, truth)   # clipping removed ~2% here


@pytest.mark.parametrize("edit,match", [
    # a flag summed over n ranks is at most n: more is a corrupted word, not n + 1 non-finite inputs
    (lambda p, n, P: p.__setitem__(THC_NON_FINITE, n + 1), "non-finite flag count"),
    (lambda p, n, P: p.__setitem__(THC_NON_FINITE, -1), "non-finite flag count"),   # and none is below 0
    (lambda p, n, P: p.__setitem__(THC_CHECKSUM, -1), "checksum field"),   # nor is a sum of checksums
    # one rank flagged non-finite: the others' checksums add up to at most (n - 1)(P - 1)
    (lambda p, n, P: (p.__setitem__(THC_NON_FINITE, 1), p.__setitem__(THC_CHECKSUM, n * (P - 1))), "checksum field"),
    # a SUM of integer fields is an exact integer
    (lambda p, n, P: p.__setitem__(THC_CHECKSUM, p[THC_CHECKSUM] + 0.25), "checksum field"),
    # no rank flagged: the checksum's range is [0, n(P - 1)], its top included (read as a checksum, which this
    # edited one then fails to match), one past it a corrupted field
    (lambda p, n, P: p.__setitem__(THC_CHECKSUM, n * (P - 1)), "checksum mismatch"),
    (lambda p, n, P: p.__setitem__(THC_CHECKSUM, n * (P - 1) + 1), "checksum field"),
])
def test_thc_header_field_out_of_its_range_is_corruption(edit, match):
    """A THC header field out of what n ranks can write raises ValueError naming it (a flag count
    above n, or a checksum beyond what the unflagged ranks can add, is not read as a non-finite
    input: that would raise FloatingPointError, the answer to a NaN gradient); a field at the top of its
    range is read as what it says."""
    c, s = thc_summed()
    p = s.clone()
    edit(p, c.world_size, c.layout.check_prime)
    with pytest.raises(ValueError, match=match):
        c.decode(p)


def test_thc_negative_norm_slot_is_corruption():
    c, s = thc_summed()
    p = s.clone()
    L = c.layout
    p[L.norm_offset], p[L.norm_offset + c.world_size] = -0.5, 0.5   # negative, with its mirror negated
    with pytest.raises(ValueError, match="norm slots are corrupted"):
        c.decode(p)


def test_fingerprints_fit_the_header_s_two_chunks():
    """A fingerprint (a layout's, with decode options mixed in or not) is 2 * CHUNK_BITS = 22 bits: the
    header carries it as two 11-bit chunks (HDR_FP_LO, HDR_FP_HI) whose sums over 1024 ranks stay exact."""
    from lossless_hc import plan_layout
    from lossless_hc.lhc.layout import CHUNK_BITS, options_fingerprint
    fps = [plan_layout(1000 + i, 2, 10, seed=i, index=kind).fingerprint
           for i in range(8) for kind in ("bitmap", "bloom", "multilevel", "dense")]
    fps += [options_fingerprint(fp, 1, 2) for fp in fps]
    assert all(0 <= fp < 1 << (2 * CHUNK_BITS) for fp in fps)
    used = 0
    for fp in fps:
        used |= fp
    assert used == (1 << (2 * CHUNK_BITS)) - 1   # and every one of the 22 bits is in use


@pytest.mark.parametrize("word", [0, 1, 4])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_an_auto_statistics_header_with_a_non_finite_word_is_refused_by_name(word, bad):
    """``auto``'s statistics header (the contributor word, then two count fields per rank) holds small
    integers in any sum of ranks' headers: a NaN or an infinity there is a ConfigurationMismatch naming the
    tensor and the header, not a count read as an integer (the counts once went through float64 and int64,
    where NaN became -2^63)."""
    n = 2
    rng = torch.Generator().manual_seed(8)
    aggs = [AutoAggregator("w", (64, 8), torch.float32, n, r, MODEL, allowed=("dense",)) for r in range(n)]
    enc = [a.encode(sparse_rows(rng, 64, 8, 5)) for a in aggs]
    total = enc[0][0] + enc[1][0]
    assert word < stats_header_words(n)
    total[word] = bad
    with pytest.raises(ConfigurationMismatch, match="w: the first payload's statistics header holds a non-finite"):
        aggs[0].decode(total, enc[0][1])


@pytest.mark.parametrize("engine", ["scaled_then_summed", "summed_then_divided"])
def test_an_auto_statistics_header_averaged_with_roundings_reads_every_rank_s_count(engine):
    """An engine's average rounds the header's words: scaling each rank's payload by float32(1/n) before the
    SUM leaves the contributor word within a rounding of 1 (12 ranks: 1 - 2^-23), dividing the SUM by n leaves
    count fields k / n just below (k = 5, 7, 10 of 12). The header is read as the nearest integers of its
    words times n: 12 contributors and every rank's count exactly, not a truncation's 11 contributors (a
    ConfigurationMismatch) or 4 rows for 5."""
    n = 12
    rng = torch.Generator().manual_seed(9)
    aggs = [AutoAggregator("w", (64, 8), torch.float32, n, r, MODEL, allowed=("dense",)) for r in range(n)]
    counts = list(range(1, n + 1))
    enc = [a.encode(sparse_rows(rng, 64, 8, k)) for a, k in zip(aggs, counts)]
    total = torch.zeros_like(enc[0][0])
    if engine == "scaled_then_summed":
        for payload, _ in enc:
            total += payload * torch.tensor(1.0 / n, dtype=torch.float32)
        assert float(total[0]) < 1.0
    else:
        for payload, _ in enc:
            total += payload
        total /= n
        assert float(total[1 + 2 * 4]) * n < 5   # rank 4's low count field
    for a, (_, ctx) in zip(aggs, enc):
        assert a.decode(total.clone(), ctx).value is not None
        assert a.tracker.rank_keys == counts
