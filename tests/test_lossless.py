"""The lossless property: the decoded aggregate has exactly the dense sum's non-zero keys, and values
within a rigorous float-rounding bound derived from the decoder's own peeling trace
(helpers.peel_error_bound) and within the bounds the decoder reports (error_bounds), whatever order
and grouping the engine sums the payloads in; and the same for AVERAGE aggregation."""
import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

import helpers
from lossless_hc import LosslessCodec
from lossless_hc.lhc.layout import HEADER_FIELDS, MAX_KEYS
from lossless_hc.lhc.status import DecodeStatus

# Hypothesis picks the categorical knobs and the seeds; the sizes come from helpers.draw_sizes.
workloads = dict(
    block=st.sampled_from([1, 2, 3, 32]),
    slack=st.sampled_from([1.0, 1.5, 4.0]),             # capacity / keys actually sent per rank
    index=st.sampled_from(["auto", "bitmap", "bloom", "multilevel"]),
    pattern=st.sampled_from(helpers.PATTERNS),
    dist=st.sampled_from(helpers.DISTS),
    zero_lanes=st.sampled_from([0.0, 0.5]),
    seed=st.integers(0, 2 ** 32),
    data_seed=st.integers(0, 2 ** 32 - 1),
)


def build(block, slack, index, pattern, dist, zero_lanes, seed, data_seed):
    """A codec and the workers' inputs (sizes from ``helpers.draw_sizes``)."""
    rng = np.random.default_rng(data_seed)
    n, numel, density = helpers.draw_sizes(rng)
    num_keys = -(-numel // block)
    k = int(round(density * num_keys))
    codec = LosslessCodec(numel, n, max(1, int(k * slack)) * block, block_size=block, seed=seed, index=index)
    xs = helpers.make_inputs(rng, numel, block, n, k, pattern, dist, zero_lanes=zero_lanes)
    return rng, codec, xs


@settings(max_examples=60)
@given(how=st.sampled_from(["sequential", "tree", "stack"]), **workloads)
def test_sum_is_lossless(how, **kw):
    rng, codec, xs = build(**kw)
    payloads = [codec.encode(x) for x in xs]
    summed = helpers.sum_payloads(payloads, rng, how)
    y, report = codec.decode(summed, trace=True, error_bounds=True)
    assert report.contributors == len(xs)
    helpers.assert_lossless(codec.layout, xs, y, report, strict_support=kw["dist"] == "normal")


@settings(max_examples=30)
@given(**workloads)
# a dense layout with data (12 ranks, 1415 coordinates, 35% non-zero): its whole header is compared too
@example(block=1, slack=1.0, index="dense", pattern="random", dist="wide", zero_lanes=0.0, seed=0, data_seed=4)
def test_any_summation_order_decodes_the_same_support(**kw):
    """Different orders and groupings change the sketch's float32 rounding, never the integer fields
    or the recovered support; every order stays within the bound."""
    rng, codec, xs = build(**kw)
    payloads = [codec.encode(x) for x in xs]
    L = codec.layout
    ints = None
    for how in ("sequential", "tree", "stack", "sequential"):
        summed = helpers.sum_payloads(payloads, rng, how)
        head = summed[: L.sketch_offset] if L.index_kind != "dense" else summed[:HEADER_FIELDS]
        if ints is None:
            ints = head
        assert torch.equal(head, ints), "integer fields depend on the summation order"
        y, report = codec.decode(summed, trace=True)
        helpers.assert_lossless(L, xs, y, report, strict_support=kw["dist"] == "normal")


@settings(max_examples=40)
@given(avg=st.sampled_from(["divide", "reciprocal"]), **workloads)
def test_average_is_lossless(avg, **kw):
    rng, codec, xs = build(**kw)
    summed = helpers.sum_payloads([codec.encode(x) for x in xs], rng, "tree")
    averaged = helpers.average_payloads(summed, len(xs), avg)
    y, report = codec.decode(averaged, averaged=True, trace=True, error_bounds=True)
    helpers.assert_lossless(codec.layout, xs, y, report, averaged=True, strict_support=kw["dist"] == "normal")


@pytest.mark.parametrize("index", ["bitmap", "bloom", "multilevel", "dense"])
@pytest.mark.parametrize("n", [2, 3, 7, 16])
def test_averaged_flag_mismatch_is_reported(index, n):
    rng = np.random.default_rng(helpers.stable_seed(index, n))
    numel, k = 600, 20
    codec = LosslessCodec(numel, n, k, index=index)
    xs = helpers.make_inputs(rng, numel, 1, n, k, "random", "normal")
    summed = helpers.sum_payloads([codec.encode(x) for x in xs], rng)
    avg = helpers.average_payloads(summed, n)
    y, rep = codec.decode(summed, averaged=True)
    assert not rep.ok and "contributions" in rep.reason, rep.reason
    y, rep = codec.decode(avg, averaged=False)
    assert not rep.ok and "averaged=True" in rep.reason, rep.reason
    # and the matching flags decode
    assert helpers.peeled_ok(codec.decode(summed)[1]) and helpers.peeled_ok(codec.decode(avg, averaged=True)[1])


@pytest.mark.parametrize("n", [2, 3])
def test_a_contribution_count_mismatch_hints_at_the_averaged_flag_only_where_that_explains_it(n):
    """WRONG_CONTRIBUTORS names the count it read, and adds a hint only where the averaged flag explains
    it: a SUM decoded as an average reads n * n contributions, an AVERAGE decoded as a sum reads 1; a
    partial sum (n - 1 payloads) or a partial average reads n - 1 and gets no hint."""
    codec = LosslessCodec(600, n, 20, index="bitmap")
    rng = np.random.default_rng(n)
    xs = helpers.make_inputs(rng, 600, 1, n, 20, "random", "normal")
    payloads = [codec.encode(x) for x in xs]
    summed, partial = sum(payloads), sum(payloads[1:])
    expect = f"expected world_size={n}"
    cases = [(summed, True,
              f"payload aggregates {n * n} contributions, {expect} (a summed payload? pass averaged=False)"),
             (summed / n, False,
              f"payload aggregates 1 contributions, {expect} (an averaged payload? pass averaged=True)")]
    if n > 2:   # at 2 ranks a partial sum is one payload: an average's count
        cases += [(partial, False, f"payload aggregates {n - 1} contributions, {expect}"),
                  (partial / n, True, f"payload aggregates {n - 1} contributions, {expect}")]
    for payload, averaged, reason in cases:
        y, rep = codec.decode(payload, averaged=averaged)
        assert rep.status == DecodeStatus.WRONG_CONTRIBUTORS and rep.reason == reason, rep.reason
        assert bool(torch.isnan(y).all())


def test_world_size_one_sum_and_average_coincide():
    codec = LosslessCodec(100, 1, 10)
    x = torch.zeros(100)
    x[[1, 50, 99]] = torch.tensor([1.0, -2.0, 3.0])
    p = codec.encode(x)
    for averaged in (False, True):
        y, rep = codec.decode(p, averaged=averaged)
        assert rep.ok and torch.equal(y, x)


@pytest.mark.parametrize("index", ["bitmap", "bloom", "multilevel"])
def test_exact_cancellation_stays_within_the_bound(index):
    """Two ranks hold opposite values on shared keys: the dense sum is exactly 0 there, the codec's
    peeled value is only guaranteed to be within the rounding bound of 0 (it may be a tiny residue:
    the float32 sketch cells mix the cancelling keys with their cell-mates). Untouched keys stay
    exact zeros."""
    for seed in range(30):
        rng = np.random.default_rng(seed)
        n, numel, k = 4, 400, 30
        codec = LosslessCodec(numel, n, k, seed=seed, index=index)
        xs = helpers.make_inputs(rng, numel, 1, n, k, "disjoint", "normal")
        shared = helpers.nonzero_keys(xs[0], 1)[:10]
        xs[1][helpers.nonzero_keys(xs[1], 1)[:10]] = 0.0
        xs[1][shared] = -xs[0][shared]
        y, rep = codec.decode(helpers.sum_payloads([codec.encode(x) for x in xs], rng), trace=True)
        assert helpers.peeled_ok(rep), rep.reason   # a cancelled key is 0 within its bound: often INEXACT
        truth = helpers.dense_sum64(xs)
        assert bool((truth[shared] == 0).all())
        bound = helpers.peel_error_bound(codec.layout, xs, rep.trace, n)
        assert bool(((y.double() - truth).abs() <= bound + helpers.U32 * truth.abs() + 1e-30).all())
        touched = torch.zeros(numel, dtype=torch.bool)
        for x in xs:
            touched |= x != 0
        assert bool((y[~touched] == 0).all())


# Integer words near the 2**22 field limit, averaged by multiplying with fl(1/n): the two roundings
# move avg * n by up to ~0.3 (found by exhaustive search over n <= 1024 and the top 1.5M words of each
# packing). lhc_layout.h bounds the error below 1/2, and the decoder must accept these averages.
RECIPROCAL_WORDS = [(41, 3040895), (44, 3670027), (158, 3961331), (159, 4052669)]


@pytest.mark.parametrize("n,word", RECIPROCAL_WORDS)
def test_reciprocal_average_of_a_full_index_word(n, word):
    codec = LosslessCodec(16, n, 16, index="bitmap")
    P = codec.layout.index
    digits = [(word // P.base ** i) % P.base for i in range(P.per_word)]
    assert P.base == n + 1 and all(d <= n for d in digits)
    xs = []
    for r in range(n):                     # key i is held by the first digits[i] ranks
        x = torch.zeros(16)
        for i, d in enumerate(digits):
            if r < d:
                x[i] = 1.0 + r
        xs.append(x)
    summed = helpers.sum_payloads([codec.encode(x) for x in xs], np.random.default_rng(0))
    assert summed[codec.layout.index_offset].item() == word
    assert codec.decode(helpers.average_payloads(summed, n, "divide"), averaged=True)[1].ok
    y, rep = codec.decode(helpers.average_payloads(summed, n, "reciprocal"), averaged=True, trace=True)
    helpers.assert_lossless(codec.layout, xs, y, rep, averaged=True)


def test_readme_recipe_reaggregates_inexact_keys_into_the_exact_sum():
    """README "The codec": 8 ranks of 10,000 N(0,1) non-zeros in 10^6 coordinates decode INEXACT (1,231
    of 77,319 keys listed, some of them outside rtol); summing just the listed coordinates densely and
    writing them into the decoded tensor gives the exact aggregate at every coordinate."""
    import lossless_hc as lhc
    from lossless_hc.lhc.contract import outside_contract, truth

    d, n = 1_000_000, 8
    codec = lhc.LosslessCodec(numel=d, world_size=n, max_nnz=10_000, block_size=1, seed=0, device="cpu")
    g = torch.Generator().manual_seed(0)
    grads = []
    for _ in range(n):
        x = torch.zeros(d)
        x[torch.randperm(d, generator=g)[:10_000]] = torch.randn(10_000, generator=g)
        grads.append(x)
    y, report = codec.decode(sum(codec.encode(x) for x in grads))
    # the counts the README states: a change of layout or hashing that moves them must update it
    assert report.status == lhc.DecodeStatus.INEXACT and (report.inexact_keys.numel(), report.support) == (1231, 77319)
    s, a = truth(grads)
    assert outside_contract(y, s, a, n, codec.rtol).any()            # the listed keys need the fix
    coords = report.inexact_keys
    y.reshape(-1)[coords] = sum(x.reshape(-1)[coords] for x in grads)  # the engine's dense SUM of them
    assert not outside_contract(y, s, a, n, codec.rtol).any()


def test_keys_beyond_the_cpu_decoders_32_bit_loops_are_refused():
    """Key positions are 32-bit in the peeling tables, and the CPU decoder walks keys in chunks of 4096
    with 32-bit counters (csrc/cpu/peel.cpp) and scans a bitmap's last word past the final key
    (csrc/cpu/support.cpp): MAX_KEYS keeps 4096 below 2^32, so neither wraps (a count within 4096 of
    2^32 looped for ever); a codec of more keys is a ValueError when it is built."""
    assert MAX_KEYS <= (1 << 32) - 4096
    for numel, block in ((MAX_KEYS + 1, 1), (2 * MAX_KEYS + 1, 2)):
        with pytest.raises(ValueError, match="exceeds the supported"):
            LosslessCodec(numel=numel, world_size=2, max_nnz=10, block_size=block)


def test_max_keys_itself_is_supported_and_keys_are_counted_in_integers():
    """MAX_KEYS is the largest supported key count, itself included (a Bloom index plans it without
    allocating anything), and the count is the exact ``ceil(numel / block_size)`` in integers: numel
    ``MAX_KEYS * 2**30 + 1`` with blocks of ``2**30`` (past float64's 53 bits) is one key too many."""
    from lossless_hc import plan_layout
    for numel, block in ((MAX_KEYS, 1), (2 * MAX_KEYS, 2)):
        assert plan_layout(numel, 2, 10, block_size=block, index="bloom").num_keys == MAX_KEYS
    with pytest.raises(ValueError, match=f"= {MAX_KEYS + 1} keys exceeds the supported {MAX_KEYS}"):
        plan_layout(MAX_KEYS * (1 << 30) + 1, 2, 10, block_size=1 << 30, index="bloom")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("index", ["bitmap", "bloom", "multilevel", "dense"])
@pytest.mark.parametrize("block", [1, 8])
def test_a_payload_tells_the_keys_its_encode_found(device, index, block):
    """encoded_keys(payload): the blocks of the input holding a value other than +-0.0 (NaN and
    infinities count; -0.0 does not), as the row scan counts them, beyond the capacity too (the
    overloaded payload's count is the whole one); None for the dense index kind, which does not count."""
    from lossless_hc.backends import backend_for
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    keys = 20000
    g = torch.Generator().manual_seed(block)
    x = torch.zeros(keys, block)
    hit = torch.randperm(keys, generator=g)[:300]
    x[hit, torch.randint(0, block, (300,), generator=g)] = torch.randn(300, generator=g)
    x[hit[:5]] = 0.0
    x[hit[0], block - 1] = -0.0
    x[hit[1], 0] = float("nan")
    x[hit[2], 0] = float("-inf")
    x.view(torch.int32)[hit[3], 0] = 1   # the smallest subnormal
    want = int(backend_for("cpu").nonzero_rows(x.reshape(-1), block).sum())
    assert want == 300 - 5 + 3
    for capacity in (400, 100):   # within the capacity, and overloaded
        codec = LosslessCodec(keys * block, 2, capacity * block, block_size=block, index=index, device=device)
        got = codec.encoded_keys(codec.encode(x.to(device)))
        assert got == (None if index == "dense" else want), (capacity, got)


def test_unresolved_counts_the_support_keys_the_peel_left():
    """DecodeReport.unresolved is support - peeled: 0 for an exact decode, and the keys left over when
    peeling stopped (an overloaded rank's 60 keys in a sketch sized for 8: 59 of them)."""
    codec = LosslessCodec(1000, 2, 4, index="bitmap")
    x = torch.zeros(1000)
    x[:3] = torch.tensor([1.0, 2.0, 3.0])
    _, rep = codec.decode(codec.encode(x) + codec.encode(x))
    assert rep.ok and (rep.support, rep.peeled, rep.unresolved) == (3, 3, 0), rep.reason
    x[:60] = torch.arange(1.0, 61.0)
    _, rep = codec.decode(codec.encode(x) + codec.encode(torch.zeros(1000)))
    assert rep.status == DecodeStatus.SKETCH_PEEL_FAILED and rep.support == 60, rep.reason
    assert rep.unresolved == rep.support - rep.peeled == 59


def test_trace_and_error_bounds_come_only_when_asked():
    """decode attaches the peeling trace and the error bounds only with trace=True / error_bounds=True:
    by default both stay None (an exact decode of three keys)."""
    codec = LosslessCodec(1000, 2, 10, index="bitmap")
    x = torch.zeros(1000)
    x[[3, 50, 700]] = torch.tensor([1.0, -2.0, 0.5])
    p = codec.encode(x) + codec.encode(x)
    y, rep = codec.decode(p)
    assert rep.ok and torch.equal(y, 2 * x) and rep.trace is None and rep.error_bounds is None
    _, rep = codec.decode(p, trace=True, error_bounds=True)
    assert rep.ok and rep.trace is not None and rep.error_bounds[0].tolist() == [3, 50, 700]


def test_an_overloaded_rank_is_never_ok_even_when_every_key_came_back():
    """A rank over capacity (5 keys, capacity 4) makes the decode OVERLOADED, never OK, even when the
    sketch's slack let every key be recovered (the reason says so); a failed peel keeps its own status."""
    codec = LosslessCodec(1000, 2, 4, index="bitmap")
    x = torch.zeros(1000)
    x[[1, 100, 200, 300, 400]] = torch.arange(1.0, 6.0)
    y, rep = codec.decode(codec.encode(x) + codec.encode(torch.zeros(1000)))
    assert rep.status == DecodeStatus.OVERLOADED and not rep.ok and rep.overloaded_ranks == 1
    assert rep.reason == ("overloaded: 1 rank(s) had more than capacity=4 non-zero keys; grow max_nnz "
                          "(recovered 5/5 keys)")
    assert torch.equal(y, x)


@pytest.mark.parametrize("index", ["dense", "bitmap"])
def test_support_counts_keys_for_every_index_kind(index):
    """``DecodeReport.support``: the keys (blocks) non-zero on some rank, for the dense index as for the
    others -- not its non-zero elements -- a partial last block included (what the planner and the
    aggregators' density trackers read as the union)."""
    numel, block = 30, 4   # 8 keys, the last of 2 coordinates
    codec = LosslessCodec(numel, 2, numel, block_size=block, index=index)
    assert codec.layout.index_kind == index
    xs = [torch.zeros(numel), torch.zeros(numel)]
    xs[0][[0, 1, 2, 9]] = torch.tensor([1.0, 2.0, 3.0, 4.0])   # keys 0, 2
    xs[1][[3, 10, 29]] = torch.tensor([5.0, 6.0, 7.0])          # keys 0, 2, 7
    y, report = codec.decode(codec.encode(xs[0]) + codec.encode(xs[1]))
    assert report.status in (DecodeStatus.OK, DecodeStatus.INEXACT) and report.support == 3
    if index == "dense":
        assert report.ok and torch.equal(y, xs[0] + xs[1])
