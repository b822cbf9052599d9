"""THC's CUDA kernels (csrc/cuda/thc_kernels.cuh) and their launch sequence (lossless_hc/backends/cuda_thc.py),
run on the host: no GPU needed.

The kernels are compiled with the host compiler against tests/cuda_emulation/cuda_emulation.h (every
CUDA thread a fiber, scheduled in a random order per launch; shared memory, barriers and atomics
emulated), behind the launch interface of lossless_hc._C_cuda (the fixture of
tests/test_cuda_emulated.py). A codec built for the CPU is then switched to the CUDA backend's layout
(``to_emulated_cuda``), so THCCodec's real CUDA path -- encode, norm slot, non-finite handling, error
feedback, decode -- runs on CPU tensors. Every test compares it with the CPU backend: payloads, norm
slots, error memories and decoded outputs must be the same bits.

What this cannot check: performance, and a real GPU's compiler (nvcc's contraction rules are pinned by
the explicit intrinsics of csrc/thc_math.h; tests/test_cuda_thc.py checks the same equalities on a GPU).
"""
import math

import pytest
import torch

import helpers
import thc_reference as ref

import lossless_hc as lhc
from lossless_hc.backends import cpu as _backend
from lossless_hc.backends import cuda_thc as _cuda_thc
from lossless_hc.thc.layout import HDR_CHECKSUM, HEADER_FIELDS, max_world_size

from test_cuda_emulated import emulated  # noqa: F401  (the module-scoped fixture: builds and installs the emulation)


def to_emulated_cuda(codec):
    """Switch a CPU-built codec to the CUDA kernels (run by the emulation on its CPU tensors)."""
    from lossless_hc.backends.cuda import CUDA
    codec._backend = CUDA
    codec._native = _cuda_thc.ThcCudaLayout(codec.layout, torch.device("cpu"), codec._lo, codec._width,
                                            codec._inv_width)
    return codec


