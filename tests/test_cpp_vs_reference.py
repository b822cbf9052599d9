"""The C++ kernels against the pure-torch reference (lossless_hc/lhc/reference.py).

Encode: the whole payload must be bit-identical -- header, index words and the value sketch. The
sketch comparison is bit-exact too, not a tolerance: the reference replays the C++ float32
accumulation order exactly (per cell, contributions in increasing key order; see reference.py), so
any difference is a real divergence (different cells, weights, order or arithmetic).

Decode: both read every key from the same cell (the lowest-numbered pure one of its peeling round),
but the reference accumulates its bounds and cells in its own float64 order (not rounded up to float
per update as the C++ and CUDA decoders do), so decoded values differ in rounding only; everything integer (verdict, candidates, support, false positives) must agree exactly
and both outputs must satisfy the rigorous error bound of their own peeling order.
"""
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import helpers
from lossless_hc import LosslessCodec
from lossless_hc.lhc import reference as reference
from lossless_hc.lhc.layout import HEADER_FIELDS, HDR_NON_FINITE, HDR_OVERLOADED, HDR_SATURATED


def bits(t: torch.Tensor) -> torch.Tensor:
    """The float32 bit patterns, with every NaN mapped to one pattern (IEEE-754 leaves a NaN's sign and
    payload to the hardware, e.g. NaN * -1 on x86 vs ARM)."""
    b = t.contiguous().view(torch.int32).clone()
    b[torch.isnan(t.contiguous())] = 0x7FC00000
    return b


def assert_payload_identical(codec: LosslessCodec, x: torch.Tensor) -> torch.Tensor:
    got = codec.encode(x)
    want = reference.encode(codec.layout, x)
    L = codec.layout
    assert got.shape == want.shape == (L.payload_numel,)
    assert torch.equal(bits(got[:HEADER_FIELDS]), bits(want[:HEADER_FIELDS])), \
        f"header differs: {got[:HEADER_FIELDS].tolist()} vs {want[:HEADER_FIELDS].tolist()}"
    if L.index_kind == "dense":
        assert torch.equal(bits(got), bits(want))
        return got
    gi, wi = got[L.index_offset:L.sketch_offset], want[L.index_offset:L.sketch_offset]
    assert torch.equal(bits(gi), bits(wi)), f"index differs at words {(bits(gi) != bits(wi)).nonzero().reshape(-1)[:10].tolist()}"
    gs, ws = got[L.sketch_offset:], want[L.sketch_offset:]
    diff = (bits(gs) != bits(ws)).nonzero().reshape(-1)
    assert diff.numel() == 0, (f"sketch differs in {diff.numel()} floats, first at {diff[:5].tolist()}: "
                               f"{gs[diff[:5]].tolist()} vs {ws[diff[:5]].tolist()}")
    return got


def ref_report(info):
    return SimpleNamespace(ok=info["ok"], reason=info["reason"], trace=info["trace"], support=info["support"],
                           inexact_keys=info["inexact_keys"])


# -- the hash family seen through the payload -------------------------------------------------------

@pytest.mark.parametrize("index", ["bitmap", "bloom", "multilevel"])
def test_one_hot_keys_land_in_reference_cells(index):
    """Encode single keys: the C++ sketch holds weight * value exactly in the reference's three cells
    with the reference's weights (and the Bloom index +1 exactly in the reference's three counters)."""
    numel = 5000
    codec = LosslessCodec(numel, 4, 50, seed=12345, index=index)
    L = codec.layout
    keys = list(range(20)) + list(np.random.default_rng(0).choice(numel, 80, replace=False)) + [numel - 1]
    for k in keys:
        x = torch.zeros(numel)
        x[k] = 1.5
        p = codec.encode(x)
        cells, weights = reference.key_cells(L.sketch, torch.tensor([k]))
        expect = torch.zeros(L.sketch.cells)
        expect[cells[0]] = 1.5 * weights[0].float()
        assert torch.equal(p[L.sketch_offset:L.mass_offset], expect), f"key {k}"
        if index == "bloom":
            bc, _ = reference.key_cells(L.bloom, torch.tensor([k]))
            digits = reference.unpack_digits(L, p[L.index_offset:L.sketch_offset].to(torch.int64))
            assert sorted(digits.nonzero().reshape(-1).tolist()) == sorted(bc[0].tolist())
            assert digits.sum().item() == 3


