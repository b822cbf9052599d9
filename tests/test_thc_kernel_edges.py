"""THC CPU kernels (csrc/cpu/thc_cpu.cpp, thc_cpu_isa.h, thc_cpu_isa_words.h) at their edges: paths that
only some compiled copies take, or only some sizes reach.

The copy this CPU runs best (AVX-512 on x86-64-v4) rounds tables of at most 32 levels with vector code,
so the scalar rounding of csrc/thc_math.h (thc_level) runs there only for g > 32; the AVX2 and portable
copies run it always. Tests that go through it therefore run on every copy this CPU has.
"""
import pytest
import torch

import lossless_hc as lhc
from lossless_hc.backends import cpu as _backend
from test_thc import make_ranks


def on_every_copy(fn):
    """fn() on every kernel copy this CPU runs, the default restored afterwards: {isa: result}."""
    results = {}
    try:
        for isa in _backend.thc_cpu_isas():
            assert _backend.thc_cpu_isa(isa) == isa
            results[isa] = fn()
    finally:
        _backend.thc_cpu_isa("default")
    return results


@pytest.mark.parametrize("granularity", [30, 40])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_input_is_flagged_on_every_kernel_copy(granularity, bad):
    """A NaN/Inf coordinate reaches the rounding (the encode finds it from the norm afterwards): thc_level
    maps it to a valid level, so every copy, vector or scalar rounding, finishes the pass, flags the
    payload and resets the memory; the step after runs as usual and gives the same bits on every copy."""
    n, numel = 2, 3000
    gen = torch.Generator().manual_seed(granularity)
    xs = [torch.randn(numel, generator=gen) for _ in range(n)]
    bad_x = xs[1].clone()
    bad_x[17::97] = bad

    def run():
        codecs = make_ranks(n, numel, initial_norm=50.0, granularity=granularity, seed=8)
        payloads = [c.encode(x) for c, x in zip(codecs, [xs[0], bad_x])]
        assert float(payloads[1][2]) == 1.0 and bool((codecs[1].error == 0).all())
        for c in codecs:
            with pytest.raises(FloatingPointError, match="1 rank"):
                c.decode(sum(payloads))
        payloads = [c.encode(x) for c, x in zip(codecs, xs)]
        return [codecs[0].decode(sum(payloads))] + payloads

    results = on_every_copy(run)
    first = next(iter(results.values()))
    for isa, got in results.items():
        assert all(torch.equal(a, b) for a, b in zip(first, got)), isa


@pytest.mark.parametrize("numel,block", [(3001, 1024), (300, 32)])
def test_rht_stages_with_an_error_memory_and_plus_terms(numel, block):
    """The stage entry points beyond x alone: thc_rht_forward(x, e) is the transform of x + e (its
    padding written whatever y held, and its norm that of x + e), and thc_rht_inverse(y, plus_a,
    plus_b) writes (plus_a + plus_b) - RHT^-1(y), or plus_a - RHT^-1(y) without plus_b."""
    import thc_reference as ref
    codec = lhc.THCCodec(numel, 2, hadamard_block=block, seed=11)
    L, stream = codec.layout, _backend.thc_sign_stream(11, 0)
    gen = torch.Generator().manual_seed(numel)
    x, e = torch.randn(numel, generator=gen), torch.randn(numel, generator=gen)
    y = torch.full((L.padded,), float("nan"))
    st = _backend.CPU.thc_rht_forward(codec._native, stream, x, e, y)
    y_plain = torch.empty(L.padded)
    _backend.CPU.thc_rht_forward(codec._native, stream, x + e, None, y_plain)
    assert torch.equal(y, y_plain)
    assert float((y.double() - ref.rht(x + e, L, stream)).abs().max()) <= 1e-5 * float((x + e).abs().max())
    assert st.sum_squares == pytest.approx(float((x + e).double().pow(2).sum()), rel=1e-6)
    r = torch.empty(numel)
    _backend.CPU.thc_rht_inverse(codec._native, stream, y_plain.clone(), r, None, None)
    a, b = torch.randn(numel, generator=gen), torch.randn(numel, generator=gen)
    out = torch.empty(numel)
    _backend.CPU.thc_rht_inverse(codec._native, stream, y.clone(), out, a, b)
    assert torch.equal(out, (a + b) - r)
    _backend.CPU.thc_rht_inverse(codec._native, stream, y.clone(), out, a, None)
    assert torch.equal(out, a - r)


def test_norm_of_more_than_1024_chunks_counts_every_chunk():
    """||x + e||^2 sums its 1024-coordinate chunk partials by a 1024-wide tree, one level per 1024x
    (thc_math.h thc_tree_sum): past 2^20 coordinates the partials take a second level, its last group
    partly filled, and every chunk still counts."""
    numel = (1 << 20) + 3000   # 1027 chunks: a full group of 1024 and a group of 3
    xs = [torch.randn(numel, generator=torch.Generator().manual_seed(r)) for r in range(2)]
    xs[1][-2000:] *= 100.0     # most of rank 1's norm in its last chunks
    codecs = make_ranks(2, numel)
    summed = sum(c.encode(x) for c, x in zip(codecs, xs))   # the first step sends the norms only
    for c in codecs:
        c.decode(summed)
    want = [float(x.double().norm()) for x in xs]
    torch.testing.assert_close(codecs[0].last_norms, torch.tensor(want, dtype=torch.float64), rtol=1e-6, atol=0)



def test_checksum_of_a_group_of_524288_words():
    """The AVX-512 checksum sums each lane's word terms c lo + c' hi (up to 2^51 each, lo the word's
    low 26 bits) in 64 bits and reduces them mod P every 2048 steps, so that a group of many words
    does not wrap 2^64: three Hadamard blocks of 2^20 coordinates in words of 6 digits (one group of
    524288 words, 65536 steps a lane) have the defined checksum on every copy, and their SUM decodes."""
    import thc_reference as ref
    from lossless_hc.thc.layout import HDR_CHECKSUM
    n, numel = 2, 3 << 20
    xs = [torch.randn(numel, generator=torch.Generator().manual_seed(r)) for r in range(n)]

    def run():
        codecs = make_ranks(n, numel, bits=4, granularity=15, digits_per_word=6, hadamard_block=1 << 20,
                            initial_norm=float(numel) ** 0.5)
        L = codecs[0].layout
        assert (L.per_word, L.group_blocks, L.words) == (6, 3, numel // 6)
        payloads = [c.encode(x) for c, x in zip(codecs, xs)]
        for p in payloads:
            assert int(p[HDR_CHECKSUM]) == ref.checksum(codecs[0], p[L.words_offset:], 0)
        return [c.decode(sum(payloads)) for c in codecs][0]

    results = on_every_copy(run)
    first = next(iter(results.values()))
    assert all(torch.equal(first, y) for y in results.values())


def test_asking_which_kernel_copy_runs_does_not_switch_it():
    """thc_cpu_isa() with no request only reports the copy in use: after choosing the portable copy,
    asking leaves it chosen (an empty request is not 'default')."""
    try:
        assert _backend.thc_cpu_isa("portable") == "portable"
        assert _backend.thc_cpu_isa() == "portable" and _backend.thc_cpu_isa("") == "portable"
        assert _backend.thc_cpu_isa() == "portable"
    finally:
        _backend.thc_cpu_isa("default")
