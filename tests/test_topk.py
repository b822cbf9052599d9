"""Top-k selection by magnitude (csrc/cpu/topk_cpu.h; CUDA twin csrc/cuda/topk_kernels.cuh).

The result is defined by a stable sort: the min(k, n) coordinates largest by the IEEE bits of |x|
(NaN above +Inf, -0 == +0), ties to the lower index, in ascending order. Checked against that sort on
random inputs with many ties, across thread counts, through both the sampled path and the exact
fallback, and the emulated CUDA kernels against the CPU.
"""
import math

import pytest
import torch

from lossless_hc.backends import cpu as _cpu
from lossless_hc.backends import cuda_topk
from lossless_hc.backends.cpu import CPU

from test_cuda_emulated import emulated  # noqa: F401  (the module-scoped fixture: builds and installs the emulation)


def reference(x: torch.Tensor, k: int) -> torch.Tensor:
    key = x.view(torch.int32) & 0x7FFFFFFF
    order = torch.sort(key, descending=True, stable=True).indices[:min(k, x.numel())]
    return torch.sort(order).values


def inputs(kind: str, n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if kind == "normal":
        return torch.randn(n, generator=g)
    if kind == "ties":           # a handful of distinct magnitudes, signs mixed
        return torch.randint(-4, 5, (n,), generator=g).float()
    if kind == "sparse":         # mostly zeros (+0 and -0): fewer non-zeros than k for large k
        x = torch.zeros(n)
        x[torch.randperm(n, generator=g)[: n // 50]] = torch.randn(n // 50, generator=g)
        x[::3] = -0.0
        return x
    if kind == "special":        # NaN, +-Inf, denormals among normals
        x = torch.randn(n, generator=g)
        x[::997] = float("nan")
        x[5::1009] = float("-inf")
        x[7::1013] = float("inf")
        x[11::101] = 1e-40
        return x
    if kind == "heavy":          # heavy tail: the sample sees few of the largest
        return torch.randn(n, generator=g) ** 5
    raise ValueError(kind)


KINDS = ("normal", "ties", "sparse", "special", "heavy")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n,k", [(1, 1), (10, 3), (1000, 10), (5000, 4999), (100_000, 1000), (300_000, 3000),
                                 (300_000, 1), (600_000, 60_000)])
def test_selection_is_the_stable_sort_prefix(kind, n, k):
    x = inputs(kind, n, seed=n + k)
    want = reference(x, k)
    got = CPU.topk_select(x, k)
    assert got.dtype == torch.int64 and got.numel() == min(k, n)
    assert torch.equal(got, want)



@pytest.mark.parametrize("threads", [1, 2, 3])
def test_ties_at_the_sampled_threshold_in_a_range_s_scalar_tail(threads):
    """The filtering pass tests 16 coordinates at a time and the last n mod 16 of each thread's range
    one by one: both keep every key >= the sampled threshold, so ties at it are kept wherever they lie.
    Integer data whose threshold is the largest magnitude (k = 1, 2), and ties of 1.0 placed in the
    first range's tail with the k-th key among them (k = 2000), select the stable-sort prefix."""
    n = 300_013   # ranges of 1, 2 and 3 threads all end in a scalar tail
    x = inputs("ties", n, seed=11)
    for k in (1, 2):
        assert torch.equal(CPU.topk_select(x, k, num_threads=threads), reference(x, k))
    g = torch.Generator().manual_seed(12)
    y = torch.randn(n, generator=g) * 1e-3
    y[torch.randperm(n, generator=g)[:3000]] = 1.0
    end0 = n // threads
    y[end0 - n // threads % 16:end0] = -1.0   # the first range's tail: all ties
    assert torch.equal(CPU.topk_select(y, 2000, num_threads=threads), reference(y, 2000))

@pytest.mark.parametrize("kind", KINDS)
def test_same_indices_on_every_thread_count(kind):
    n, k = 400_000, 4000
    x = inputs(kind, n, seed=7)
    first = CPU.topk_select(x, k, num_threads=1)
    for threads in (2, 3, 5):
        assert torch.equal(CPU.topk_select(x, k, num_threads=threads), first)


def test_count_is_exactly_k_and_never_more():
    """The bound the aggregator relies on (the codec's capacity is k): exactly min(k, n), for every k."""
    x = inputs("ties", 300_000, seed=1)
    for k in (0, 1, 2, 17, 1000, 299_999, 300_000, 400_000):
        got = CPU.topk_select(x, k)
        assert got.numel() == min(k, x.numel())
        if got.numel() > 1:
            assert bool((got[1:] > got[:-1]).all())   # ascending, no duplicates


def test_reuses_out_and_rejects_bad_input():
    x = torch.randn(1000)
    out = torch.full((50,), -1, dtype=torch.int64)
    got = CPU.topk_select(x, 40, out=out)
    assert got.data_ptr() == out.data_ptr() and torch.equal(got, reference(x, 40))
    with pytest.raises(TypeError, match="takes a contiguous float32 tensor"):
        CPU.topk_select(x.double(), 3)
    with pytest.raises(TypeError, match="takes a contiguous float32 tensor"):
        CPU.topk_select(torch.randn(10, 2).t(), 3)
    with pytest.raises(ValueError, match="k must be an integer >= 0"):
        CPU.topk_select(x, -1)
    with pytest.raises(ValueError, match="out must be a contiguous int64 tensor of at least 40"):
        CPU.topk_select(x, 40, out=torch.empty(10, dtype=torch.int64))


def test_sampled_threshold_and_exact_fallback_agree():
    """Normal data takes the sampled threshold (a filtering pass); integer-valued data, whose sampled
    threshold lands on a huge tie, takes the exact histogram fallback. Both equal the sort."""
    from lossless_hc import _C
    for kind, fallback in (("normal", 0), ("ties", 1)):
        x = inputs(kind, 1 << 20, seed=3)
        k = 10_000
        out = torch.empty(k, dtype=torch.int64)
        st = _C.topk_select(x.data_ptr(), x.numel(), k, out.data_ptr(), 0)
        assert st.count == k and st.fallback == fallback
        if not fallback:
            assert k <= st.candidates <= 2 * k   # one filtering pass kept a little more than k
        assert torch.equal(out, reference(x, k))


def test_exact_fallback_reports_the_k_th_key_when_it_closes_a_histogram_bin():
    """The exact selection fixes the k-th largest key digit by digit, taking the first bin (from the top)
    whose cumulative count reaches what is left of k; where a bin's count ends exactly at k, that bin
    holds the k-th key, and the threshold reported is that key's bits (k = n - 1 with one zero: every
    non-zero key lies above bin 0, so the k-th is the smallest non-zero |x|)."""
    from lossless_hc import _C
    n = 300_000
    x = torch.randn(n, generator=torch.Generator().manual_seed(5))
    x[5] = 0.0
    k = n - 1   # the sample's rank would pass its size: the exact passes run
    out = torch.empty(k, dtype=torch.int64)
    st = _C.topk_select(x.data_ptr(), n, k, out.data_ptr(), 0)
    assert st.fallback == 1 and st.count == k and torch.equal(out, reference(x, k))
    keys = x.view(torch.int32) & 0x7FFFFFFF
    assert st.threshold == int(keys[keys > 0].min())


def sampled_positions(n: int) -> torch.Tensor:
    """The coordinates topk_cpu.cpp's threshold is sampled from: one per stride n // 2^16, at the offset
    lhc::mix64(j ^ 0x70b5e1ec7) mod stride inside stride j."""
    def mix64(z):
        m = (1 << 64) - 1
        z ^= z >> 30
        z = (z * 0xBF58476D1CE4E5B9) & m
        z ^= z >> 27
        z = (z * 0x94D049BB133111EB) & m
        return z ^ (z >> 31)
    stride = n // (1 << 16)
    return torch.tensor([j * stride + mix64(j ^ 0x70B5E1EC7) % stride for j in range(1 << 16)])


@pytest.mark.parametrize("threads", [1, 3])
def test_fewer_non_zeros_than_k_are_all_taken_with_the_first_zeros_without_the_exact_passes(threads):
    """A gradient with fewer non-zero coordinates than k (an embedding table's): the sampled threshold is
    0, the filtering pass keeps every non-zero coordinate (NaN, Inf and denormals included), and the
    selection is all of them plus the lowest-indexed zeros (+0 and -0 alike), merged in ascending order:
    the definition, with no exact fallback. With error feedback the same over a = x + e, every
    coordinate conserved."""
    from lossless_hc import _C
    n, k = (1 << 20) + 7, 20_000
    g = torch.Generator().manual_seed(11)
    x = torch.zeros(n)
    x[1::2] = -0.0
    nz = torch.randperm(n, generator=g)[:12_000]
    x[nz] = torch.randn(12_000, generator=g)
    x[nz[:3]] = torch.tensor([float("nan"), float("inf"), 1e-45])
    out = torch.empty(k, dtype=torch.int64)
    st = _C.topk_select(x.data_ptr(), n, k, out.data_ptr(), threads)
    assert (st.count, st.fallback, st.candidates, st.threshold) == (k, 0, 12_000, 0)
    assert torch.equal(out, reference(x, k))
    assert out[0] == 0 and bool((out[1:] > out[:-1]).all())   # the first zeros, ascending
    e0 = torch.zeros(n)
    e0[torch.randperm(n, generator=g)[:5_000]] = torch.randn(5_000, generator=g)
    e = e0.clone()
    values = torch.empty(k)
    st = _C.topk_feedback(x.data_ptr(), e.data_ptr(), n, k, out.data_ptr(), values.data_ptr(), threads)
    want_idx, want_values, want_rest = feedback_reference(x, e0, k)
    assert st.count == k and st.fallback == 0 and st.threshold == 0
    assert torch.equal(out, want_idx) and torch.equal(bits(values), bits(want_values))
    assert torch.equal(bits(e), bits(want_rest))


@pytest.mark.parametrize("off_sample", [1_000, 10_000])
def test_a_sampled_threshold_keeping_fewer_than_k_filters_again_at_the_smallest_non_zero_key(off_sample):
    """Every sampled coordinate holds 1.0 and the others 0 or a denormal: the sample's threshold is 1.0's
    key, which fewer than k coordinates reach. The second filtering pass, at the smallest non-zero key,
    settles the selection: with fewer than k non-zero ones all of them and the first zeros (threshold 0),
    with more the k-th largest among them (a denormal's key); either way no exact fallback."""
    from lossless_hc import _C
    n, k = 1 << 20, 70_000
    g = torch.Generator().manual_seed(off_sample)
    sampled = sampled_positions(n)
    x = torch.zeros(n)
    others = torch.ones(n, dtype=torch.bool)
    others[sampled] = False
    pick = others.nonzero().reshape(-1)[torch.randperm(n - sampled.numel(), generator=g)[:off_sample]]
    x[pick] = 1e-40 * (1 + torch.rand(off_sample, generator=g))
    x[sampled] = 1.0
    out = torch.empty(k, dtype=torch.int64)
    st = _C.topk_select(x.data_ptr(), n, k, out.data_ptr(), 0)
    nonzero = sampled.numel() + off_sample
    assert st.count == k and st.fallback == 0 and st.candidates == nonzero
    keys = x.view(torch.int32) & 0x7FFFFFFF
    assert st.threshold == (0 if nonzero < k else int(keys[out].min()))
    assert torch.equal(out, reference(x, k))


def test_a_zero_sample_over_more_non_zeros_than_the_filter_keeps_falls_back_to_the_exact_selection():
    """Every sampled coordinate is 0 and the others hold more non-zero values than the filtering pass
    may keep: the filter at the smallest non-zero key overflows, and the exact selection (not the first
    coordinates as zero ties) gives the k largest."""
    from lossless_hc import _C
    n, k = 1 << 20, 1_000
    g = torch.Generator().manual_seed(7)
    others = torch.ones(n, dtype=torch.bool)
    others[sampled_positions(n)] = False
    x = torch.zeros(n)
    pick = others.nonzero().reshape(-1)[torch.randperm(int(others.sum()), generator=g)[:50_000]]
    x[pick] = torch.randn(50_000, generator=g)
    out = torch.empty(k, dtype=torch.int64)
    st = _C.topk_select(x.data_ptr(), n, k, out.data_ptr(), 0)
    assert st.count == k and st.fallback == 1
    assert torch.equal(out, reference(x, k))


def test_aggregator_sends_exactly_k_and_keeps_the_rest():
    from lossless_hc.training.topk_aggregate import TopKAggregator, topk_count
    agg = TopKAggregator("w", (50_001,), torch.float32, 2, 0.01)
    x = inputs("ties", 50_001, seed=4)
    sent = agg.select(x)
    assert int((sent != 0).sum()) == agg.k == math.ceil(0.01 * 50_001) == 501   # k = ceil(r d), not its floor
    assert (topk_count(1000, 0.0015), topk_count(10, 1e-9), topk_count(10, 1.0)) == (2, 1, 10)
    assert torch.equal(sent + agg.residual, x)   # every coordinate either sent or kept
    assert torch.equal(torch.nonzero(sent).reshape(-1), reference(x, agg.k))
    agg._codec = None   # sent dense from now on (the capacity policy's switch): x + e goes once, nothing stays
    residual = agg.residual.clone()
    assert torch.equal(agg.select(x), x + residual) and agg.residual is None
    assert torch.equal(agg.select(x), x)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_aggregator_keeps_what_a_narrow_dtype_s_rounding_leaves_out(dtype):
    """For a float16 / bfloat16 gradient the sent values are that dtype's: the residual keeps the
    rounding too, so a = g + e (float32) is the sent tensor plus the new residual, exactly, step after
    step (it lost up to half an ulp of the dtype per sent coordinate), and a value past the dtype's range
    is sent clamped, the rest kept, rather than as an infinity (which fails the decode)."""
    from lossless_hc.training.topk_aggregate import TopKAggregator
    agg = TopKAggregator("w", (10_000,), dtype, 2, 0.01)
    g = torch.Generator().manual_seed(9)
    for _ in range(4):
        x = (torch.randn(10_000, generator=g) * 3).to(dtype)
        before = agg.residual.clone() if agg.residual is not None else torch.zeros(10_000)
        sent = agg.select(x)
        assert sent.dtype == dtype and int((sent != 0).sum()) == agg.k
        assert torch.equal(x.float() + before, sent.float() + agg.residual)
    x[3], x[4] = float("nan"), float("inf")   # sent as they are (selected first); nothing of them stays behind
    sent = agg.select(x)
    assert bool(sent[3].isnan()) and bool(sent[4].isinf()) and bool(torch.isfinite(agg.residual).all())
    agg._codec = None   # sent dense from now on (the capacity policy's switch): x + e goes, its rounding stays
    x = x.nan_to_num(posinf=0.0)
    before = agg.residual.clone()
    sent = agg.select(x)
    assert sent.dtype == dtype and agg.residual is not None
    assert torch.equal(x.float() + before, sent.float() + agg.residual)
    x[3] = float("nan")
    sent = agg.select(x)
    assert bool(sent[3].isnan()) and (agg.residual is None or bool(torch.isfinite(agg.residual).all()))
    agg = TopKAggregator("w", (1000,), torch.float16, 2, 0.001)   # k = 1
    x = torch.zeros(1000, dtype=torch.float16)
    x[:2] = 40000.0
    for _ in range(3):
        before = agg.residual.clone() if agg.residual is not None else torch.zeros(1000)
        sent = agg.select(x)
        assert bool(torch.isfinite(sent).all()) and float(sent.abs().max()) <= 65504.0
        assert torch.equal(x.float() + before, sent.float() + agg.residual)


# -- error feedback fused into the selection (topk_feedback) ---------------------------------------
def feedback_reference(x: torch.Tensor, e: torch.Tensor, k: int):
    """(indices, values, new residual) from the definition: a = x + e, the selection of a, a there,
    and a with those coordinates zeroed."""
    a = x + e
    idx = reference(a, k)
    rest = a.clone()
    rest[idx] = 0.0
    return idx, a[idx], rest


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n,k", [(1, 1), (1000, 10), (5000, 5000), (5000, 0), (300_000, 3000), (1 << 20, 10_000),
                                 (600_000, 60_000)])
