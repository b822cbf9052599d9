"""THCCodec's bad input and misuse: non-finite gradients, configurations, seeds, ranks, tensors, the
aggregation the payload went through, output buffers, mismatched configurations, state round trips (the
codec itself: tests/test_thc.py)."""
import pytest
import torch

import lossless_hc as lhc
from lossless_hc.thc.layout import HEADER_FIELDS
from test_thc import make_ranks, rewindable, run_step


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_input_raises_on_every_rank_and_resets_that_memory(bad):
    """A NaN/Inf input (found by the encode pass itself, no separate scan): that rank sends only the
    header with the flag, its error memory is reset to zero, every rank's decode raises."""
    n, numel = 3, 5000
    codecs = make_ranks(n, numel, initial_norm=50.0)
    run_step(codecs, [torch.randn(numel) for _ in range(n)])   # a non-zero memory on every rank
    assert all(float(c.error.abs().max()) > 0 for c in codecs)
    xs = [torch.randn(numel) for _ in range(n)]
    xs[1][4321] = bad
    payloads = [c.encode(x) for c, x in zip(codecs, xs)]
    assert bool((codecs[1].error == 0).all()) and float(codecs[0].error.abs().max()) > 0
    assert float(payloads[1][2]) == 1.0 and bool((payloads[1][HEADER_FIELDS:] == 0).all())
    assert float(payloads[1][1]) == float(payloads[0][1])   # the fingerprint is still written
    summed = sum(payloads)
    for c in codecs:
        with pytest.raises(FloatingPointError, match="1 rank"):
            c.decode(summed)
    # The state advanced identically: the next step works.
    ys = run_step(codecs, [torch.randn(numel) for _ in range(n)])
    assert all(torch.equal(ys[0], y) for y in ys)


def test_non_finite_input_on_every_rank_raises_naming_them_all():
    """The flag count summed over the ranks is in [0, n], n included: every rank's input non-finite is the
    FloatingPointError naming all n ranks, not a corrupted header (ValueError)."""
    n = 3
    codecs = make_ranks(n, 64, initial_norm=5.0)
    summed = sum(c.encode(torch.full((64,), float("nan"))) for c in codecs)
    for c in codecs:
        with pytest.raises(FloatingPointError, match="on 3 rank"):
            c.decode(summed)


def test_non_finite_propagate_returns_nan():
    codecs = make_ranks(2, 100, initial_norm=5.0, non_finite="propagate")
    ys = run_step(codecs, [torch.full((100,), float("inf")), torch.randn(100)])
    assert all(bool(torch.isnan(y).all()) for y in ys)


@pytest.mark.parametrize("kwargs,match", [
    ({"numel": 0}, "numel must be a positive"),
    ({"world_size": 0}, "world_size must be"),
    ({"rank": 2}, "rank must be"),
    ({"bits": 0}, "bits must be"),
    ({"granularity": 0}, "granularity must be"),
    ({"overflow_freq": 1}, "overflow_freq"),
    ({"hadamard_block": 1000}, "power of two"),
    ({"payload_dtype": torch.float32}, "payload_dtype"),
    ({"initial_norm": float("nan")}, "initial_norm"),
    ({"non_finite": "ignore"}, "non_finite"),
    # bools where numbers go (True would pass as 1), and an explicit table past the checks table_for makes
    ({"hadamard_block": True}, "power of two"),
    ({"digits_per_word": True}, "digits_per_word"),
    ({"initial_norm": True}, "initial_norm"),
    ({"granularity": True, "levels": (0, 1)}, "granularity must be"),
    ({"bits": 99, "levels": (0, 15, 30)}, "bits must be"),
    ({"levels": (0, 15, 30)}, "levels has 3 entries"),
    ({"bits": 1, "levels": (0, 7.5, 30)}, "levels must be integers"),
])
def test_bad_configuration_is_rejected(kwargs, match):
    args = {"numel": 100, "world_size": 2}
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        lhc.THCCodec(**args)


