"""THCCodec: transform, unbiasedness, lane packing limits, determinism, error feedback (bad input and
misuse: tests/test_thc_input.py)."""
import math

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import lossless_hc as lhc
from lossless_hc.backends import cpu as _backend
from lossless_hc.thc.layout import HDR_CHECKSUM, max_world_size, plan_thc_layout

import helpers
import thc_reference as ref


def make_ranks(n, numel, **kw):
    return [lhc.THCCodec(numel, n, rank=r, **kw) for r in range(n)]


def run_step(codecs, xs, averaged=False):
    summed = sum(c.encode(x) for c, x in zip(codecs, xs))
    agg = summed / len(codecs) if averaged else summed
    return [c.decode(agg, averaged=averaged) for c in codecs]


# ------------------------------------------------------------------------------------------------
# randomized Hadamard transform
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("numel,block", [(1, 1024), (3, 1024), (64, 1024), (100, 1024), (1000, 1024),
                                         (5000, 1024), (300, 32), (4096, 4096), (70, 8)])
def test_rht_matches_dense_hadamard(numel, block):
    codec = lhc.THCCodec(numel, 2, hadamard_block=block, seed=11)
    L = codec.layout
    x = torch.randn(numel, generator=torch.Generator().manual_seed(numel))
    stream = _backend.thc_sign_stream(11, 0)
    y = torch.empty(L.padded, dtype=torch.float32)
    st_ = _backend.CPU.thc_rht_forward(codec._native, stream, x, None, y)
    want = ref.rht(x, L, stream)
    # float32 butterflies: log2(block) roundings of values bounded by ||block of x||.
    tol = 4 * max(1, int(math.log2(L.block))) * 2.0 ** -24 * float(x.abs().max()) * math.sqrt(L.block)
    assert float((y.double() - want).abs().max()) <= tol
    assert st_.sum_squares == pytest.approx(float(x.double().pow(2).sum()), rel=1e-6)
    # The inverse restores x on the numel coordinates.
    back = torch.empty(numel, dtype=torch.float32)
    _backend.CPU.thc_rht_inverse(codec._native, stream, y, back, None, None)
    assert float((back.double() - x.double()).abs().max()) <= 2 * tol


def test_rht_signs_depend_on_seed_and_step():
    a = ref.signs(_backend.thc_sign_stream(1, 0), 256)
    assert not torch.equal(a, ref.signs(_backend.thc_sign_stream(1, 1), 256))
    assert not torch.equal(a, ref.signs(_backend.thc_sign_stream(2, 0), 256))
    assert abs(float(a.sum())) < 64   # about half negative (256 fair coins: |sum| < 64 is 4 sigma)


# ------------------------------------------------------------------------------------------------
# unbiasedness and the variance the table predicts
# ------------------------------------------------------------------------------------------------
@settings(max_examples=6)
@given(n=st.integers(1, 6), numel=st.sampled_from([1024, 3000, 4096]), bits=st.sampled_from([2, 3, 4]),
       granularity=st.sampled_from([15, 30]), seed=st.integers(0, 2 ** 32))
def test_unbiased_and_variance_as_predicted(n, numel, bits, granularity, seed):
    gen = torch.Generator().manual_seed(seed)
    xs = [torch.randn(numel, generator=gen) * (1 + r) for r in range(n)]
    truth = sum(x.double() for x in xs)
    # Scale with 3x headroom: z has std <= 1/3, so clipping at T >= 2.15 (6.4 sigma) never happens and
    # the decode is unbiased for the exact sum.
    M = 3 * max(float(x.norm()) for x in xs)
    trials = 32
    acc = torch.zeros(numel, dtype=torch.float64)
    predicted_total = 0.0
    for t in range(trials):
        codecs = make_ranks(n, numel, bits=bits, granularity=granularity, seed=seed + 7919 * t,
                            initial_norm=M, error_feedback=False)
        pred = ref.predicted_sq_error(xs, codecs, M)
        y = run_step(codecs, xs)[0].double()
        err = float((y - truth).pow(2).sum())
        # One trial: a sum of >= 1024 independent bounded terms around its mean pred (numel < padded
        # only drops terms, so the observed error is below pred then).
        if numel == codecs[0].layout.padded:
            assert 0.7 * pred <= err <= 1.4 * pred, (err, pred)
        else:
            assert err <= 1.4 * pred, (err, pred)
        acc += y
        predicted_total += pred
    mean_err = float((acc / trials - truth).pow(2).sum())
    # Mean of independent unbiased decodes: E||mean - truth||^2 = sum(pred) / trials^2. A bias b
    # would add ||b||^2, which does not shrink with the trial count.
    assert mean_err <= 2.0 * predicted_total / trials ** 2, (mean_err, predicted_total / trials ** 2)