def test_feedback_is_the_selection_of_the_sum_and_conserves_every_coordinate(kind, n, k):
    """topk_feedback equals the definition bit for bit (through the fused sampled pass for the large
    inputs, and the exact fallback for "ties"), leaves x untouched, sends exactly min(k, n), and
    x + e_before == e_after + scatter(values) at every coordinate (nothing lost, nothing counted twice)."""
    x = inputs(kind, n, seed=n ^ k ^ 7)
    e = 0.25 * inputs("normal", n, seed=n + 1)
    x0, e0 = x.clone(), e.clone()
    for threads in (1, 2):
        e = e0.clone()
        idx, values = CPU.topk_feedback(x, e, k, num_threads=threads)
        want_idx, want_values, want_rest = feedback_reference(x0, e0, k)
        assert idx.numel() == min(k, n) and torch.equal(idx, want_idx)
        assert torch.equal(bits(values), bits(want_values)) and torch.equal(bits(e), bits(want_rest))
        assert torch.equal(bits(x), bits(x0))
        sent = torch.zeros(n)
        sent[idx] = values
        assert torch.equal(bits(sent + e), bits(x0 + e0))   # NaN included: the same NaN bits either way


@pytest.mark.parametrize("threads", [1, 3])
def test_feedback_through_a_misled_sample_keeps_every_coordinate(threads):
    """When a = x + e sits on a huge tie, the filtering pass's candidates overflow its capacity part way
    through a thread's range and the exact fallback selects over a: the pass still writes a = x + e into
    e over the rest of that range (and the scalar tail of each range), so the selection, the values
    and the residual equal the definition bit for bit."""
    from lossless_hc import _C
    n, k = (1 << 20) + 13, 10_000
    x = inputs("ties", n, seed=5)
    e0 = torch.randint(-2, 3, (n,), generator=torch.Generator().manual_seed(6)).float()  # a stays tied
    want_idx, want_values, want_rest = feedback_reference(x, e0, k)
    e = e0.clone()
    out, values = torch.empty(k, dtype=torch.int64), torch.empty(k)
    st = _C.topk_feedback(x.data_ptr(), e.data_ptr(), n, k, out.data_ptr(), values.data_ptr(), threads)
    assert st.count == k and st.fallback == 1   # the sample misled: the exact fallback ran
    assert torch.equal(out, want_idx) and torch.equal(bits(values), bits(want_values))
    assert torch.equal(bits(e), bits(want_rest))

