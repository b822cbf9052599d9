""""ok" means exact (issue #19): the decoder's per-key error bound, INEXACT with its keys, the residual
check after peeling, and the gaps the issue listed (dense non-finite values, integer output dtypes).

The contract (LosslessCodec, DecodeReport): when the peel recovers every key, every coordinate of a
key outside ``report.inexact_keys`` is within ``rtol`` of the true sum (``helpers.assert_contract``
checks it against the float64 sum), and ok is True exactly when ``inexact_keys`` is empty.
"""
import numpy as np
import pytest
import torch

import helpers
from lossless_hc import LosslessCodec
from lossless_hc.lhc import reference
from lossless_hc.lhc.codec import DEFAULT_RTOL
from lossless_hc.lhc.layout import HEADER_FIELDS
from lossless_hc.lhc.status import DecodeStatus

KINDS = ["bitmap", "bloom", "multilevel"]


def decode_sum(codec, xs, rng=None, averaged=False):
    payloads = [codec.encode(x) for x in xs]
    summed = helpers.sum_payloads(payloads, rng) if rng is not None else sum(payloads)
    if averaged:
        summed = helpers.average_payloads(summed, len(xs))
    return (*codec.decode(summed, averaged=averaged), summed)


def check(codec, xs, y, rep, averaged=False):
    """The contract, and the report's consistency: ok iff OK iff no inexact keys; INEXACT lists
    sorted int64 CPU keys, all in the support."""
    assert rep.ok == (rep.status == DecodeStatus.OK)
    if rep.status == DecodeStatus.INEXACT:
        keys = rep.inexact_keys
        assert keys.dtype == torch.int64 and keys.device.type == "cpu" and keys.numel() > 0
        assert torch.equal(keys, torch.sort(keys).values) and torch.unique(keys).numel() == keys.numel()
        support = set(np.unique(np.concatenate([helpers.nonzero_keys(x.reshape(-1), codec.layout.block)
                                                for x in xs])).tolist())
        assert set(keys.tolist()) <= support
    else:
        assert rep.inexact_keys.numel() == 0
    if rep.ok or rep.status == DecodeStatus.INEXACT:
        helpers.assert_contract(codec.layout, [x.reshape(-1) for x in xs], y.reshape(-1), rep.inexact_keys,
                                codec.rtol, averaged=averaged)


def issue_example(numel, seed):
    """Issue #19's example: value 1.0 at 40 keys on both ranks, plus 5e7 at one key of rank 0."""
    g = torch.Generator().manual_seed(seed)
    keys = torch.randperm(numel, generator=g)[:41]
    xs = [torch.zeros(numel), torch.zeros(numel)]
    for x in xs:
        x[keys[:40]] = 1.0
    xs[0][keys[40]] = 5e7
    return xs


@pytest.mark.parametrize("index", KINDS)
def test_issue_example_is_never_ok_and_wrong(index):
    """Without the bound about 1 seed in 12 decoded a 2.0 as -2.0 with ok=True. Now: never ok with a
    value outside rtol; the wrong keys come back INEXACT, listed; every unlisted key is 2.0 within rtol."""
    numel, statuses = 2000, []
    for seed in range(40):
        xs = issue_example(numel, seed)
        codec = LosslessCodec(numel, 2, 41, seed=seed, index=index)
        y, rep, _ = decode_sum(codec, xs)
        statuses.append(rep.status)
        if rep.status not in (DecodeStatus.OK, DecodeStatus.INEXACT):
            assert rep.status in (DecodeStatus.SKETCH_PEEL_FAILED, DecodeStatus.INDEX_PEEL_FAILED), rep.reason
            continue
        check(codec, xs, y, rep)
        truth = xs[0].double() + xs[1].double()
        wrong = ((y.double() - truth).abs() > DEFAULT_RTOL * truth.abs()).nonzero().reshape(-1)
        assert set(wrong.tolist()) <= set(rep.inexact_keys.tolist())
    # the seeds exercise both verdicts (the big key's cell-mates are flagged; most decodes are exact)
    assert DecodeStatus.INEXACT in statuses and DecodeStatus.OK in statuses, statuses