def test_average_equals_sum_over_n():
    n, numel = 4, 5000
    xs = [torch.randn(numel, generator=torch.Generator().manual_seed(r)) for r in range(n)]
    M = max(float(x.norm()) for x in xs)
    sums = run_step(make_ranks(n, numel, initial_norm=M, seed=5), xs)
    avgs = run_step(make_ranks(n, numel, initial_norm=M, seed=5), xs, averaged=True)
    torch.testing.assert_close(avgs[0], sums[0] / n, rtol=1e-5, atol=1e-6 * float(sums[0].abs().max()))
    # Horovod's gradient_predivide_factor: every payload divided by n before the sum.
    codecs = make_ranks(n, numel, initial_norm=M, seed=5)
    pre = sum(c.encode(x) / n for c, x in zip(codecs, xs))
    torch.testing.assert_close(codecs[0].decode(pre, averaged=True), avgs[0], rtol=0, atol=0)


def test_int64_payload_sums_to_the_same_levels():
    n, numel = 3, 2048
    xs = [torch.randn(numel, generator=torch.Generator().manual_seed(10 + r)) for r in range(n)]
    M = max(float(x.norm()) for x in xs)
    f = run_step(make_ranks(n, numel, initial_norm=M, seed=9), xs)[0]
    i = run_step(make_ranks(n, numel, initial_norm=M, seed=9, payload_dtype=torch.int64), xs)[0]
    assert torch.equal(f, i)   # same levels, same affine map, same inverse transform


# ------------------------------------------------------------------------------------------------
# lane packing: no carry at the largest world size, a clear error past it
# ------------------------------------------------------------------------------------------------
def word_kind(codec):
    return 0 if codec.layout.payload_dtype == torch.float64 else 1


def pack(codec, levels):
    """Pack integer levels (padded of them) into this codec's words (the encode kernel's packing)."""
    words = torch.zeros(codec.layout.words, dtype=codec.layout.payload_dtype)
    _backend.CPU.thc_pack_levels(codec._native, levels.to(torch.int32).contiguous(), word_kind(codec), words)
    return words


def unpack(codec, words, multiplier):
    """(invalid words, digit sums as float32) of aggregated words."""
    y = torch.empty(codec.layout.padded, dtype=torch.float32)
    bad = _backend.CPU.thc_unpack_levels(codec._native, word_kind(codec), words, multiplier, y)
    return bad, y


@settings(max_examples=25)
@given(granularity=st.integers(1, 300), digits=st.integers(1, 9),
       dtype=st.sampled_from([torch.float64, torch.int64]), numel=st.integers(1, 3000))
def test_worst_case_sum_never_carries_at_max_world_size(granularity, digits, dtype, numel):
    n = max_world_size(granularity, dtype, digits)
    assume(1 <= n <= 3000)
    codec = lhc.THCCodec(numel, n, granularity=granularity, bits=3, payload_dtype=dtype, digits_per_word=digits,
                         initial_norm=1.0)
    top = pack(codec, torch.full((codec.layout.padded,), granularity))  # every coordinate at level g
    assert codec.layout.per_word == digits
    total = torch.zeros_like(top)
    for _ in range(n):                                                  # the engine's sum, rank by rank
        total += top
    bad, y = unpack(codec, total, 1.0)
    assert bad == 0 and bool((y == n * granularity).all())
    if dtype == torch.float64:
        for averaged in (total / n, total * (1.0 / n), sum(top / n for _ in range(n))):
            bad, y = unpack(codec, averaged, float(n))
            assert bad == 0 and bool((y == n * granularity).all())
    with pytest.raises(ValueError, match=f"at most {n} ranks"):
        lhc.THCCodec(numel, n + 1, granularity=granularity, payload_dtype=dtype, digits_per_word=digits)