def ranks(n, numel, **kw):
    return [lhc.THCCodec(numel, n, rank=r, **kw) for r in range(n)]


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits of a tensor, for exact comparisons (NaN == NaN, -0 != +0)."""
    return t.contiguous().view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def assert_same_bits(a, b, what):
    assert a.shape == b.shape and a.dtype == b.dtype, what
    diff = (bits(a) != bits(b)).nonzero().reshape(-1)
    assert diff.numel() == 0, f"{what}: {diff.numel()} elements differ, first at {diff[:8].tolist()}: " \
                              f"{a.reshape(-1)[diff[:4]].tolist()} vs {b.reshape(-1)[diff[:4]].tolist()}"


def run_pair(n, numel, steps, gen_inputs, averaged=False, **kw):
    """CPU ranks and emulated-CUDA ranks side by side for `steps` steps: every payload, error memory,
    norm and decoded output must be the same bits. Returns the last decoded output."""
    cpu = ranks(n, numel, **kw)
    gpu = [to_emulated_cuda(c) for c in ranks(n, numel, **kw)]
    y = None
    for step in range(steps):
        xs = gen_inputs(step)
        pc = [c.encode(x) for c, x in zip(cpu, xs)]
        pg = [c.encode(x) for c, x in zip(gpu, xs)]
        for r in range(n):
            assert_same_bits(pc[r], pg[r], f"step {step} rank {r} payload")
            if cpu[r].error is not None:
                assert_same_bits(cpu[r].error, gpu[r].error, f"step {step} rank {r} error memory")
        agg = sum(pc)
        if averaged:
            agg = agg / n
        yc = [c.decode(agg, averaged=averaged) for c in cpu]
        yg = [c.decode(agg.clone(), averaged=averaged) for c in gpu]
        for r in range(n):
            assert_same_bits(yc[r], yg[r], f"step {step} rank {r} decode")
            assert cpu[r].norm == gpu[r].norm
        y = yg[0]
    return y


def normal_inputs(n, numel, seed, shape=None, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    common = torch.randn(numel, generator=gen)

    def make(step):
        xs = [(common + torch.randn(numel, generator=gen)) * scale * (1 + r) for r in range(n)]
        return [x.reshape(shape) if shape else x for x in xs]
    return make


CONFIGS = [
    # numel, n, codec keywords; `block` below is the layout's Hadamard block
    pytest.param(3000, 3, {}, id="b1024-3ranks"),                                   # group of 3 blocks? (per_word 7)
    pytest.param(5000, 8, {}, id="b1024-8ranks-straddling-words"),                  # 6 digits: words straddle blocks
    pytest.param(37, 3, {}, id="tiny-b64"),                                         # one block of 64 < a norm chunk
    pytest.param(300, 2, {"hadamard_block": 32}, id="b32-many-blocks"),             # norm chunks span blocks
    pytest.param(5000, 4, {"hadamard_block": 4096}, id="b4096-chunks-in-block"),
    pytest.param(2500, 4, {"payload_dtype": torch.int64}, id="int64"),
    pytest.param(2048, 3, {"granularity": 300, "bits": 5}, id="g300-wide-levels"),  # 4-byte level scratch
    pytest.param(1500, 5, {"bits": 2, "granularity": 15, "overflow_freq": 1024}, id="bits2-g15"),
    pytest.param(2000, 2, {"error_feedback": False, "initial_norm": 60.0}, id="no-error-feedback"),
    pytest.param(3000, 3, {"digits_per_word": 2}, id="pinned-2-digits"),
    pytest.param(10000, 2, {"hadamard_block": 8192}, id="b8192-passes"),           # transform in passes
    pytest.param(20000, 3, {"hadamard_block": 16384, "payload_dtype": torch.int64}, id="b16384-passes-int64"),
    # 35 tiles of 4096 (the last one partial) for an emulated grid of 32 blocks: the tile loop goes round.
    pytest.param(32 * 4096 + 3 * 1024 + 5, 3, {}, id="b1024-tiles-wrap-grid"),
]


def test_emulated_interleaved_matches_cpu(emulated):  # noqa: F811
    """encode(x, interleaved=True): the CUDA backend makes the interleave with strided copies, the CPU
    kernels read it in place; the payloads, error memories and decoded sums are the same bits."""
    numel, n = 5 * 1024 + 3, 3
    padded = lhc.THCCodec(numel, n, rank=0).layout.padded
    cpu = ranks(n, padded)
    gpu = [to_emulated_cuda(c) for c in ranks(n, padded)]
    make = normal_inputs(n, numel, seed=5)
    for step in range(3):
        xs = make(step)
        pc = [c.encode(x, interleaved=True) for c, x in zip(cpu, xs)]
        pg = [c.encode(x, interleaved=True) for c, x in zip(gpu, xs)]
        for r in range(n):
            assert_same_bits(pc[r], pg[r], f"step {step} rank {r} payload")
            assert_same_bits(cpu[r].error, gpu[r].error, f"step {step} rank {r} error memory")
        agg = sum(pc)
        for r in range(n):
            yc, yg = cpu[r].decode(agg), gpu[r].decode(agg.clone())
            assert yc.shape == (numel,)
            assert_same_bits(yc, yg, f"step {step} rank {r} decode")


@pytest.mark.parametrize("numel,n,kw", CONFIGS)
def test_emulated_steps_match_cpu_bit_for_bit(emulated, numel, n, kw):  # noqa: F811
    """Norm-only round, then steps with error feedback: same payload, memory, norm and output bits."""
    steps = 3 if kw.get("error_feedback", True) else 2
    y = run_pair(n, numel, steps, normal_inputs(n, numel, numel + n), **kw)
    assert bool(torch.isfinite(y).all()) and float(y.abs().max()) > 0


@pytest.mark.parametrize("numel,n,kw", [CONFIGS[1], CONFIGS[3], CONFIGS[10]])
def test_emulated_average_matches_cpu(emulated, numel, n, kw):  # noqa: F811
    run_pair(n, numel, 3, normal_inputs(n, numel, 7), averaged=True, **kw)


def test_emulated_shapes_dtypes_and_predivided_average(emulated):  # noqa: F811
    n, shape = 3, (7, 11, 13)
    numel = math.prod(shape)
    gen = torch.Generator().manual_seed(3)

    def make(step):
        return [torch.randn(shape, generator=gen).to(torch.bfloat16) for _ in range(n)]
    y = run_pair(n, numel, 3, make)
    assert y.shape == shape and y.dtype == torch.bfloat16
    # Horovod's gradient_predivide_factor: each payload divided by n before the sum.
    cpu = ranks(n, 4096, initial_norm=80.0, seed=4)
    gpu = [to_emulated_cuda(c) for c in ranks(n, 4096, initial_norm=80.0, seed=4)]
    xs = [torch.randn(4096, generator=gen) for _ in range(n)]
    pre = sum(c.encode(x) / n for c, x in zip(cpu, xs))
    for c, x in zip(gpu, xs):
        c.encode(x)
    assert_same_bits(cpu[0].decode(pre, averaged=True), gpu[0].decode(pre.clone(), averaged=True), "predivided")


@pytest.mark.parametrize("numel,n,kw", [(3000, 2, {}), (1000, 3, {"hadamard_block": 32}),
                                         (10000, 2, {"hadamard_block": 8192})])
def test_emulated_kernels_match_the_dense_oracle(emulated, numel, n, kw):  # noqa: F811
    """Against the definitions (dense Hadamard matrices in float64, tests/thc_reference.py): each rank's
    memory is x - RHT^{-1}(own dequantized levels), and decode is RHT^{-1} of the dequantized digit sums."""
    gen = torch.Generator().manual_seed(numel)
    xs = [torch.randn(numel, generator=gen) for _ in range(n)]
    M = max(float(x.norm()) for x in xs)
    gpu = [to_emulated_cuda(c) for c in ranks(n, numel, initial_norm=M, seed=21, **kw)]
    payloads = [c.encode(x) for c, x in zip(gpu, xs)]
    L, c0 = gpu[0].layout, gpu[0]
    stream = _backend.thc_sign_stream(21, 0)
    unit = M / math.sqrt(L.padded)
    a, b = 2 * c0.threshold / L.granularity * unit, -c0.threshold * unit
    cpu0 = lhc.THCCodec(numel, n, **kw)   # its _native unpacks words (CPU helper)

    def unpack(words):
        y = torch.empty(L.padded, dtype=torch.float32)
        assert _backend.CPU.thc_unpack_levels(cpu0._native, 0, words.contiguous(), 1.0, y) == 0
        return y.double()
    for c, x, p in zip(gpu, xs, payloads):
        levels = unpack(p[L.words_offset:])
        assert set(levels.unique().tolist()) <= set(float(v) for v in c.table.levels)
        own = ref.inverse_rht(levels * a + b, L, stream)
        assert float((c.error.double() - (x.double() - own)).abs().max()) <= 1e-5 * M
    summed = sum(payloads)
    want = ref.inverse_rht(unpack(summed[L.words_offset:]) * a + n * b, L, stream)
    assert float((c0.decode(summed).double() - want).abs().max()) <= n * 1e-5 * M


def test_emulated_non_finite_input_resets_memory_and_raises(emulated):  # noqa: F811
    n, numel = 3, 2000
    cpu = ranks(n, numel, initial_norm=50.0)
    gpu = [to_emulated_cuda(c) for c in ranks(n, numel, initial_norm=50.0)]
    gen = torch.Generator().manual_seed(5)
    for step in range(2):   # step 0 sets a non-zero memory, step 1 has the NaN
        xs = [torch.randn(numel, generator=gen) for _ in range(n)]
        if step == 1:
            xs[1][17] = float("nan")
            xs[2][5] = float("inf")
        before = [c.error.clone() for c in gpu]
        pc = [c.encode(x) for c, x in zip(cpu, xs)]
        pg = [c.encode(x) for c, x in zip(gpu, xs)]
        for r in range(n):
            assert_same_bits(pc[r], pg[r], f"step {step} rank {r}")
            assert_same_bits(cpu[r].error, gpu[r].error, f"step {step} rank {r} memory")
        agg = sum(pc)
        if step == 0:
            for c in cpu + gpu:
                c.decode(agg)
            continue
        assert float(before[1].abs().max()) > 0 and bool((gpu[1].error == 0).all()) and bool((gpu[2].error == 0).all())
        assert torch.equal(gpu[0].error, cpu[0].error) and float(gpu[0].error.abs().max()) > 0
        assert float(pg[1][2]) == 1.0 and bool((pg[1][HEADER_FIELDS:] == 0).all())
        for c in gpu:
            with pytest.raises(FloatingPointError, match="2 rank"):
                c.decode(agg.clone())


def test_emulated_overflowing_memory_is_reset_as_on_cpu(emulated):  # noqa: F811
    """x finite but x + e (or its square) overflows: the non-finite flag and a zeroed memory."""
    numel = 1500
    cpu, gpu = lhc.THCCodec(numel, 2, rank=1, initial_norm=5.0), \
        to_emulated_cuda(lhc.THCCodec(numel, 2, rank=1, initial_norm=5.0))
    for c in (cpu, gpu):
        c.error.fill_(2e19)       # finite, but its square overflows float32 and the norm is inf
    x = torch.randn(numel, generator=torch.Generator().manual_seed(2))
    pc, pg = cpu.encode(x), gpu.encode(x)
    assert_same_bits(pc, pg, "payload")
    assert float(pg[2]) == 1.0 and bool((gpu.error == 0).all())
    assert_same_bits(cpu.error, gpu.error, "memory")


@pytest.mark.parametrize("dtype", [torch.float64, torch.int64])
def test_emulated_corrupted_words_are_counted_as_on_cpu(emulated, dtype):  # noqa: F811
    n, numel = 2, 5000
    cpu = ranks(n, numel, initial_norm=70.0, payload_dtype=dtype)
    gpu = [to_emulated_cuda(c) for c in ranks(n, numel, initial_norm=70.0, payload_dtype=dtype)]
    xs = [torch.randn(numel, generator=torch.Generator().manual_seed(r)) for r in range(n)]
    agg = sum(c.encode(x) for c, x in zip(cpu, xs))
    for c, x in zip(gpu, xs):
        c.encode(x)
    L = cpu[0].layout
    off = L.words_offset
    if dtype == torch.float64:
        agg[off + 5] += 0.25                               # not an integer
        agg[off + 170] = float(L.base ** L.per_word)       # one digit too many
        agg[off + 171] = float("nan")
        agg[off + L.words - 1] = -1.0                     # negative
    else:
        agg[off + 5] = -3
        agg[off + 170] = L.base ** L.per_word
        agg[off + L.words - 1] = L.base ** L.per_word      # the last word (a full one here): too large
    msgs = []
    for c in (cpu[0], gpu[0]):
        with pytest.raises(ValueError, match="not valid aggregated digit words") as info:
            c.decode(agg.clone())
        msgs.append(str(info.value))
    assert msgs[0] == msgs[1] and msgs[0].startswith("4 payload word(s)" if dtype == torch.float64 else "3 payload")


@pytest.mark.parametrize("dtype,block", [(torch.float64, 1024), (torch.int64, 1024), (torch.float64, 8192)])
def test_emulated_checksum_and_norm_mirrors_as_on_cpu(emulated, dtype, block):  # noqa: F811
    """The checksum field is the defined sum on both backends (the payload bits are equal), and a
    payload with one valid level word changed, or a corrupted norm slot, is refused by both
    with the same message (decode in shared memory, and in passes for blocks above 4096)."""
    n, numel = 3, 20000
    kw = dict(initial_norm=70.0, payload_dtype=dtype, hadamard_block=block)
    cpu = ranks(n, numel, **kw)
    gpu = [to_emulated_cuda(c) for c in ranks(n, numel, **kw)]
    xs = [torch.randn(numel, generator=torch.Generator().manual_seed(r)) for r in range(n)]
    pc = [c.encode(x) for c, x in zip(cpu, xs)]
    pg = [c.encode(x) for c, x in zip(gpu, xs)]
    L = cpu[0].layout
    for r in range(n):
        assert_same_bits(pc[r], pg[r], f"rank {r}")
        assert int(pg[r][HDR_CHECKSUM]) == ref.checksum(cpu[0], pg[r][L.words_offset:], 0)
    agg = sum(pc)
    flipped = agg.clone()
    flipped[L.words_offset + 77] += 1     # still a valid aggregate word (one digit off by one)
    slot = agg.clone()
    slot.view(torch.float64)[L.norm_offset + 1] = 1e300   # the float64 bits in an int64 payload
    for bad, match in ((flipped, "checksum mismatch"), (slot, "norm slots are corrupted")):
        msgs = []
        for c in (cpu[0], gpu[0]):
            c._pending, c._step = True, 0
            with pytest.raises(ValueError, match=match) as info:
                c.decode(bad.clone())
            msgs.append(str(info.value))
        assert msgs[0] == msgs[1]


@pytest.mark.parametrize("dtype", [torch.float64, torch.int64])
def test_emulated_worst_case_digits_at_max_world_size(emulated, dtype):  # noqa: F811
    """Every rank at level g everywhere, at the largest world size a pinned lane count allows: the
    digit sums n g decode on the emulated GPU exactly as on the CPU (no carry, no invalid word), and the
    one-past-the-limit world size is refused."""
    g, digits = 30, 6
    n = max_world_size(g, dtype, digits)
    numel = 3000
    cpu = lhc.THCCodec(numel, n, granularity=g, digits_per_word=digits, payload_dtype=dtype, initial_norm=1.0)
    gpu = to_emulated_cuda(lhc.THCCodec(numel, n, granularity=g, digits_per_word=digits, payload_dtype=dtype,
                                        initial_norm=1.0))
    L = cpu.layout
    top = torch.zeros(L.words, dtype=dtype)
    _backend.CPU.thc_pack_levels(cpu._native, torch.full((L.padded,), g, dtype=torch.int32), 0 if dtype == torch.float64
                             else 1, top)
    x = torch.randn(numel)
    pc = cpu.encode(x)
    gpu.encode(x)
    agg = pc * n
    agg[L.norm_offset:L.words_offset] = pc[L.norm_offset:L.words_offset]   # one rank's norm and mirror
    agg[L.words_offset:] = top * n
    agg[HDR_CHECKSUM] = n * ref.checksum(cpu, top, 0)   # the checksum field of those words
    yc, yg = cpu.decode(agg), gpu.decode(agg.clone())
    assert_same_bits(yc, yg, "decode of the worst-case sums")
    with pytest.raises(ValueError, match=f"at most {n} ranks"):
        lhc.THCCodec(numel, n + 1, granularity=g, digits_per_word=digits, payload_dtype=dtype)


def test_emulated_clipping_extremes_pack_like_cpu(emulated):  # noqa: F811
    """A tiny agreed norm: every coordinate clips at +-T, so levels are 0 or g (the largest digits the
    packing kernel writes), at the largest world size of the default lane count."""
    n, numel = 8, 6000
    run_pair(n, numel, 2, normal_inputs(n, numel, 11, scale=1e3), initial_norm=1e-3, error_feedback=False)


@pytest.mark.parametrize("g", [255, 256])
def test_emulated_clipped_levels_at_the_one_byte_boundary_pack_like_cpu(emulated, g):  # noqa: F811
    """Levels run from 0 to g: granularity 255 is the largest whose levels fit the kernels' 1-byte level
    scratch, and at 256 the clipped coordinates' level 256 needs the 4-byte one (a byte would wrap it to
    0). Every coordinate clips, so both extremes are packed: the CPU's bits on both sides."""
    n, numel = 3, 3000
    run_pair(n, numel, 1, normal_inputs(n, numel, 13, scale=1e3), initial_norm=1e-3, error_feedback=False,
             granularity=g)