def test_feedback_rejects_bad_residuals():
    x = torch.randn(100)
    with pytest.raises(TypeError, match="residual"):
        CPU.topk_feedback(x, torch.zeros(99), 5)
    with pytest.raises(TypeError, match="residual"):
        CPU.topk_feedback(x, torch.zeros(100, dtype=torch.float64), 5)
    with pytest.raises(ValueError, match="residual and x overlap in memory"):
        CPU.topk_feedback(x, x, 5)


# -- the CUDA kernels on the host (emulated) ------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n,k", [(3000, 30), (20_000, 1000), (7000, 6999), (4096, 1)])
def test_emulated_cuda_equals_cpu(emulated, kind, n, k):  # noqa: F811
    x = inputs(kind, n, seed=n ^ k)
    assert torch.equal(cuda_topk.topk_select(x, k), CPU.topk_select(x, k))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n,k", [(3000, 30), (20_000, 1000), (4096, 4096)])
def test_emulated_cuda_feedback_equals_cpu(emulated, kind, n, k):  # noqa: F811
    """The CUDA twin (topk_accumulate, the selection, topk_take): the same indices, values and residual bits."""
    x = inputs(kind, n, seed=n ^ k)
    e = 0.25 * inputs("normal", n, seed=n + 3)
    ec = e.clone()
    count = n if k >= n else k
    idx, values = torch.empty(count, dtype=torch.int64), torch.empty(count)
    assert cuda_topk.topk_feedback(x, e, k, idx, values) == count
    want_idx, want_values = CPU.topk_feedback(x, ec, k)
    assert torch.equal(idx, want_idx) and torch.equal(bits(values), bits(want_values)) and torch.equal(bits(e), bits(ec))