# -- encode: bit-exact ------------------------------------------------------------------------------

@pytest.mark.parametrize("index", ["bitmap", "bloom", "multilevel", "dense"])
@pytest.mark.parametrize("block,numel", [(1, 1000), (1, 1), (3, 1000), (3, 998), (32, 1024), (32, 1000), (32, 17)])
@pytest.mark.parametrize("dist", helpers.DISTS)
def test_encode_identical(index, block, numel, dist):
    rng = np.random.default_rng(helpers.stable_seed(index, block, numel, dist))
    num_keys = -(-numel // block)
    n, k = 3, max(1, num_keys // 8)
    codec = LosslessCodec(numel, n, k * block, block_size=block, seed=7, index=index)
    assert codec.index_kind == index
    for x in helpers.make_inputs(rng, numel, block, n, k, "random", dist, zero_lanes=0.25):
        assert_payload_identical(codec, x)
    # the last (possibly partial) block alone
    x = torch.zeros(numel)
    x[-1] = -2.5
    assert_payload_identical(codec, x)
    # all zeros, negative zeros (count as zero), and one subnormal (counts as non-zero)
    assert_payload_identical(codec, torch.zeros(numel))
    assert_payload_identical(codec, torch.full((numel,), -0.0))
    x = torch.zeros(numel)
    x[numel // 2] = 1e-45
    assert_payload_identical(codec, x)


@pytest.mark.parametrize("index", ["bitmap", "bloom", "multilevel", "dense"])
def test_encode_identical_flags(index):
    """Overloaded, non-finite and (Bloom) saturated inputs: the flags and everything else bit-exact."""
    numel = 2000
    codec = LosslessCodec(numel, 2, 20, seed=3, index=index)
    rng = np.random.default_rng(1)
    x = torch.from_numpy(helpers.values(rng, "normal", numel))        # fully dense: overloaded
    p = assert_payload_identical(codec, x)
    if index != "dense":
        assert p[HDR_OVERLOADED] == 1
        if index == "bloom":
            assert p[HDR_SATURATED] == 1                                 # 2000 keys in a small filter
    for bad in (float("nan"), float("inf"), -float("inf")):
        y = torch.zeros(numel)
        y[5] = 1.0
        y[77] = bad
        p = assert_payload_identical(codec, y)
        assert p[HDR_NON_FINITE] == 1


def test_bloom_saturates_above_the_digit_cap_only():
    """A Bloom counter of exactly digit_cap keys still fits its digit (not saturated); digit_cap + 1
    keys saturate it (counter clamped to digit_cap, HDR_SATURATED set). C++ and reference agree."""
    numel = 2000
    codec = LosslessCodec(numel, 2, 20, block_size=1, seed=3, index="bloom")
    L = codec.layout
    cap = L.digit_cap
    bcells, _ = reference.key_cells(L.bloom, torch.arange(numel))
    counts = torch.bincount(bcells.reshape(-1), minlength=L.bloom.cells)
    cell = int((counts >= cap + 1).nonzero()[0])
    hits = (bcells == cell).any(dim=1).nonzero().reshape(-1)
    for n, saturated in ((cap, 0), (cap + 1, 1)):
        x = torch.zeros(numel)
        x[hits[:n]] = 1.0
        p = assert_payload_identical(codec, x)
        assert p[HDR_OVERLOADED] == 0 and p[HDR_SATURATED] == saturated, n
        digits = reference.unpack_digits(L, p[L.index_offset:L.sketch_offset].to(torch.int64))
        assert int(digits[cell]) == cap and int(digits.max()) == cap


@settings(max_examples=60)
@given(block=st.sampled_from([1, 2, 3, 5, 32]), index=st.sampled_from(["bitmap", "bloom", "multilevel", "dense"]),
       pattern=st.sampled_from(helpers.PATTERNS), dist=st.sampled_from(helpers.DISTS),
       seed=st.integers(0, 2 ** 64 - 1), data_seed=st.integers(0, 2 ** 32 - 1))
def test_encode_identical_hypothesis(block, index, pattern, dist, seed, data_seed):
    rng = np.random.default_rng(data_seed)
    n, numel, density = helpers.draw_sizes(rng, max_density=0.5)
    num_keys = -(-numel // block)
    k = int(density * num_keys)
    codec = LosslessCodec(numel, n, max(1, k) * block, block_size=block, seed=seed, index=index)
    for x in helpers.make_inputs(rng, numel, block, min(n, 3), k, pattern, dist, zero_lanes=0.3):
        assert_payload_identical(codec, x)


# -- decode: same verdict and support, both within the bound ----------------------------------------

@settings(max_examples=50)
@given(block=st.sampled_from([1, 3, 32]), index=st.sampled_from(["bitmap", "bloom", "multilevel"]),
       pattern=st.sampled_from(helpers.PATTERNS), seed=st.integers(0, 1000), data_seed=st.integers(0, 2 ** 32 - 1),
       verify=st.booleans())
def test_decode_agrees_with_reference(block, index, pattern, seed, data_seed, verify):
    rng = np.random.default_rng(data_seed)
    n, numel, density = helpers.draw_sizes(rng, max_n=12, max_density=0.3)
    num_keys = -(-numel // block)
    k = max(1, int(density * num_keys))
    codec = LosslessCodec(numel, n, k * block, block_size=block, seed=seed, index=index, verify=verify)
    xs = helpers.make_inputs(rng, numel, block, n, k, pattern, "normal")
    summed = helpers.sum_payloads([codec.encode(x) for x in xs], rng, "sequential")
    y, rep = codec.decode(summed, trace=True)
    yr, info = reference.decode(codec.layout, summed, verify=verify)
    # The bounds differ in their last bits (the reference keeps them in float64, the C++ rounds them up
    # to float after each update), so a key at the edge of rtol may fall either way: OK and INEXACT are
    # one verdict here; each decoder's inexact keys must then cover the keys it got outside rtol.
    assert helpers.peeled_ok(rep) == helpers.peeled_ok(info), (rep.reason, info["reason"])
    assert (rep.candidates, rep.support, rep.false_positives, rep.peeled) == \
        (info["candidates"], info["support"], info["false_positives"], info["peeled"])
    if info["trace"] is not None:        # the reference got as far as peeling the value sketch
        assert sorted(rep.trace[0].tolist()) == sorted(info["trace"][0].tolist())
    if helpers.peeled_ok(rep):
        helpers.assert_lossless(codec.layout, xs, y, rep)
        helpers.assert_lossless(codec.layout, xs, yr, ref_report(info))
        helpers.assert_contract(codec.layout, xs, yr, info["inexact_keys"], codec.rtol)


@pytest.mark.parametrize("index", ["bitmap", "bloom", "multilevel"])
def test_grouped_sketch_matches_reference(index):
    """Above 2 * GROUP_KEYS candidate keys the value sketch splits into groups of three sub-tables
    (encoded by a group-bucketed parallel scatter, peeled group by group). Encode stays bit-exact
    with the reference at any thread count, and the decode is lossless within the trace bound."""
    rng = np.random.default_rng(helpers.stable_seed("grouped", index))
    n, numel, k = 4, 1 << 20, 70_000
    codecs = [LosslessCodec(numel, n, k, seed=5, index=index, num_threads=t) for t in (1, 2)]
    L = codecs[0].layout
    assert L.sketch.seg_count > 3, "this configuration no longer exercises the grouped sketch"
    xs = helpers.make_inputs(rng, numel, 1, n, k, "random", "normal")
    for x in xs[:2]:
        for c in codecs:
            assert_payload_identical(c, x)
    summed = helpers.sum_payloads([codecs[1].encode(x) for x in xs], rng)
    y, rep = codecs[1].decode(summed, trace=True)
    yr, info = reference.decode(L, summed)
    assert helpers.peeled_ok(rep) and helpers.peeled_ok(info), (rep.reason, info["reason"])
    assert (rep.candidates, rep.support, rep.false_positives) == \
        (info["candidates"], info["support"], info["false_positives"])
    helpers.assert_lossless(L, xs, y, rep)