def test_emulated_decode_and_encode_are_deterministic(emulated):  # noqa: F811
    """The emulated threads interleave differently on every run (atomics, tree passes): same bits."""
    n, numel = 3, 9000
    xs = normal_inputs(n, numel, 21)(0)
    outs = []
    for _ in range(3):
        gpu = [to_emulated_cuda(c) for c in ranks(n, numel, initial_norm=100.0, seed=2)]
        payloads = [c.encode(x) for c, x in zip(gpu, xs)]
        agg = sum(payloads)
        outs.append((payloads, gpu[0].decode(agg), gpu[0].error.clone()))
    for p, y, e in outs[1:]:
        assert all(torch.equal(bits(a), bits(b)) for a, b in zip(p, outs[0][0]))
        assert torch.equal(bits(y), bits(outs[0][1])) and torch.equal(bits(e), bits(outs[0][2]))


def test_emulated_error_feedback_telescopes(emulated):  # noqa: F811
    """Over steps, what was decoded plus what the ranks still owe equals what they were given."""
    n, numel, steps = 3, 3000, 6
    gpu = [to_emulated_cuda(c) for c in ranks(n, numel, seed=1)]
    make = normal_inputs(n, numel, 5)
    sent = torch.zeros(numel, dtype=torch.float64)
    truth = torch.zeros(numel, dtype=torch.float64)
    for step in range(steps):
        xs = make(step)
        agg = sum(c.encode(x) for c, x in zip(gpu, xs))
        sent += gpu[0].decode(agg).double()
        for c in gpu[1:]:
            c.decode(agg)
        truth += sum(x.double() for x in xs)
        owed = sum(c.error.double() for c in gpu)
        assert float((sent + owed - truth).abs().max()) <= 1e-4 * float(truth.abs().max())