def test_emulated_cuda_feedback_reads_a_negative_view_s_values(emulated):  # noqa: F811
    """The CUDA backend's topk_feedback of an ``x`` with torch's negative bit (torch._neg_view: the kernels
    read its memory, the negation of its values) selects, sends and keeps as residual what its values
    give, as the CPU backend does."""
    from lossless_hc.backends.cuda import CUDA
    x = inputs("normal", 3000, seed=12)
    e = 0.25 * inputs("normal", 3000, seed=13)
    ec = e.clone()
    idx, values = CUDA.topk_feedback(torch._neg_view(-x), e, 30)
    want_idx, want_values = CPU.topk_feedback(x, ec, 30)
    assert torch.equal(idx, want_idx) and torch.equal(bits(values), bits(want_values)) and torch.equal(bits(e), bits(ec))

def test_emulated_cuda_edge_counts(emulated):  # noqa: F811
    x = inputs("normal", 2000, seed=9)
    assert cuda_topk.topk_select(x, 0).numel() == 0
    assert torch.equal(cuda_topk.topk_select(x, 5000), torch.arange(2000))
    out = torch.empty(10, dtype=torch.int64)
    assert torch.equal(cuda_topk.topk_select(x, 10, out=out), reference(x, 10))


def test_every_backend_checks_out_before_its_kernels_write_through_it(emulated):  # noqa: F811
    """An ``out`` the kernels cannot write the selection into (strided, too short, not int64) and a
    bool ``k`` are ValueErrors on the CPU backend and on the CUDA backend (its host emulation here),
    before any kernel runs: the CUDA backend wrote through ``out.data_ptr()`` whatever ``out`` was."""
    from lossless_hc.backends.cuda import CUDA
    x = inputs("normal", 1000, seed=4)
    for backend in (CPU, CUDA):
        for out in (torch.empty(80, dtype=torch.int64)[::2], torch.empty(10, dtype=torch.int64),
                    torch.empty(40, dtype=torch.int32)):
            with pytest.raises(ValueError, match="out must be"):
                backend.topk_select(x, 40, out=out)
        with pytest.raises(ValueError, match="k must be"):
            backend.topk_select(x, True)
        out = torch.empty(40, dtype=torch.int64)
        assert torch.equal(backend.topk_select(x, 40, out=out), reference(x, 40))


