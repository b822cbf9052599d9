"""THCCodec(device="cuda") (csrc/cuda/thc_kernels.cuh, lossless_hc/backends/cuda_thc.py) against the CPU backend.

Marked ``gpu`` and skipped, visibly, where torch sees no CUDA device: run with ``pytest -m gpu`` on a GPU
machine (scripts/gpu_session.sh, step ``test``). Tests taking ``backend`` run once per way of loading
the kernels (``compiled``: lossless_hc._C_cuda; ``cupy``: NVRTC at run time).

What must hold (tests/test_cuda_thc_emulated.py checks the same on the host without a GPU):
* payloads (header, norm slots, packed levels), error memories and agreed norms: the CPU's bits;
* decoded outputs: the CPU's bits as well (documented tolerance: equal within 1e-6 of the largest
  magnitude, asserted separately from the bitwise check so that a failure says which one broke);
* unbiasedness, no lane overflow at the largest world size, determinism, error feedback, non-finite
  inputs handled as on the CPU, and encode never synchronising with the host.
"""
import math

import pytest
import torch

import helpers
import thc_reference as ref

import lossless_hc as lhc
from lossless_hc.backends import cpu as _backend
from lossless_hc.thc.layout import HDR_CHECKSUM, max_world_size

HAVE_CUDA = torch.cuda.is_available()
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not HAVE_CUDA, reason="no CUDA device: the GPU tests of THC's CUDA backend did not run")]


def bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().cpu().contiguous()
    return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def assert_same_bits(a, b, what):
    a, b = a.detach().cpu(), b.detach().cpu()
    assert a.shape == b.shape and a.dtype == b.dtype, what
    diff = (bits(a) != bits(b)).nonzero().reshape(-1)
    assert diff.numel() == 0, f"{what}: {diff.numel()} elements differ, first at {diff[:8].tolist()}: " \
                              f"{a.reshape(-1)[diff[:4]].tolist()} vs {b.reshape(-1)[diff[:4]].tolist()}"


def ranks(n, numel, device="cpu", **kw):
    return [lhc.THCCodec(numel, n, rank=r, device=device, **kw) for r in range(n)]