def test_mixed_levels_sum_exactly():
    n, numel = 8, 10000
    codec = lhc.THCCodec(numel, n)
    total = torch.zeros(codec.layout.words, dtype=torch.float64)
    levels = torch.zeros(codec.layout.padded, dtype=torch.float64)
    gen = torch.Generator().manual_seed(0)
    for r in range(n):
        q = torch.randint(0, codec.granularity + 1, (codec.layout.padded,), generator=gen)
        total += pack(codec, q)
        levels += q
    bad, got = unpack(codec, total, 1.0)
    assert bad == 0 and torch.equal(got.double(), levels)
    bad, got = unpack(codec, total / n, float(n))
    assert bad == 0 and torch.equal(got.double(), levels)


def test_padding_digits_must_be_zero():
    codec = lhc.THCCodec(1024, 8)               # 1024 = 170 * 6 + 4: each block's last word has 4 digits
    words = pack(codec, torch.zeros(1024))
    assert unpack(codec, words, 1.0)[0] == 0
    words[-1] = float(codec.layout.base ** 4)    # a fifth digit
    assert unpack(codec, words, 1.0)[0] == 1


def test_wire_size_at_eight_workers():
    L = plan_thc_layout(1 << 20, 8, 30)
    assert (L.base, L.per_word) == (241, 6)
    assert L.lane_bits_per_coordinate <= 32 / 3
    assert L.bits_per_coordinate <= 32 / 3 + 0.01
    assert max_world_size(30, torch.float64, 6) == 8
    with pytest.raises(ValueError, match="at most 8 ranks"):
        lhc.THCCodec(1 << 10, 9, digits_per_word=6)


def test_corrupted_words_are_reported():
    codecs = make_ranks(2, 3000, initial_norm=10.0)
    xs = [torch.randn(3000), torch.randn(3000)]
    summed = sum(c.encode(x) for c, x in zip(codecs, xs))
    summed[codecs[0].layout.words_offset + 5] += 0.25        # a level word that is no longer an integer
    with pytest.raises(ValueError, match="not valid aggregated digit words"):
        codecs[0].decode(summed)


# ------------------------------------------------------------------------------------------------
# payload integrity (#19 item 8): norm mirrors and the words' checksum
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float64, torch.int64])
@pytest.mark.parametrize("numel,block", [(3000, 1024), (100, 1024), (50000, 4096), (5000, 32)])
def test_checksum_field_is_the_defined_sum_and_survives_aggregation(dtype, numel, block):
    n = 3
    codecs = make_ranks(n, numel, initial_norm=60.0, payload_dtype=dtype, hadamard_block=block)
    L = codecs[0].layout
    payloads = [c.encode(torch.randn(numel)) for c in codecs]
    for p in payloads:
        assert int(p[HDR_CHECKSUM]) == ref.checksum(codecs[0], p[L.words_offset:], 0)
        assert 0 <= int(p[HDR_CHECKSUM]) < L.check_prime
    for c in codecs:       # the SUM decodes (its checksum field is congruent to the summed words' checksum)
        c.decode(sum(payloads))


def test_checksum_weights_step_is_coprime_to_p_minus_1_at_every_step():
    """THCLayout's checksum weights c_w = 1 + ((c0 + w k) mod (P - 1)) differ for any two words less than P - 1
    apart only if k is coprime to P - 1: every step's (P, c0, k) has such a k, c0 and k in range, drawn from the
    seed and the step alike on every rank, and k varies with the step."""
    a, b = lhc.THCCodec(3000, 3, rank=0, seed=7), lhc.THCCodec(3000, 3, rank=2, seed=7)
    P = a.layout.check_prime
    ks = set()
    for step in range(200):
        got = a._check(step)
        assert got == b._check(step)
        p, c0, k = got
        assert p == P and 0 <= c0 < P - 1 and 1 <= k < P - 1 and math.gcd(k, P - 1) == 1, got
        ks.add(k)
    assert len(ks) > 100


def test_fingerprint_field_stays_within_its_bits():
    """The header's fingerprint is a FINGERPRINT_BITS-bit hash: plan_thc_layout's exactness check assumes
    world_size * (2^FINGERPRINT_BITS - 1) fits the word, so no rank may send a larger one (16 seeds: a wider
    hash would show in about half of them)."""
    from lossless_hc.thc.layout import FINGERPRINT_BITS, HDR_FINGERPRINT
    seen = set()
    for seed in range(16):
        c = lhc.THCCodec(100, 2, seed=seed, initial_norm=1.0)
        fp = float(c.encode(torch.randn(100))[HDR_FINGERPRINT])
        assert fp == int(fp) and 0 <= fp < 2 ** FINGERPRINT_BITS
        seen.add(fp)
    assert len(seen) > 1   # the seed enters the hash