def test_emulated_unbiased_smoke(emulated):  # noqa: F811
    """Mean of independent decodes (different seeds) approaches the true sum (no clipping: 3x headroom)."""
    n, numel, trials = 2, 1024, 12
    gen = torch.Generator().manual_seed(8)
    xs = [torch.randn(numel, generator=gen) for _ in range(n)]
    M = 3 * max(float(x.norm()) for x in xs)

    def decode_once(t):
        gpu = [to_emulated_cuda(c) for c in ranks(n, numel, seed=100 + t, initial_norm=M, error_feedback=False)]
        return gpu[0].decode(sum(c.encode(x) for c, x in zip(gpu, xs)))

    helpers.assert_mean_of_decodes_unbiased(decode_once, sum(x.double() for x in xs), trials)


# -- errors where no CUDA kernels can run (no GPU needed) -------------------------------------------
def test_cuda_device_without_a_gpu_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match=r"THCCodec\(device='cuda'\) needs a CUDA device"):
        lhc.THCCodec(100, 2, device="cuda")


@pytest.mark.parametrize("make", [lambda: lhc.THCCodec(100, 2, device="cuda"),
                                  lambda: lhc.LosslessCodec(4096, 2, 40, device="cuda")], ids=["THC", "LHC"])
def test_a_gpu_older_than_compute_capability_8_is_a_clear_error(monkeypatch, make):
    """The kernels use __reduce_add_sync (sm_80 on): a V100 or T4 got a compile or "no kernel image" error
    at the first launch; now the codec's constructor says what and why."""
    from lossless_hc.backends import cuda_runtime
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(cuda_runtime, "launcher", lambda: None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla T4")
    with pytest.raises(RuntimeError, match=r"need compute capability 8\.0 or newer; cuda:0 \(Tesla T4\) has 7\.5"):
        make()


def test_missing_cuda_kernels_is_a_clear_error(monkeypatch):
    from lossless_hc.backends import cuda_runtime

    def unavailable():
        raise ImportError("lossless_hc has no CUDA kernels available: lossless_hc._C_cuda is not built")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(cuda_runtime, "launcher", unavailable)
    with pytest.raises(ImportError, match=r"THCCodec\(device='cuda'\): lossless_hc has no CUDA kernels"):
        lhc.THCCodec(100, 2, device="cuda")


def test_bench_thc_lockstep_check_runs():
    """The CPU lockstep of `bench thc --device cuda`, exercised on the CPU (cpu_check="force")."""
    from lossless_hc.bench.thc import render_thc, run_thc_bench
    from lossless_hc.bench.common import machine_info
    res = run_thc_bench(numel=4096, workers=2, repeat=1, warmup=2, cpu_check="force")
    assert res["cpu_equal"] == {"ok": True, "steps": 3, "mismatches": []}
    assert "same bits as the CPU backend" in render_thc(res, machine_info(), "cmd")
    assert res["timing"]["kernels_ms"] is None and "kernels (one profiled run" not in render_thc(res, machine_info(), "cmd")
    # On a GPU the per-kernel times of one profiled encode and decode are rendered (the GPU run fills them).
    res["timing"]["kernels_ms"] = {"encode": {"thc_encode_blocks": 1.0}, "decode": {"thc_decode_blocks": 0.5},
                                   "encode_table": "thc_encode_blocks  1.000 ms", "decode_table": "thc_decode_blocks  0.500 ms"}
    text = render_thc(res, machine_info(), "cmd")
    assert "kernels (one profiled run" in text and "thc_encode_blocks  1.000 ms" in text and "thc_decode_blocks" in text