def test_cpu_module_reports_the_kernel_copies():
    assert _cpu.thc_cpu_isas()[-1] == "portable"


# -- on a GPU (skipped, visibly, without one) -------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: the GPU top-k test did not run")
@pytest.mark.parametrize("kind", KINDS)
def test_gpu_equals_cpu(kind):
    from lossless_hc.backends import backend_for
    x = inputs(kind, 3_000_000, seed=11)
    for k in (1, 30_000, 2_999_999):
        got = backend_for("cuda").topk_select(x.cuda(), k).cpu()
        assert torch.equal(got, CPU.topk_select(x, k))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: the GPU top-k test did not run")
def test_gpu_selection_and_feedback_do_not_synchronise():
    """The CUDA top-k is queued without synchronising (its state was set by a copy from a host tensor,
    which synchronises the stream at every call)."""
    from lossless_hc.backends import backend_for
    gpu = backend_for("cuda")
    x = torch.randn(1 << 20, device="cuda")
    e = torch.zeros_like(x)
    out = torch.empty(1000, dtype=torch.int64, device="cuda")
    gpu.topk_feedback(x, e, 1000)   # warm-up: loading the kernels may synchronise
    torch.cuda.synchronize()
    previous = torch.cuda.get_sync_debug_mode()
    try:
        torch.cuda.set_sync_debug_mode("error")
        gpu.topk_select(x, 1000, out)
        idx, _ = gpu.topk_feedback(x, e, 1000)
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    assert torch.equal(out.cpu(), CPU.topk_select(x.cpu(), 1000)) and idx.cpu().unique().numel() == 1000