def rewindable(codec):
    """A function that decodes a payload with ``codec``'s state as it is now, every time."""
    step, norm = codec._step, codec._norm

    def decode(payload, **kw):
        codec._pending, codec._step, codec._norm = True, step, norm
        return codec.decode(payload, **kw)
    return decode


@pytest.mark.parametrize("averaged", [False, True])
def test_corrupted_norm_slots_and_mirrors_are_caught(averaged):
    n = 3
    codecs = make_ranks(n, 2000, initial_norm=40.0)
    summed = sum(c.encode(torch.randn(2000)) for c in codecs)
    agg = summed / n if averaged else summed
    L = codecs[0].layout
    decode = rewindable(codecs[0])
    decode(agg.clone(), averaged=averaged)
    for pos, value in [(L.norm_offset + 1, 1e300), (L.norm_offset, 0.0), (L.mirror_offset + 2, -1e300),
                       (L.norm_offset + 2, float(agg[L.norm_offset + 2]) * 1.0000001)]:
        bad = agg.clone()
        bad[pos] = value
        with pytest.raises(ValueError, match="norm slots are corrupted"):
            decode(bad, averaged=averaged)


@pytest.mark.parametrize("dtype,averaged", [(torch.float64, False), (torch.float64, True), (torch.int64, False)])
def test_every_single_bit_flip_of_a_level_word_is_caught_or_harmless(dtype, averaged):
    """Each of the 64 bits of 40 random level words (and of the checksum field), flipped one at a time:
    the decoder raises ValueError, or (a flip that leaves the word's integer value unchanged, e.g. the
    sign of a zero, or a low bit of an averaged word) decodes to exactly the clean output."""
    n, numel = 3, 6000
    codecs = make_ranks(n, numel, initial_norm=80.0, payload_dtype=dtype)
    summed = sum(c.encode(torch.randn(numel)) for c in codecs)
    agg = summed / n if averaged else summed
    L = codecs[0].layout
    decode = rewindable(codecs[0])
    clean = decode(agg.clone(), averaged=averaged).clone()
    gen = torch.Generator().manual_seed(9)
    positions = [L.words_offset + int(w) for w in torch.randint(0, L.words, (40,), generator=gen)] + [HDR_CHECKSUM]
    caught = harmless = 0
    for pos in positions:
        for bit in range(64):
            bad = agg.clone()
            bad.view(torch.int64)[pos] ^= (1 << bit) if bit < 63 else -(1 << 63)
            try:
                y = decode(bad, averaged=averaged)
            except ValueError:
                caught += 1
                continue
            assert torch.equal(y, clean), (pos, bit)
            harmless += 1
    assert caught >= 41 * 40      # most flips change the value; none goes through silently


def test_words_of_another_step_are_caught_by_the_checksum():
    """A stale or misrouted buffer: valid digit words of a different aggregate under this header."""
    n, numel = 2, 20000
    codecs = make_ranks(n, numel, initial_norm=100.0)
    first = sum(c.encode(torch.randn(numel)) for c in codecs)
    for c in codecs:
        c.decode(first)
    second = sum(c.encode(torch.randn(numel)) for c in codecs)
    L = codecs[0].layout
    mixed = second.clone()
    mixed[L.words_offset + 100:L.words_offset + 200] = first[L.words_offset + 100:L.words_offset + 200]
    with pytest.raises(ValueError, match="checksum mismatch"):
        rewindable(codecs[0])(mixed)
    swapped = second.clone()
    a, b = L.words_offset + 10, L.words_offset + 500
    assert float(swapped[a]) != float(swapped[b])
    swapped[a], swapped[b] = float(second[b]), float(second[a])
    with pytest.raises(ValueError, match="checksum mismatch"):
        rewindable(codecs[0])(swapped)