@pytest.mark.parametrize("seed", [0, 5, (1 << 62) + 3])
def test_seeds_differing_in_bit_63_are_a_configuration_mismatch(seed):
    """#19 item 5: the fingerprint covers all 64 bits of the seed (s and s + 2^63 are caught)."""
    codecs = [lhc.THCCodec(300, 2, rank=0, seed=seed, initial_norm=5.0),
              lhc.THCCodec(300, 2, rank=1, seed=seed + (1 << 63), initial_norm=5.0)]
    summed = sum(c.encode(torch.randn(300)) for c in codecs)
    for c in codecs:
        with pytest.raises(ValueError, match="fingerprints disagree"):
            c.decode(summed)


def test_non_finite_option_reaches_the_codec_through_the_plugins_spec():
    from lossless_hc.training.adapter import THCSpec
    from lossless_hc.training.aggregate import AggregationStats

    spec = THCSpec(non_finite="propagate")
    agg = spec.make("w", torch.zeros(4096), 2, 0, AggregationStats(), torch.device("cpu"))
    assert agg.codec.non_finite == "propagate" and "non_finite='propagate'" in repr(spec)
    assert THCSpec().make("w", torch.zeros(4096), 2, 0, AggregationStats(), "cpu").codec.non_finite == "raise"
    with pytest.raises(ValueError, match="non_finite"):
        THCSpec(non_finite="ignore")


def test_the_plugins_spec_builds_each_rank_s_own_thc_aggregator():
    """THCSpec.make (every plugin's THC) builds rank r's aggregator: its payloads are, bit for bit, those of
    THCAggregator(..., rank=r), each rank's norm in its own slot, so the engine's sum decodes alike."""
    from lossless_hc.training.adapter import THCSpec
    from lossless_hc.training.aggregate import AggregationStats
    from lossless_hc.training.thc_aggregate import THCAggregator

    n, g = 3, torch.Generator().manual_seed(4)
    spec = THCSpec(bits=4, seed=3)
    made = [spec.make("w", torch.zeros(4096), n, r, AggregationStats(), "cpu") for r in range(n)]
    direct = [THCAggregator("w", (4096,), torch.float32, n, r, 4, 30, 32, seed=3) for r in range(n)]
    for step in range(2):   # the first step agrees on a norm, the second sends the gradient
        xs = [torch.randn(4096, generator=g) * (r + 1) for r in range(n)]
        got = [a.encode(x) for a, x in zip(made, xs)]
        want = [a.encode(x) for a, x in zip(direct, xs)]
        assert all(torch.equal(p, q) for (p, _), (q, _) in zip(got, want)), step
        summed = torch.stack([p for p, _ in got]).sum(0)
        for a, (_, ctx), b, (_, wctx) in zip(made, got, direct, want):
            assert torch.equal(a.decode(summed.clone(), ctx).value, b.decode(summed.clone(), wctx).value)


def test_rank_must_be_an_int_in_range():
    for rank in (-1, 2):
        with pytest.raises(ValueError, match="rank must be an integer in"):
            lhc.THCCodec(100, 2, rank)
    for rank in (True, 1.0):          # True would pass as rank 1
        with pytest.raises(TypeError, match="rank must be an int"):
            lhc.THCCodec(100, 2, rank)