def log_uniform_inputs(rng, numel, n, k, decades, block=1, sign=True):
    xs = []
    for _ in range(n):
        x = np.zeros(numel, dtype=np.float32)
        idx = rng.choice(numel, k, replace=False)
        mags = 10.0 ** rng.uniform(-decades / 2, decades / 2, k)
        x[idx] = (mags * (rng.choice([-1.0, 1.0], k) if sign else 1.0)).astype(np.float32)
        xs.append(torch.from_numpy(x))
    return xs


@pytest.mark.parametrize("index", KINDS)
@pytest.mark.parametrize("decades", [5, 6, 30])
def test_dynamic_ranges(index, decades):
    """Values spread over 1e5, 1e6 and 1e30 (where the issue saw 22% and 147% errors with ok=True)."""
    rng = np.random.default_rng(helpers.stable_seed("ranges", index, decades))
    inexact = 0
    for trial in range(4):
        numel, n, k = 4000, 4, 60
        xs = log_uniform_inputs(rng, numel, n, k, decades)
        codec = LosslessCodec(numel, n, k, seed=trial, index=index)
        for averaged in (False, True):
            y, rep, _ = decode_sum(codec, xs, rng, averaged)
            assert rep.status in (DecodeStatus.OK, DecodeStatus.INEXACT), rep.reason
            check(codec, xs, y, rep, averaged)
            inexact += rep.inexact_keys.numel()
    assert inexact > 0   # such ranges do put small keys next to large ones


@pytest.mark.parametrize("index", KINDS)
def test_normal_values_n8(index):
    """N(0, 1) at n = 8 (0.46% relative error with ok=True before): the contract, and the keys
    reported inexact stay a small share of the support (values near zero)."""
    rng = np.random.default_rng(helpers.stable_seed("normal8", index))
    numel, n, k = 20000, 8, 300
    xs = [torch.from_numpy(np.where(rng.random(numel) < k / numel, rng.standard_normal(numel), 0.0)
                           .astype(np.float32)) for _ in range(n)]
    codec = LosslessCodec(numel, n, 2 * k, index=index)
    y, rep, _ = decode_sum(codec, xs, rng)
    assert rep.status in (DecodeStatus.OK, DecodeStatus.INEXACT), rep.reason
    check(codec, xs, y, rep)
    assert rep.inexact_keys.numel() <= 0.05 * rep.support, (rep.inexact_keys.numel(), rep.support)


@pytest.mark.parametrize("index", KINDS)
def test_cancellation(index):
    """+a on one rank, -a on another: the true sum is 0, which float sketch cells shared with other
    keys cannot promise to reproduce: such a key decodes to exactly 0 or is listed inexact."""
    rng = np.random.default_rng(helpers.stable_seed("cancel", index))
    numel, n = 3000, 3
    xs = log_uniform_inputs(rng, numel, n, 40, 4)
    cancel = rng.choice(numel, 10, replace=False)
    for x in xs:
        x[cancel] = 0.0
    xs[0][cancel] = torch.from_numpy(rng.uniform(1, 100, 10).astype(np.float32))
    xs[1][cancel] = -xs[0][cancel]
    codec = LosslessCodec(numel, n, 60, index=index)
    y, rep, _ = decode_sum(codec, xs, rng)
    assert rep.status in (DecodeStatus.OK, DecodeStatus.INEXACT), rep.reason
    check(codec, xs, y, rep)
    listed = set(rep.inexact_keys.tolist())
    for key in cancel.tolist():
        assert y[key] == 0.0 or key in listed