# ------------------------------------------------------------------------------------------------
# determinism, bootstrap, error feedback
# ------------------------------------------------------------------------------------------------
def test_decode_is_identical_on_every_rank_and_thread_count():
    n, numel = 4, 20000
    xs = [torch.randn(numel, generator=torch.Generator().manual_seed(r)) for r in range(n)]
    outs = {}
    for threads in (1, 2):
        codecs = make_ranks(n, numel, seed=3, num_threads=threads)
        for _ in range(3):
            payloads = [c.encode(x) for c, x in zip(codecs, xs)]
            summed = sum(payloads)
            ys = [c.decode(summed) for c in codecs]
            assert all(torch.equal(ys[0], y) for y in ys)
        outs[threads] = (payloads, ys[0], [c.error.clone() for c in codecs])
    assert all(torch.equal(a, b) for a, b in zip(outs[1][0], outs[2][0]))
    assert torch.equal(outs[1][1], outs[2][1])
    assert all(torch.equal(a, b) for a, b in zip(outs[1][2], outs[2][2]))


@pytest.mark.parametrize("numel,block", [(20000, 1024), (3001, 1024), (5000, 64), (700, 8), (9000, 4096)])
def test_every_compiled_kernel_copy_gives_the_same_bits(numel, block):
    """csrc/cpu/thc_cpu_isa.h is compiled per x86-64 level (AVX-512, AVX2, portable) and one copy is
    chosen at run time: every copy this CPU runs writes the same payloads, error memories and outputs."""
    isas = _backend.thc_cpu_isas()
    assert isas[-1] == "portable" and _backend.thc_cpu_isa() in isas
    n = 3
    gen = torch.Generator().manual_seed(numel)
    steps = [[torch.randn(numel, generator=gen) * (1 + r) for r in range(n)] for _ in range(3)]
    results = {}
    try:
        for isa in isas:
            assert _backend.thc_cpu_isa(isa) == isa
            codecs = make_ranks(n, numel, seed=5, hadamard_block=block)
            got = []
            for xs in steps:
                payloads = [c.encode(x) for c, x in zip(codecs, xs)]
                y = [c.decode(sum(payloads)) for c in codecs][0]
                got += payloads + [y] + [c.error.clone() for c in codecs]
            results[isa] = got
    finally:
        _backend.thc_cpu_isa("default")
    first = results[isas[0]]
    for isa in isas[1:]:
        for a, b in zip(first, results[isa]):
            assert torch.equal(a.view(torch.int64 if a.element_size() == 8 else torch.int32),
                               b.view(torch.int64 if b.element_size() == 8 else torch.int32)), isa
    with pytest.raises(ValueError, match="cannot run .* request one of " + "".join(f"'{i}', " for i in isas)):
        _backend.thc_cpu_isa("no-such-level")


@pytest.mark.parametrize("env", ["portable", "no-such-level"])
def test_cpu_isa_from_the_environment(env):
    """LHC_CPU_ISA picks the copy at start-up; a level this CPU cannot run (or a typo) is said on stderr
    and the best copy is used, never ignored in silence."""
    proc = helpers.run_python("from lossless_hc.backends import cpu; print(cpu.thc_cpu_isa())", LHC_CPU_ISA=env)
    assert proc.returncode == 0, proc.stderr
    if env == "portable":
        assert proc.stdout.strip() == "portable" and "LHC_CPU_ISA" not in proc.stderr
    else:
        assert proc.stdout.strip() == _backend.thc_cpu_isas()[0]
        assert f"LHC_CPU_ISA={env} is not a level this CPU runs" in proc.stderr


def test_bootstrap_step_sends_norms_only():
    n, numel = 3, 1500
    codecs = make_ranks(n, numel)
    xs = [torch.randn(numel) * (r + 1) for r in range(n)]
    ys = run_step(codecs, xs)
    assert all(bool((y == 0).all()) for y in ys)
    for c, x in zip(codecs, xs):
        assert torch.equal(c.error, x)                              # nothing sent: all of x is owed
        assert c.norm == pytest.approx(max(float(v.norm()) for v in xs), rel=1e-6)
        torch.testing.assert_close(c.last_norms, torch.tensor([float(v.double().norm()) for v in xs],
                                                              dtype=torch.float64), rtol=1e-6, atol=0)


@pytest.mark.parametrize("dtype", [torch.float64, torch.int64])
def test_a_norm_only_round_sends_zero_level_words_into_a_reused_buffer(dtype):
    """The norm-only round quantizes no level: every level word of its payload is 0, also in an out= buffer
    that held another step's words (encode overwrites every element)."""
    c = lhc.THCCodec(3000, 2, payload_dtype=dtype)
    L = c.layout
    buf = torch.full((c.payload_numel,), 7, dtype=dtype)
    p = c.encode(torch.randn(3000), out=buf)
    assert p.data_ptr() == buf.data_ptr() and bool((p[L.words_offset:] == 0).all())