def test_a_smaller_openmp_team_still_selects_from_every_coordinate(tmp_path):
    """OpenMP may grant fewer threads than asked (OMP_THREAD_LIMIT, OMP_DYNAMIC, a nested call). The
    selection split the input into as many parts as it asked for and each thread took its own number's
    part: parts of threads never granted were skipped (1M coordinates at num_threads=3 under a limit of
    1: two thirds unread), the count still k. Now the parts are loop iterations: the stable-sort prefix,
    and feedback conserves every coordinate."""
    import os
    import subprocess
    import sys
    script = tmp_path / "limited.py"
    script.write_text(
        "import torch\n"
        "from lossless_hc.backends.cpu import CPU\n"
        "x = torch.randn(1 << 20, generator=torch.Generator().manual_seed(3))\n"
        "e = torch.zeros(1 << 20)\n"
        "idx, vals = CPU.topk_feedback(x, e, 1000, num_threads=3)\n"
        "torch.save({'select': CPU.topk_select(x, 1000, num_threads=3), 'idx': idx, 'vals': vals, 'e': e}, %r)\n"
        % str(tmp_path / "out.pt"))
    import lossless_hc
    here = os.path.dirname(os.path.dirname(os.path.abspath(lossless_hc.__file__)))
    env = dict(os.environ, OMP_THREAD_LIMIT="1",
               PYTHONPATH=os.pathsep.join([here] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    subprocess.run([sys.executable, str(script)], check=True, env=env, timeout=300)
    got = torch.load(tmp_path / "out.pt")
    x = torch.randn(1 << 20, generator=torch.Generator().manual_seed(3))
    want = torch.sort(torch.argsort(x.abs(), descending=True, stable=True)[:1000]).values
    assert torch.equal(got["select"], want) and torch.equal(got["idx"], want)
    back = got["e"].clone()
    back[got["idx"]] += got["vals"]
    assert torch.equal(back, x)


def test_a_float64_tensor_sent_whole_carries_its_residual():
    """A float64 tensor's top-k (a = g + e in float32, as for every dtype) sent whole once the sketch is
    off: x + e goes, as float64, and nothing stays behind (float64 holds every float32 value: no rounding,
    no clamp; a float32 value near its own range's end is sent as it is)."""
    from lossless_hc.training.topk_aggregate import TopKAggregator
    agg = TopKAggregator("w", (300,), torch.float64, 2, 0.1, sketch=False)
    assert not agg.compressed
    g = torch.Generator().manual_seed(12)
    x = torch.randn(300, generator=g).double()
    x[7] = 3e38   # float32 holds it; float64 far more
    idx, values = agg.select_indices(x)   # a sketch-free selection: the residual keeps the rest of a = x
    assert idx.numel() == agg.k == 30 and 7 in idx.tolist()
    rest = x.float().clone()
    rest[idx] = 0.0
    assert torch.equal(agg.residual, rest)
    y = torch.randn(300, generator=g).double()
    y[7] = -3e38
    sent = agg.select(y)   # sent whole: y + e, e then gone
    assert sent.dtype == torch.float64 and agg.residual is None
    assert torch.equal(sent, (y.float() + rest).double())
    assert float(sent[7]) == float(torch.tensor(-3e38, dtype=torch.float32))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_non_finite_value_leaves_nothing_behind(dtype):
    """A NaN or infinity in a = g + e goes out as it is and nothing of it stays in the residual: the
    residual is 0 there (not merely finite), so the next step's a there is its gradient alone, both where
    it is selected (sketched) and where the tensor is sent whole."""
    from lossless_hc.training.topk_aggregate import TopKAggregator
    agg = TopKAggregator("w", (1000,), dtype, 2, 0.005)   # k = 5
    assert agg.compressed and agg.k == 5
    x = torch.zeros(1000, dtype=dtype)
    x[3], x[4], x[5] = float("nan"), float("inf"), float("-inf")
    x[6] = 1.0 / 3.0   # the dtype's own value (rounded here): a = x there, sent exactly
    sent = agg.select(x)
    assert bool(sent[3].isnan()) and float(sent[4]) == float("inf") and float(sent[5]) == float("-inf")
    assert torch.equal(agg.residual[3:6], torch.zeros(3))
    assert torch.equal(agg.residual, torch.zeros(1000))
    assert torch.equal(agg.select(torch.zeros(1000, dtype=dtype)), torch.zeros(1000, dtype=dtype))
    # sent whole: x + e goes; where e made a value the dtype rounds, that remainder stays; the
    # non-finite coordinates leave 0
    dense = TopKAggregator("w", (1000,), dtype, 2, 0.005, sketch=False)
    assert not dense.compressed
    e = torch.zeros(1000)
    e[10:15] = 10.0
    e[3:7] = torch.tensor([0.5, 0.25, 0.125, 1.0 / 3.0])
    dense.select_indices(e)   # a = e: its 5 largest sent, the rest kept (a residual to carry)
    before = dense.residual.clone()
    assert torch.equal(torch.nonzero(before).reshape(-1), torch.arange(3, 7))
    sent = dense.select(x)
    total = x.float() + before
    assert bool(sent[3].isnan()) and float(sent[4]) == float("inf") and float(sent[5]) == float("-inf")
    want = torch.where(torch.isfinite(total), total - sent.float(), torch.zeros(()))
    assert dense.residual is not None and torch.equal(dense.residual, want)
    assert torch.equal(dense.residual[3:6], torch.zeros(3))


def test_use_sketch_turns_a_sketch_free_top_k_into_a_sketched_one_keeping_its_residual():
    """sketch=False: no codec, the tensor sent whole (with its residual); use_sketch() builds the codec
    from then on: select sends exactly k coordinates of a = g + e, e being the residual kept from before
    (every coordinate of a either sent or kept). A second use_sketch changes nothing."""
    from lossless_hc.training.topk_aggregate import TopKAggregator
    agg = TopKAggregator("w", (2000,), torch.float32, 2, 0.01, sketch=False)
    assert not agg.compressed and agg.k == 20
    g = torch.Generator().manual_seed(13)
    x = torch.randn(2000, generator=g)
    agg.select_indices(x)
    before = agg.residual.clone()
    assert int((before != 0).sum()) == 2000 - 20
    agg.use_sketch()
    assert agg.compressed and agg.residual is not None and torch.equal(agg.residual, before)
    y = torch.randn(2000, generator=g)
    sent = agg.select(y)
    assert int((sent != 0).sum()) == 20
    assert torch.equal(torch.nonzero(sent).reshape(-1), reference(y + before, 20))
    assert torch.equal(sent + agg.residual, y + before)
    agg.use_sketch()
    assert agg.compressed and torch.equal(sent + agg.residual, y + before)