def normal_inputs(n, numel, seed, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    common = torch.randn(numel, generator=gen)
    return lambda step: [(common + torch.randn(numel, generator=gen)) * scale * (1 + r) for r in range(n)]


def run_pair(n, numel, steps, make, averaged=False, decode_bitwise=True, **kw):
    """CPU and CUDA ranks side by side; payloads and memories must be the same bits at every step, and
    the decoded outputs equal (bitwise when decode_bitwise, else within the documented tolerance)."""
    cpu, gpu = ranks(n, numel, **kw), ranks(n, numel, device="cuda", **kw)
    for step in range(steps):
        xs = make(step)
        pc = [c.encode(x) for c, x in zip(cpu, xs)]
        pg = [c.encode(x.cuda()) for c, x in zip(gpu, xs)]
        for r in range(n):
            assert pg[r].is_cuda
            assert_same_bits(pc[r], pg[r], f"step {step} rank {r} payload")
            if cpu[r].error is not None:
                assert_same_bits(cpu[r].error, gpu[r].error, f"step {step} rank {r} error memory")
        agg = sum(pc)
        agg_g = sum(pg)
        if averaged:
            # The CPU's average reaches the GPU as is: torch's CUDA division by a host scalar multiplies by
            # its reciprocal, one ulp from the CPU's quotient (the engine's averaging, not the codec's)
            agg = agg / n
            agg_g = agg.to(agg_g.device)
        yc = [c.decode(agg, averaged=averaged) for c in cpu]
        yg = [c.decode(agg_g, averaged=averaged) for c in gpu]
        for r in range(n):
            assert yg[r].is_cuda and cpu[r].norm == gpu[r].norm
            assert torch.equal(bits(yg[r]), bits(yg[0])), "ranks decode the same bits"
            scale = max(float(yc[r].abs().max()), 1e-30)
            assert float((yg[r].cpu().double() - yc[r].double()).abs().max()) <= 1e-6 * scale
            if decode_bitwise:
                assert_same_bits(yc[r], yg[r], f"step {step} rank {r} decode")
    return cpu, gpu


CONFIGS = [
    pytest.param(3000, 3, {}, id="b1024"),
    pytest.param(5000, 8, {}, id="b1024-8ranks"),
    pytest.param(37, 3, {}, id="tiny"),
    pytest.param(300, 2, {"hadamard_block": 32}, id="b32"),
    pytest.param(50000, 4, {"hadamard_block": 4096}, id="b4096"),
    pytest.param(25000, 4, {"payload_dtype": torch.int64}, id="int64"),
    pytest.param(2048, 3, {"granularity": 300, "bits": 5}, id="g300"),
    pytest.param(3000, 3, {"digits_per_word": 2}, id="pinned-2-digits"),
    pytest.param(100000, 2, {"hadamard_block": 65536}, id="b65536-passes"),
    pytest.param(300000, 3, {"hadamard_block": 1 << 20, "payload_dtype": torch.int64}, id="b2^20-passes-int64"),
    pytest.param((1 << 22) + 5, 8, {}, id="4M-8ranks"),
]


@pytest.mark.parametrize("numel,n,kw", CONFIGS)
def test_cuda_steps_match_cpu_bit_for_bit(backend, numel, n, kw):
    run_pair(n, numel, 3, normal_inputs(n, numel, numel + n), **kw)


@pytest.mark.parametrize("numel,n,kw", [CONFIGS[0], CONFIGS[1], CONFIGS[8]])
def test_cuda_decode_agrees_within_tolerance_averaged(backend, numel, n, kw):
    run_pair(n, numel, 3, normal_inputs(n, numel, 5), averaged=True, decode_bitwise=False, **kw)


def test_cuda_unbiased_smoke(backend):
    n, numel, trials = 4, 4096, 24
    gen = torch.Generator().manual_seed(8)
    xs = [torch.randn(numel, generator=gen) for _ in range(n)]
    M = 3 * max(float(x.norm()) for x in xs)

    def decode_once(t):
        gpu = ranks(n, numel, device="cuda", seed=100 + t, initial_norm=M, error_feedback=False)
        return gpu[0].decode(sum(c.encode(x.cuda()) for c, x in zip(gpu, xs)))

    helpers.assert_mean_of_decodes_unbiased(decode_once, sum(x.double() for x in xs), trials)


@pytest.mark.parametrize("dtype", [torch.float64, torch.int64])
def test_cuda_worst_case_digits_at_max_world_size(backend, dtype):
    g, digits, numel = 30, 6, 30000
    n = max_world_size(g, dtype, digits)
    kw = dict(granularity=g, digits_per_word=digits, payload_dtype=dtype, initial_norm=1.0)
    cpu, gpu = lhc.THCCodec(numel, n, **kw), lhc.THCCodec(numel, n, device="cuda", **kw)
    L = cpu.layout
    top = torch.zeros(L.words, dtype=dtype)
    _backend.CPU.thc_pack_levels(cpu._native, torch.full((L.padded,), g, dtype=torch.int32),
                             0 if dtype == torch.float64 else 1, top)
    x = torch.randn(numel)
    pc = cpu.encode(x)
    agg = pc * n
    gpu.encode(x.cuda())
    agg[L.norm_offset:L.words_offset] = pc[L.norm_offset:L.words_offset]   # one rank's norm and mirror
    agg[L.words_offset:] = top * n
    agg[HDR_CHECKSUM] = n * ref.checksum(cpu, top, 0)   # the checksum field of those words
    assert_same_bits(cpu.decode(agg), gpu.decode(agg.cuda()), "worst-case sums")
    with pytest.raises(ValueError, match=f"at most {n} ranks"):
        lhc.THCCodec(numel, n + 1, granularity=g, digits_per_word=digits, payload_dtype=dtype, device="cuda")


def test_cuda_clipping_extremes_pack_like_cpu(backend):
    n, numel = 8, 60000
    run_pair(n, numel, 2, normal_inputs(n, numel, 11, scale=1e3), initial_norm=1e-3, error_feedback=False)


def test_cuda_is_deterministic(backend):
    n, numel = 4, 1 << 20
    xs = [x.cuda() for x in normal_inputs(n, numel, 21)(0)]
    outs = []
    for _ in range(3):
        gpu = ranks(n, numel, device="cuda", initial_norm=3000.0, seed=2)
        payloads = [c.encode(x) for c, x in zip(gpu, xs)]
        agg = sum(payloads)
        ys = [c.decode(agg) for c in gpu]
        assert all(torch.equal(bits(y), bits(ys[0])) for y in ys)
        outs.append((payloads, ys[0], gpu[0].error.clone()))
    for p, y, e in outs[1:]:
        assert all(torch.equal(bits(a), bits(b)) for a, b in zip(p, outs[0][0]))
        assert torch.equal(bits(y), bits(outs[0][1])) and torch.equal(bits(e), bits(outs[0][2]))


def test_cuda_error_feedback_telescopes(backend):
    n, numel, steps = 4, 60000, 20
    gpu = ranks(n, numel, device="cuda", seed=1)
    make = normal_inputs(n, numel, 5)
    sent = torch.zeros(numel, dtype=torch.float64)
    truth = torch.zeros(numel, dtype=torch.float64)
    for step in range(steps):
        xs = make(step)
        agg = sum(c.encode(x.cuda()) for c, x in zip(gpu, xs))
        sent += gpu[0].decode(agg).double().cpu()
        for c in gpu[1:]:
            c.decode(agg)
        truth += sum(x.double() for x in xs)
        owed = sum(c.error.double().cpu() for c in gpu)
        assert float((sent + owed - truth).abs().max()) <= 1e-4 * float(truth.abs().max())
    assert float((sent - truth).norm()) / float(truth.norm()) < 0.05


def test_cuda_non_finite_input_as_on_cpu(backend):
    n, numel = 3, 20000
    cpu, gpu = ranks(n, numel, initial_norm=50.0), ranks(n, numel, device="cuda", initial_norm=50.0)
    xs = [torch.randn(numel) for _ in range(n)]
    xs[1][17] = float("nan")
    pc = [c.encode(x) for c, x in zip(cpu, xs)]
    pg = [c.encode(x.cuda()) for c, x in zip(gpu, xs)]
    for r in range(n):
        assert_same_bits(pc[r], pg[r], f"rank {r}")
        assert_same_bits(cpu[r].error, gpu[r].error, f"rank {r} memory")
    for c in gpu:
        with pytest.raises(FloatingPointError, match="1 rank"):
            c.decode(sum(pg))


def test_cuda_corrupted_words_are_reported(backend):
    cpu, gpu = ranks(2, 5000, initial_norm=70.0), ranks(2, 5000, device="cuda", initial_norm=70.0)
    xs = [torch.randn(5000) for _ in range(2)]
    agg = sum(c.encode(x) for c, x in zip(cpu, xs))
    for c, x in zip(gpu, xs):
        c.encode(x.cuda())
    agg[cpu[0].layout.words_offset + 5] += 0.25
    agg[cpu[0].layout.words_offset + 9] = float("nan")
    msgs = []
    for c, p in ((cpu[0], agg), (gpu[0], agg.cuda())):
        with pytest.raises(ValueError, match="not valid aggregated digit words") as info:
            c.decode(p)
        msgs.append(str(info.value))
    assert msgs[0] == msgs[1]


def test_cuda_encode_does_not_synchronise(backend):
    n, numel = 2, 1 << 16
    gpu = ranks(n, numel, device="cuda", initial_norm=300.0)
    xs = [torch.randn(numel, device="cuda") for _ in range(n)]
    for _ in range(2):   # warm-up: kernels loaded, allocator primed
        agg = sum(c.encode(x) for c, x in zip(gpu, xs))
        for c in gpu:
            c.decode(agg)
    torch.cuda.set_sync_debug_mode("error")
    try:
        payloads = [c.encode(x) for c, x in zip(gpu, xs)]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    agg = sum(payloads)
    for c in gpu:
        c.decode(agg)


def test_cuda_codec_input_checks(backend):
    c = lhc.THCCodec(100, 2, device="cuda", initial_norm=1.0)
    assert c.device.type == "cuda" and c.device.index is not None
    with pytest.raises(ValueError, match="on cpu"):
        c.encode(torch.zeros(100))
    p = c.encode(torch.zeros(10, 10, device="cuda", dtype=torch.float16))
    assert p.is_cuda and p.dtype == torch.float64
    with pytest.raises(ValueError, match="payload is on"):
        c.decode(p.cpu())


@pytest.mark.parametrize("numel,n,kw", [
    pytest.param(300_001, 3, {}, id="b1024-partial-row"),
    pytest.param(100_003, 4, {"payload_dtype": torch.int64}, id="int64"),
    pytest.param(40_000, 2, {"hadamard_block": 256}, id="b256"),
])
def test_cuda_interleaved_matches_cpu(backend, numel, n, kw):
    """encode(x, interleaved=True): the CUDA backend makes the interleave with strided copies, the CPU
    kernels read it in place; payloads, error memories and decoded sums (into a new tensor and into
    ``out``, in x's shape) are the same bits, step after step."""
    padded = lhc.THCCodec(numel, n, rank=0, **kw).layout.padded
    cpu, gpu = ranks(n, padded, **kw), ranks(n, padded, device="cuda", **kw)
    make = normal_inputs(n, numel, seed=numel)
    for step in range(3):
        xs = [x.reshape(-1, 1) if r == 1 else x for r, x in enumerate(make(step))]
        pc = [c.encode(x, interleaved=True) for c, x in zip(cpu, xs)]
        pg = [c.encode(x.cuda(), interleaved=True) for c, x in zip(gpu, xs)]
        for r in range(n):
            assert_same_bits(pc[r], pg[r], f"step {step} rank {r} payload")
            assert_same_bits(cpu[r].error, gpu[r].error, f"step {step} rank {r} error memory")
        agg, agg_g = sum(pc), sum(pg)
        for r in range(n):
            yc = cpu[r].decode(agg)
            if r == 0:
                out = torch.full((numel,), float("nan"), device="cuda")
                yg = gpu[r].decode(agg_g, out=out)
                assert yg.data_ptr() == out.data_ptr()
            else:
                yg = gpu[r].decode(agg_g)
            assert yg.is_cuda and yg.shape == xs[r].shape == yc.shape
            assert_same_bits(yc, yg, f"step {step} rank {r} decode")


@pytest.mark.parametrize("cpu_steps", [0, 2])
def test_thc_aggregator_follows_the_gradient_device(backend, cpu_steps):
    """Compression.thc on CUDA gradients: the aggregator's codec moves to the GPU with its state (step, agreed
    norm, error memory: after ``cpu_steps`` steps on the CPU that state is no longer a fresh codec's) and every
    rank decodes the same bits, and keeps the same error memory, as a CPU aggregator."""
    from lossless_hc.training.thc_aggregate import THCAggregator
    n = 2
    cpu = [THCAggregator("w", (256, 64), torch.float32, n, rank=r, seed=5) for r in range(n)]
    gpu = [THCAggregator("w", (256, 64), torch.float32, n, rank=r, seed=5) for r in range(n)]
    g = torch.Generator().manual_seed(0)
    for step in range(cpu_steps + 3):
        xs = [torch.randn(256, 64, generator=g) for _ in range(n)]
        on_gpu = step >= cpu_steps
        enc_c = [a.encode(x) for a, x in zip(cpu, xs)]
        enc_g = [a.encode(x.cuda() if on_gpu else x) for a, x in zip(gpu, xs)]
        assert all(p.is_cuda == on_gpu and a.codec.device.type == ("cuda" if on_gpu else "cpu")
                   for (p, _), a in zip(enc_g, gpu))
        sc, sg = sum(p for p, _ in enc_c), sum(p for p, _ in enc_g)
        oc = [a.decode(sc, ctx) for a, (_, ctx) in zip(cpu, enc_c)]
        og = [a.decode(sg, ctx) for a, (_, ctx) in zip(gpu, enc_g)]
        for o_c, o_g, a_c, a_g in zip(oc, og, cpu, gpu):
            assert o_g.value.is_cuda == on_gpu and o_g.value.shape == (256, 64)
            assert_same_bits(o_c.value, o_g.value, f"step {step}")
            assert_same_bits(a_c.pending_error(), a_g.pending_error(), f"step {step}: error memory")