def test_an_agreed_norm_below_one_quantizes():
    """Only M == 0 makes a norm-only round (codec docstring): gradients of norm ~0.06 with initial_norm=0.1
    are quantized from step 0, and the decoded sum is close to the true one."""
    n, numel = 2, 4096
    gen = torch.Generator().manual_seed(6)
    xs = [torch.randn(numel, generator=gen) * 1e-3 for _ in range(n)]
    codecs = make_ranks(n, numel, initial_norm=0.1, seed=2)
    y = run_step(codecs, xs)[0].double()
    truth = sum(x.double() for x in xs)
    assert float(y.abs().max()) > 0
    assert float((y - truth).norm()) < 0.5 * float(truth.norm())


def test_reset_forgets_memory_norm_and_step_and_starts_with_a_norm_only_round():
    """reset() on every rank: the error memory is zeroed, the agreed norm forgotten (initial_norm too) and
    the step counter back at 0, so the next step is a norm-only round, as the first step of a fresh codec:
    it decodes to zeros and keeps all of x owed."""
    n, numel = 2, 3000
    codecs = make_ranks(n, numel, initial_norm=50.0, seed=4)
    gen = torch.Generator().manual_seed(8)
    run_step(codecs, [torch.randn(numel, generator=gen) for _ in range(n)])   # quantizes from step 0
    assert all(float(c.error.abs().max()) > 0 for c in codecs) and codecs[0].step == 1
    for c in codecs:
        c.reset()
    assert all(c.step == 0 and c.norm == 0.0 and bool((c.error == 0).all()) for c in codecs)
    xs = [torch.randn(numel, generator=gen) for _ in range(n)]
    fresh = make_ranks(n, numel, seed=4)
    want = run_step(fresh, xs)
    ys = run_step(codecs, xs)   # encode is allowed at once: no step is pending after a reset
    assert all(bool((y == 0).all()) for y in ys) and all(torch.equal(y, w) for y, w in zip(ys, want))
    for c, f, x in zip(codecs, fresh, xs):
        assert torch.equal(c.error, x) and c.norm == f.norm and c.step == 1