def test_bad_tensors_are_rejected():
    c = lhc.THCCodec(100, 2, initial_norm=1.0)
    with pytest.raises(ValueError, match="100"):
        c.encode(torch.zeros(99))
    with pytest.raises(TypeError, match="dtype"):
        c.encode(torch.zeros(100, dtype=torch.int32))
    with pytest.raises(TypeError, match="torch.Tensor"):
        c.encode([0.0] * 100)
    with pytest.raises(RuntimeError, match="without a preceding encode"):
        c.decode(torch.zeros(c.payload_numel, dtype=torch.float64))
    p = c.encode(torch.randn(10, 10, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="twice without decode"):
        c.encode(torch.zeros(100))
    with pytest.raises(TypeError, match="float64"):
        c.decode(p.float())
    with pytest.raises(ValueError, match="1-D"):
        c.decode(p[:-1])


def test_wrong_aggregation_is_named():
    n = 3
    codecs = make_ranks(n, 500, initial_norm=10.0)
    summed = sum(c.encode(torch.randn(500)) for c in codecs)
    with pytest.raises(ValueError, match="pass averaged=True"):
        codecs[0].decode(summed / n)
    codecs = make_ranks(n, 500, initial_norm=10.0, payload_dtype=torch.int64)
    summed = sum(c.encode(torch.randn(500)) for c in codecs)
    with pytest.raises(ValueError, match="int64 payload cannot be averaged"):
        codecs[0].decode(summed, averaged=True)


def test_a_non_bool_averaged_is_refused_before_any_state_changes():
    """decode's averaged must be a bool: a truthy 1 (or "no") would silently decode the payload as an average.
    Refused with TypeError before the step advances, so the same step then decodes with averaged=True."""
    n = 2
    codecs = make_ranks(n, 300, initial_norm=10.0)
    averaged = sum(c.encode(torch.randn(300)) for c in codecs) / n
    for bad in (1, "no"):
        with pytest.raises(TypeError, match="averaged must be a bool"):
            codecs[0].decode(averaged, averaged=bad)
    assert codecs[0].step == 0
    ys = [c.decode(averaged, averaged=True) for c in codecs]
    assert torch.equal(ys[0], ys[1]) and codecs[0].step == 1


def test_a_payload_that_is_not_a_tensor_is_refused_with_a_type_error():
    """A list or numpy array handed to decode (an engine returning the wrong object) is a TypeError naming
    torch.Tensor, raised before the step advances."""
    c = lhc.THCCodec(100, 1, initial_norm=5.0)
    p = c.encode(torch.randn(100))
    for bad in (p.tolist(), p.numpy()):
        with pytest.raises(TypeError, match="payload must be a torch.Tensor"):
            c.decode(bad)
    assert c.step == 0
    c.decode(p)


def test_an_input_or_payload_on_another_device_is_refused_before_any_state_changes():
    """THCCodec.encode's x and decode's payload are checked for the codec's device before any kernel or copy sees
    them: a meta tensor of the right size and dtype is a ValueError naming both devices, the step does not
    advance, and the same step then runs with CPU tensors."""
    c = lhc.THCCodec(100, 1, initial_norm=5.0)
    with pytest.raises(ValueError, match="x is on meta, the codec on cpu"):
        c.encode(torch.zeros(100, device="meta"))
    p = c.encode(torch.randn(100))
    with pytest.raises(ValueError, match="payload is on meta, the codec on cpu"):
        c.decode(torch.zeros(c.payload_numel, dtype=torch.float64, device="meta"))
    assert c.step == 0
    c.decode(p)
    assert c.step == 1


@pytest.mark.parametrize("n", [2, 3])
def test_the_contributor_count_names_the_aggregation_to_pass_and_only_that(n):
    """A SUM decoded as an average counts n * n contributions: the error says to pass averaged=False; an
    AVERAGE decoded as a sum counts 1: it says to pass averaged=True (from two ranks on). A payload that is
    neither (a SUM of two of three ranks) gets the count without a hint."""
    codecs = make_ranks(n, 500, initial_norm=10.0)
    payloads = [c.encode(torch.randn(500)) for c in codecs]
    summed = sum(payloads)
    decode = rewindable(codecs[0])
    with pytest.raises(ValueError, match=r"a summed payload\? pass averaged=False"):
        decode(summed, averaged=True)
    with pytest.raises(ValueError, match=r"an averaged payload\? pass averaged=True"):
        decode(summed / n, averaged=False)
    for averaged in (False, True) if n == 3 else ():   # at n = 2 one rank's payload is what an average looks like
        with pytest.raises(ValueError, match="contributions, expected world_size") as info:
            decode(sum(payloads[1:]) / (n if averaged else 1), averaged=averaged)
        assert "pass averaged" not in str(info.value)


@pytest.mark.parametrize("payload_dtype", [torch.float64, torch.int64])
def test_out_buffers_are_checked_and_overwritten(payload_dtype):
    """encode(x, out=buf) and decode(agg, out=buf) overwrite every element of the caller's buffers and
    give the bits of fresh ones, step after step; an unfit buffer (size, dtype, strides, a negative view)
    is refused before any state changes, so the same step then runs with a fit one."""
    n, numel = 2, 700
    xs = [torch.randn(numel, generator=torch.Generator().manual_seed(r)) for r in range(n)]
    fresh = make_ranks(n, numel, seed=5, payload_dtype=payload_dtype)
    reused = make_ranks(n, numel, seed=5, payload_dtype=payload_dtype)
    P = reused[0].payload_numel
    other = torch.float32 if payload_dtype == torch.float64 else torch.float64
    bad_payloads = [torch.zeros(P + 1, dtype=payload_dtype), torch.zeros(P, dtype=other),
                    torch.zeros(2 * P, dtype=payload_dtype)[::2], torch._neg_view(torch.zeros(P, dtype=payload_dtype))]
    bad_outs = [torch.zeros(numel - 1), torch.zeros(numel, dtype=torch.float64), torch.zeros(2 * numel)[::2],
                torch._neg_view(torch.zeros(numel))]
    for step in range(3):
        want = run_step(fresh, xs)
        for bad in bad_payloads:
            with pytest.raises(ValueError, match="out must be a contiguous|out is a negative view"):
                reused[0].encode(xs[0], out=bad)
        bufs = [torch.full((P,), 3, dtype=payload_dtype) for _ in range(n)]
        payloads = [c.encode(x, out=b) for c, x, b in zip(reused, xs, bufs)]
        assert all(p.data_ptr() == b.data_ptr() for p, b in zip(payloads, bufs))
        agg = sum(payloads)
        for bad in bad_outs:
            with pytest.raises(ValueError, match="out must be a contiguous|out is a negative view"):
                reused[0].decode(agg, out=bad)
        with pytest.raises(ValueError, match="out and the codec's error memory overlap"):
            reused[0].decode(agg, out=reused[0].error)   # it would overwrite what the next step sends
        outs = [torch.full((numel,), 7.0) for _ in range(n)]
        got = [c.decode(agg, out=o) for c, o in zip(reused, outs)]
        for y, w, o in zip(got, want, outs):
            assert y.data_ptr() == o.data_ptr() and torch.equal(y, w)


def test_an_encode_out_overlapping_the_error_memory_is_refused():
    """encode(out=) writes the payload while the kernel reads and rewrites the error memory: a float64
    view of that memory is a buffer of the right dtype and size but is refused before any state changes,
    so the same step then runs with a fit buffer."""
    c = lhc.THCCodec(4096, 2, initial_norm=10.0)
    c.error.normal_()
    before = c.error.clone()
    alias = c.error.view(torch.float64)[:c.payload_numel]
    with pytest.raises(ValueError, match="out and the codec's error memory overlap"):
        c.encode(torch.randn(4096), out=alias)
    assert torch.equal(c.error, before) and c.step == 0
    c.encode(torch.randn(4096), out=torch.empty(c.payload_numel, dtype=torch.float64))


def test_configuration_mismatch_is_detected():
    a = lhc.THCCodec(500, 2, rank=0, seed=1, initial_norm=10.0)
    b = lhc.THCCodec(500, 2, rank=1, seed=2, initial_norm=10.0)
    summed = a.encode(torch.randn(500)) + b.encode(torch.randn(500))
    for c in (a, b):
        with pytest.raises(ValueError, match="mismatch"):
            c.decode(summed)


def test_ranks_with_different_tables_or_at_different_steps_are_a_configuration_mismatch():
    """The fingerprint covers the table's levels and the step (codec docstring: ranks built with different
    arguments, or out of step): two explicit tables of as many levels, or one rank a step ahead with the same
    agreed norm, decode to the named mismatch on every rank, not to a silently wrong sum."""
    tables = [lhc.THCCodec(400, 2, rank=r, bits=2, levels=lv, initial_norm=10.0)
              for r, lv in enumerate([(0, 10, 20, 30), (0, 9, 21, 30)])]
    ahead = lhc.THCCodec(400, 2, rank=1, initial_norm=10.0)
    ahead.load_state_dict({"step": 1, "norm": 10.0, "error": torch.zeros(400)})
    for codecs in (tables, [lhc.THCCodec(400, 2, rank=0, initial_norm=10.0), ahead]):
        summed = sum(c.encode(torch.randn(400)) for c in codecs)
        for c in codecs:
            with pytest.raises(ValueError, match="fingerprints disagree"):
                c.decode(summed)


def test_decode_restores_shape_and_dtype():
    codecs = make_ranks(2, 60, initial_norm=10.0)
    xs = [torch.randn(3, 4, 5, dtype=torch.bfloat16) for _ in range(2)]
    ys = run_step(codecs, xs)
    assert ys[0].shape == (3, 4, 5) and ys[0].dtype == torch.bfloat16


def test_state_dict_round_trip():
    codecs = make_ranks(2, 300)
    run_step(codecs, [torch.randn(300), torch.randn(300)])
    state = codecs[0].state_dict()
    clone = lhc.THCCodec(300, 2, rank=0)
    clone.load_state_dict(state)
    assert clone.step == 1 and clone.norm == codecs[0].norm and torch.equal(clone.error, codecs[0].error)


def test_a_fresh_codec_s_state_loads_at_its_bounds_and_a_slightly_negative_norm_does_not():
    """load_state_dict's step and norm bounds are inclusive at 0: the state of a codec that never ran (step 0,
    norm 0, zero memory) restores, after which the codec runs a norm-only round bit for bit like a fresh one; a
    norm of -0.5 (no codec saves a negative M) is refused, the codec keeping its own state."""
    n, numel = 2, 300
    g = torch.Generator().manual_seed(6)
    codecs = make_ranks(n, numel, seed=2)
    run_step(codecs, [torch.randn(numel, generator=g) for _ in range(n)])
    before = codecs[0].state_dict()
    with pytest.raises(ValueError, match=r"state\['norm'\] must be a finite number >= 0"):
        codecs[0].load_state_dict(dict(before, norm=-0.5))
    assert codecs[0].norm == before["norm"] > 0 and codecs[0].step == 1
    fresh = make_ranks(n, numel, seed=2)
    for c, f in zip(codecs, fresh):
        c.load_state_dict(f.state_dict())
        assert c.step == 0 and c.norm == 0.0 and bool((c.error == 0).all())
    xs = [torch.randn(numel, generator=g) for _ in range(n)]
    want, ys = run_step(fresh, xs), run_step(codecs, xs)
    assert all(bool((y == 0).all()) and torch.equal(y, w) for y, w in zip(ys, want))


def test_load_state_dict_between_encode_and_decode_is_refused():
    """A state loaded while an encode awaits its decode would decode the payload with another step's signs
    and norm: RuntimeError, the codec unchanged, and the pending decode then runs."""
    codecs = make_ranks(2, 64, initial_norm=5.0)
    summed = sum(c.encode(torch.randn(64)) for c in codecs)
    with pytest.raises(RuntimeError, match="between encode and decode"):
        codecs[0].load_state_dict({"step": 5, "norm": 1.0, "error": torch.zeros(64)})
    assert codecs[0].step == 0 and codecs[0].norm == 5.0
    ys = [c.decode(summed) for c in codecs]
    assert torch.equal(ys[0], ys[1]) and codecs[0].step == 1


def test_an_agreed_norm_of_exactly_one_quantizes():
    """Only M = 0 is the norm-only round that decodes zeros: an agreed norm of exactly 1.0 decodes the
    quantized sum (unbiased: here close to the sum, well within its norm)."""
    n, numel = 2, 64
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(numel, generator=g) / 16 for _ in range(n)]   # norms ~0.5, within M = 1
    codecs = make_ranks(n, numel, initial_norm=1.0, error_feedback=False)
    y = run_step(codecs, xs)[0].double()
    truth = sum(x.double() for x in xs)
    assert float((y - truth).norm()) < 0.5 * float(truth.norm())