def test_rtol_option():
    with pytest.raises(ValueError, match="rtol"):
        LosslessCodec(100, 2, 10, rtol=-1e-3)
    with pytest.raises(ValueError, match="rtol"):
        LosslessCodec(100, 2, 10, rtol=1.0)
    assert LosslessCodec(100, 2, 10).rtol == DEFAULT_RTOL == 2.0 ** -10
    # a looser rtol lists a subset of the keys a tighter one lists, on the same payload
    rng = np.random.default_rng(3)
    xs = log_uniform_inputs(rng, 4000, 4, 60, 8)
    listed = []
    for rtol in (2.0 ** -20, 2.0 ** -10, 2.0 ** -3):
        codec = LosslessCodec(4000, 4, 60, index="bitmap", rtol=rtol)
        y, rep, _ = decode_sum(codec, xs)
        assert rep.status in (DecodeStatus.OK, DecodeStatus.INEXACT), rep.reason
        check(codec, xs, y, rep)
        listed.append(set(rep.inexact_keys.tolist()))
    assert listed[2] <= listed[1] <= listed[0] and len(listed[0]) > len(listed[2])


@pytest.mark.parametrize("index", ["bitmap", "multilevel"])
def test_inexact_keys_are_exactly_those_failing_rtol_sorted_at_any_thread_count(index):
    """Thousands of inexact keys (rtol 2^-20 over values spread across six decades), up to key 2^23
    (the CPU decoder sorts them by radix, 11 bits a pass: three passes here): listed exactly when the
    key's proven bound fails rtol (away from the boundary, where the float32 output cannot say),
    increasing, and the same list at 1 and 2 decoding threads."""
    rng = np.random.default_rng(helpers.stable_seed("inexact sort", index))
    numel, n, k = 1 << 23, 4, 20000
    xs = log_uniform_inputs(rng, numel, n, k, 6)
    rtol = 2.0 ** -20
    lists = []
    for threads in (1, 2):
        codec = LosslessCodec(numel, n, k, index=index, rtol=rtol, num_threads=threads)
        y, rep = codec.decode(sum(codec.encode(x) for x in xs), error_bounds=True)
        assert rep.status == DecodeStatus.INEXACT, rep.reason
        check(codec, xs, y, rep)
        lists.append(rep.inexact_keys)
    assert torch.equal(lists[0], lists[1])
    keys, bound = rep.error_bounds
    a = y[keys].abs().double()
    slack = bound * (1 + rtol) + 2.0 ** -24 * a - rtol * a     # within_rtol(v, E): slack <= 0 (v = y here)
    listed = torch.isin(keys, lists[0])
    clear = slack.abs() > 1e-3 * rtol * a
    assert bool(listed[clear & (slack > 0)].all()) and not bool(listed[clear & (slack <= 0)].any())
    assert 3000 < lists[0].numel() < keys.numel() and int(lists[0][-1]) >= 1 << 22


def test_reference_agrees_on_the_issue_example():
    """The pure-torch reference computes the same kind of bound along its own (round-based) peel: its
    verdict is OK/INEXACT exactly when the codec's is, and its output meets the contract too."""
    numel = 2000
    for seed in range(12):
        xs = issue_example(numel, seed)
        codec = LosslessCodec(numel, 2, 41, seed=seed, index="bitmap")
        y, rep, summed = decode_sum(codec, xs)
        yr, info = reference.decode(codec.layout, summed)
        assert helpers.peeled_ok(rep) == helpers.peeled_ok(info)
        if helpers.peeled_ok(info):
            helpers.assert_contract(codec.layout, xs, yr, info["inexact_keys"], codec.rtol)
            assert info["error_bound"].numel() == info["support"]


# -- corruption -------------------------------------------------------------------------------------