def test_error_feedback_telescopes_and_stays_bounded():
    n, numel, steps = 4, 6000, 60
    codecs = make_ranks(n, numel, seed=1)
    gen = torch.Generator().manual_seed(0)
    common = torch.randn(numel, generator=gen)
    sent = torch.zeros(numel, dtype=torch.float64)
    truth = torch.zeros(numel, dtype=torch.float64)
    owed = []
    for t in range(steps):
        xs = [common + 0.5 * torch.randn(numel, generator=gen) for _ in range(n)]
        sent += run_step(codecs, xs)[0].double()
        truth += sum(x.double() for x in xs)
        # What was decoded plus what the ranks still owe is what they were given (float rounding only).
        owed_now = sum(c.error.double() for c in codecs)
        scale = float(truth.abs().max())
        assert float((sent + owed_now - truth).abs().max()) <= 1e-4 * scale
        owed.append(float(owed_now.norm()))
    # Bounded drift: the memory does not grow with the number of steps, and is a small fraction of
    # one step's gradient norm times a few steps.
    step_norm = float(sum(x.double() for x in xs).norm())
    assert max(owed[steps // 2:]) <= 2.0 * max(owed[5:steps // 2])
    assert owed[-1] <= 1.0 * step_norm
    assert float((sent - truth).norm()) / float(truth.norm()) < 0.05


# ------------------------------------------------------------------------------------------------
# the kernels against the dense oracle, digit bases and word widths, the bench command
# ------------------------------------------------------------------------------------------------
def test_bench_thc_command_runs_and_reports():
    from lossless_hc.bench.cli import main
    from lossless_hc.bench.thc import run_thc_bench
    res = run_thc_bench(numel=8192, workers=8, repeat=1, warmup=2)
    assert res["wire"]["lane_bits_per_coordinate"] == pytest.approx(64 / 6)
    # One step of compression error of partly shared N(0,1) gradients: below the per-rank model.
    assert 0 < res["accuracy"]["nmse"] < res["accuracy"]["predicted_nmse_iid_normal"]
    assert res["timing"]["interleave"]["blocks"] == 8    # 8192 coordinates in blocks of 1024
    assert main(["thc", "--numel", "4096", "--workers", "2", "--repeat", "1", "--averaged"]) == 0


@pytest.mark.parametrize("numel,n", [(3000, 2), (5000, 4), (1024, 8), (37, 3)])
def test_fused_kernels_match_the_dense_oracle(numel, n):
    """decode = RHT^{-1} of the dequantized digit sums, and the error memory = x - RHT^{-1}(own
    dequantized levels), both against the dense-Hadamard oracle (ties the fused encode/decode
    transforms to the definition, beyond the unbiasedness statistics)."""
    gen = torch.Generator().manual_seed(numel)
    xs = [torch.randn(numel, generator=gen) for _ in range(n)]
    M = max(float(x.norm()) for x in xs)
    codecs = make_ranks(n, numel, initial_norm=M, seed=21)
    payloads = [c.encode(x) for c, x in zip(codecs, xs)]
    L, c0 = codecs[0].layout, codecs[0]
    stream = _backend.thc_sign_stream(21, 0)
    unit = M / math.sqrt(L.padded)
    a, b = 2 * c0.threshold / L.granularity * unit, -c0.threshold * unit
    tol = 1e-5 * M
    for c, x, p in zip(codecs, xs, payloads):
        bad, levels = unpack(c, p[L.words_offset:], 1.0)
        assert bad == 0 and set(levels.unique().tolist()) <= set(c.table.levels)
        own = ref.inverse_rht(levels.double() * a + b, L, stream)
        assert float((c.error.double() - (x.double() - own)).abs().max()) <= tol
    summed = sum(payloads)
    bad, sums = unpack(c0, summed[L.words_offset:], 1.0)
    want = ref.inverse_rht(sums.double() * a + n * b, L, stream)
    got = c0.decode(summed).double()
    assert bad == 0 and float((got - want).abs().max()) <= n * tol


def test_a_digit_base_beyond_the_kernels_32_bits_is_refused():
    """The kernels hold the digit base n g + 1 in 32 bits (csrc/lhc_layout.h): int64 words would take
    131072 ranks at g = 2^16 (base 2^33 + 1, truncated on CUDA), and max_world_size says where it stops."""
    with pytest.raises(ValueError, match="32 bits"):
        plan_thc_layout(4096, 1 << 17, 1 << 16, 1024, torch.int64)
    n = max_world_size(1 << 16, torch.int64)
    assert n * (1 << 16) + 1 < 1 << 32 <= (n + 1) * (1 << 16) + 1
    plan_thc_layout(4096, n, 1 << 16, 1024, torch.int64)


@pytest.mark.parametrize("n,granularity,digits,per_word", [(1, 1, None, 49), (2, 4, None, 15), (2, 2, 13, 13),
                                                           (2, 4, 12, 12)])
def test_words_of_more_than_twelve_digits_decode_on_every_kernel_copy(n, granularity, digits, per_word):
    """A small base n g + 1 packs many digits into a float64 word (49 at n = g = 1, 15 at n = 2, g = 4):
    every kernel copy this CPU runs unpacks them exactly (the worst case, every coordinate at level g
    summed over n ranks, reads back as n g; the AVX-512 copy reads words of at most 12 digits by
    coordinate and wider ones word by word) and decodes a step to the same bits."""
    isas = _backend.thc_cpu_isas()
    numel = 5000
    gen = torch.Generator().manual_seed(n * granularity)
    steps = [[torch.randn(numel, generator=gen) for _ in range(n)] for _ in range(2)]
    results = {}
    try:
        for isa in isas:
            assert _backend.thc_cpu_isa(isa) == isa
            codecs = make_ranks(n, numel, seed=4, bits=2, granularity=granularity, digits_per_word=digits)
            assert codecs[0].layout.per_word == per_word
            top = pack(codecs[0], torch.full((codecs[0].layout.padded,), granularity))
            bad, y = unpack(codecs[0], top * n, 1.0)
            assert bad == 0 and bool((y == n * granularity).all()), isa
            got = []
            for xs in steps:
                payloads = [c.encode(x) for c, x in zip(codecs, xs)]
                got.append([c.decode(sum(payloads)) for c in codecs][0])
            results[isa] = got
    finally:
        _backend.thc_cpu_isa("default")
    for isa in isas[1:]:
        assert all(torch.equal(a.view(torch.int32), b.view(torch.int32))
                   for a, b in zip(results[isas[0]], results[isa])), isa