def test_defaults_are_the_documented_thc_configuration():
    """THCCodec(numel, world_size) is the configuration docs/THC.md builds by hand (bits=4, granularity=30,
    overflow_freq=32, seed=0) with Hadamard blocks of 1024, the best (not the symmetric) table, OpenMP's default
    thread count, rank 0, error feedback on and non-finite inputs raising: its payloads are, bit for bit, those of
    a codec given them."""
    c = lhc.THCCodec(4096, 2, initial_norm=60.0)
    assert (c.table.bits, len(c.table.levels), c.granularity, c.overflow_freq, c.seed) == (4, 16, 30, 32.0, 0)
    assert (c.layout.block, c.num_threads, c.rank, c.non_finite) == (1024, 0, 0, "raise")
    assert c.error is not None and c.payload_dtype == torch.float64
    explicit = lhc.THCCodec(4096, 2, rank=0, bits=4, granularity=30, overflow_freq=32, seed=0, hadamard_block=1024,
                            symmetric_table=False, initial_norm=60.0)
    assert c.table.levels == explicit.table.levels   # the best table, not the symmetric one (16 where it has 15)
    x = torch.randn(4096, generator=torch.Generator().manual_seed(3))
    assert torch.equal(c.encode(x), explicit.encode(x))


def test_an_explicit_table_of_all_g_plus_1_integers_is_accepted():
    """bits=4 at granularity 7: 2^bits > g + 1, so the table is all 8 integers 0..7 (the docstring of bits);
    an explicit table of those 8 levels is the one bits describes, one of 7 is refused."""
    c = lhc.THCCodec(100, 2, bits=4, granularity=7, levels=range(8), initial_norm=5.0)
    assert c.table.levels == tuple(range(8))
    assert c.table.levels == lhc.THCCodec(100, 2, bits=4, granularity=7).table.levels
    with pytest.raises(ValueError, match="levels has 7 entries"):
        lhc.THCCodec(100, 2, bits=4, granularity=7, levels=range(7))


def test_an_initial_norm_of_zero_is_a_norm_only_first_step():
    """initial_norm's range is [0, largest], 0 included: M_0 = 0 is accepted and, as any agreed M of 0, makes
    step 0 a norm-only round, bit for bit the first step of a codec without initial_norm (zeros decoded, all
    of x owed, the same agreed norm learned)."""
    n, numel = 2, 500
    g = torch.Generator().manual_seed(11)
    xs = [torch.randn(numel, generator=g) for _ in range(n)]
    zero, none = make_ranks(n, numel, seed=3, initial_norm=0.0), make_ranks(n, numel, seed=3)
    assert zero[0].norm == 0.0
    payloads = [c.encode(x) for c, x in zip(zero, xs)]
    assert all(torch.equal(p, d.encode(x)) for p, d, x in zip(payloads, none, xs))
    for c, d, x in zip(zero, none, xs):
        assert bool((c.decode(sum(payloads)) == 0).all()) and torch.equal(c.error, x)
        d.decode(sum(payloads))
        assert c.norm == d.norm > 0 and c.step == 1