def corruption_case(index, n=3):
    """A codec with verify=True (the contract covers corrupted payloads only with it), n ranks' sparse
    N(0,1) inputs and their summed payload."""
    rng = np.random.default_rng(helpers.stable_seed("corrupt", index, n))
    numel = 3000
    xs = [torch.from_numpy(np.where(rng.random(numel) < 0.01, rng.standard_normal(numel), 0.0).astype(np.float32))
          for _ in range(n)]
    codec = LosslessCodec(numel, n, 60, index=index, verify=True)
    summed = sum(codec.encode(x) for x in xs)
    return codec, xs, summed


def test_verify_lists_the_key_a_corrupted_cell_moved():
    """One word added to: key 459 (sum 1.0) is read from cell 195, and its two other cells hold
    5e7-sized keys whose bounds (~20) hide the error it carries there. Without verify the decode lists
    other keys but not 459 (0.75 decoded): the default contract is for sums of valid payloads. With
    verify its verification bound lists it, and every unlisted coordinate is within the contract."""
    rng = np.random.default_rng(0)
    numel, n = 4000, 2
    xs = []
    for _ in range(n):
        x = np.zeros(numel, np.float32)
        idx = rng.choice(numel, 60, replace=False)
        x[idx] = 1.0
        x[idx[:20]] = 5e7
        xs.append(torch.from_numpy(x))
    for verify in (False, True):
        codec = LosslessCodec(numel, n, 64, index="bitmap", seed=0, verify=verify)
        p = sum(codec.encode(x) for x in xs)
        p[codec.layout.sketch_offset + 195] += 0.25
        y, rep = codec.decode(p)
        assert rep.status == DecodeStatus.INEXACT, rep.reason
        if verify:
            assert 459 in rep.inexact_keys.tolist()
            helpers.assert_contract(codec.layout, xs, y, rep.inexact_keys, codec.rtol)
        else:
            assert float(y[459]) == 0.75 and 459 not in rep.inexact_keys.tolist()


def test_decode_options_are_agreed_through_the_fingerprint():
    """rtol and verify decide every rank's verdict: a payload summed from ranks that disagree on them
    is CONFIGURATION_MISMATCH, never decoded under one rank's options. The defaults keep the layout's
    own fingerprint (plan_layout's)."""
    from lossless_hc import plan_layout
    plain = LosslessCodec(500, 2, 20, index="bitmap")
    assert plain.layout == plan_layout(500, 2, 20, index="bitmap")
    x = torch.zeros(500)
    x[3] = 1.0
    fingerprints = {plain.layout.fingerprint}
    for options in (dict(verify=True), dict(rtol=2.0 ** -12), dict(rtol=2.0 ** -12, verify=True)):
        other = LosslessCodec(500, 2, 20, index="bitmap", **options)
        assert other.payload_numel == plain.payload_numel
        fingerprints.add(other.layout.fingerprint)
        _, rep = plain.decode(plain.encode(x) + other.encode(x))
        assert rep.status == DecodeStatus.CONFIGURATION_MISMATCH, rep.reason
        y, rep = other.decode(other.encode(x) + other.encode(x))
        assert rep.ok and float(y[3]) == 2.0
    assert len(fingerprints) == 4
    with pytest.raises(TypeError, match="verify"):
        LosslessCodec(500, 2, 20, verify=1)


@pytest.mark.parametrize("index", KINDS)
def test_single_bit_flips_in_the_sketch_never_decode_ok_and_wrong(index):
    """Flip one bit of one sketch or mass word (high mantissa and exponent bits, where the issue saw
    39% of flips decode ok=True with an error above 1%): ok only with the true aggregate (within
    rtol), and most flips are caught (SKETCH_CORRUPT, or the flipped cell's keys INEXACT)."""
    codec, xs, summed = corruption_case(index)
    L = codec.layout
    rng = np.random.default_rng(helpers.stable_seed("flips", index))
    words = rng.choice(np.arange(L.sketch_offset, L.payload_numel), 120, replace=False)
    caught = 0
    for w, bit in zip(words.tolist(), rng.integers(20, 31, words.size).tolist()):
        p = summed.clone()
        p[w : w + 1].view(torch.int32).bitwise_xor_(1 << bit)
        y, rep = codec.decode(p)
        if rep.ok:
            helpers.assert_contract(L, xs, y, rep.inexact_keys, codec.rtol)
        elif rep.status == DecodeStatus.INEXACT:
            helpers.assert_contract(L, xs, y, rep.inexact_keys, codec.rtol)
            caught += 1
        else:
            caught += 1
    assert caught >= 0.5 * words.size, caught


@pytest.mark.parametrize("index", KINDS)
def test_all_zero_sketch_under_a_valid_index_is_corrupt(index):
    codec, xs, summed = corruption_case(index)
    L = codec.layout
    p = summed.clone()
    p[L.sketch_offset:] = 0.0          # values and masses
    y, rep = codec.decode(p)
    assert not rep.ok and rep.status == DecodeStatus.SKETCH_CORRUPT, rep.reason
    p = summed.clone()
    p[L.sketch_offset:L.mass_offset] = 0.0   # values only: every key reads 0 with a positive bound
    y, rep = codec.decode(p)
    assert not rep.ok, rep.reason
    if rep.status == DecodeStatus.INEXACT:
        helpers.assert_contract(L, xs, y, rep.inexact_keys, codec.rtol)


@pytest.mark.parametrize("index", KINDS)
def test_a_value_word_off_by_a_key_is_corrupt(index):
    """A value cell whose keys were all subtracted must be 0 within its bound: adding a clear
    amount to one such cell (a cell no key is read from) is SKETCH_CORRUPT."""
    codec, xs, summed = corruption_case(index)
    L = codec.layout
    _, rep = codec.decode(summed, trace=True)
    assert rep.status in (DecodeStatus.OK, DecodeStatus.INEXACT)
    read = set(rep.trace[1].tolist())
    mass = summed[L.mass_offset:]
    checked = [c for c in range(L.sketch.cells) if c not in read]
    assert checked
    for c in checked[:10]:
        p = summed.clone()
        p[L.sketch_offset + c] += 0.5 + float(mass[c])
        _, rep = codec.decode(p)
        assert rep.status == DecodeStatus.SKETCH_CORRUPT, (c, rep.reason)


# -- the dense kind and output dtypes ---------------------------------------------------------------

def test_dense_kind_checks_non_finite_values():
    """index="dense" (what "auto" picks for small tensors) reports a NaN word and a float32 overflow
    of the sum (3e38 + 3e38) like the other kinds (issue #19 item 6)."""
    codec = LosslessCodec(64, 2, 64, index="dense")
    x = torch.zeros(64)
    x[5] = 3e38
    y, rep = codec.decode(codec.encode(x) + codec.encode(x))
    assert not rep.ok and rep.status == DecodeStatus.SKETCH_OVERFLOW, rep.reason
    p = codec.encode(torch.ones(64)) * 2
    p[HEADER_FIELDS + 7] = float("nan")
    y, rep = codec.decode(p)
    assert not rep.ok and rep.status == DecodeStatus.SKETCH_OVERFLOW, rep.reason
    y, rep = codec.decode(codec.encode(torch.ones(64)) * 2)
    assert rep.ok and torch.equal(y, torch.full((64,), 2.0))


@pytest.mark.parametrize("index", ["dense", "bitmap"])
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.uint8, torch.bool])
def test_integer_output_dtypes_are_refused(index, dtype):
    """decode(dtype=<integer>) used to truncate 0.8 to 0 with ok=True (issue #19 item 7)."""
    codec = LosslessCodec(64, 2, 8, index=index)
    x = torch.zeros(64)
    x[3] = 0.4
    p = codec.encode(x) * 2
    with pytest.raises(TypeError, match="integer"):
        codec.decode(p, dtype=dtype)
    y, rep = codec.decode(p, dtype=torch.float64)
    assert rep.ok and y.dtype == torch.float64 and y[3].item() == pytest.approx(0.8)
