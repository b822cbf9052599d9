"""The CUDA backend (csrc/cuda, lossless_hc/backends/cuda.py and cuda_lhc.py) against the CPU backend and the float64 truth.

Every test here is marked ``gpu`` and skipped, visibly, where torch sees no CUDA device; run them with
``pytest -m gpu`` on a GPU machine (scripts/gpu_session.sh). Tests parametrised over ``backend`` run
once per available way of loading the kernels: ``compiled`` (lossless_hc._C_cuda) and ``cupy``
(NVRTC at run time); a backend that is not available is skipped with the reason.

What must hold:
* encode: the same header and index words as the CPU backend, bit for bit, and sketch cells equal
  within the float rounding of their (differently ordered) sums;
* decode: lossless within the rigorous per-key error bound of its own peeling order (the trace),
  the same verdicts (ok, reason, candidates, support) as the CPU backend, and bitwise deterministic;
* any payload, however corrupted, decodes without a crash or an out-of-bounds access (run under
  compute-sanitizer by scripts/gpu_session.sh) and is never reported ok when the CPU says it is not;
* encode never synchronises with the host; decode synchronises once.

The multilevel index's tests at realistic sizes: tests/test_cuda_multilevel.py.
"""
import warnings

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import helpers
from lossless_hc import LosslessCodec
from lossless_hc.lhc import reference as reference
from lossless_hc.lhc.layout import HEADER_FIELDS

HAVE_CUDA = torch.cuda.is_available()
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not HAVE_CUDA, reason="no CUDA device: the GPU tests of the CUDA backend did not run")]

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def codecs(numel, n, k, block=1, index="auto", seed=0):
    """The same codec on the CPU and on the GPU."""
    cpu = LosslessCodec(numel, n, k, block_size=block, seed=seed, index=index)
    gpu = LosslessCodec(numel, n, k, block_size=block, seed=seed, index=index, device="cuda")
    assert cpu.layout == gpu.layout
    return cpu, gpu


def bits(t: torch.Tensor) -> torch.Tensor:
    b = t.detach().cpu().contiguous().view(torch.int32).clone()
    b[torch.isnan(t.detach().cpu())] = 0x7FC00000
    return b


def cell_bound(layout, x: torch.Tensor) -> torch.Tensor:
    """|difference| allowed between two float32 sums of one rank's terms in a cell, summed in
    different orders: 2 (deg - 1) u M(c) per lane, M the absolute mass of the cell's terms w * v
    (weights of magnitude 1 or 2)."""
    B = layout.block
    flat = x.reshape(-1).to(torch.float64).numpy()
    num_keys = layout.num_keys
    pad = np.zeros(num_keys * B)
    pad[:flat.size] = np.abs(flat)
    absx = pad.reshape(num_keys, B)
    keys = helpers.nonzero_keys(x.float(), B)
    C = layout.sketch.cells
    M = np.zeros((C, B))
    deg = np.zeros(C)
    if len(keys):
        cells, weights = reference.key_cells(layout.sketch, torch.from_numpy(keys))
        cells, magnitudes = cells.numpy(), weights.abs().numpy().astype(np.float64)
        for j in range(3):
            np.add.at(M, cells[:, j], absx[keys] * magnitudes[:, j:j + 1])
            np.add.at(deg, cells[:, j], 1)
    bound = 2 * np.maximum(deg - 1, 0)[:, None] * helpers.U32 * M
    return torch.from_numpy(bound.reshape(-1))


def mass_bound(layout, x: torch.Tensor):
    """(exact mass channel in float64, |float32 mass - exact| allowed): each cell sums its keys'
    |w| max |block| (non-negative terms, deg - 1 roundings: at most 1.01 (deg - 1) u of the sum)."""
    B = layout.block
    pad = np.zeros(layout.num_keys * B)
    pad[:x.numel()] = np.abs(x.reshape(-1).to(torch.float64).numpy())
    block_max = pad.reshape(layout.num_keys, B).max(axis=1)
    keys = helpers.nonzero_keys(x.float(), B)
    C = layout.sketch.cells
    exact, deg = np.zeros(C), np.zeros(C)
    if len(keys):
        cells, weights = reference.key_cells(layout.sketch, torch.from_numpy(keys))
        cells, magnitudes = cells.numpy(), weights.abs().numpy().astype(np.float64)
        for j in range(3):
            np.add.at(exact, cells[:, j], block_max[keys] * magnitudes[:, j])
            np.add.at(deg, cells[:, j], 1)
    return torch.from_numpy(exact), torch.from_numpy(1.01 * np.maximum(deg - 1, 0) * helpers.U32 * exact)


def assert_same_payload(layout, p_cpu: torch.Tensor, p_gpu: torch.Tensor, x: torch.Tensor) -> None:
    p_gpu = p_gpu.cpu()
    assert p_gpu.shape == p_cpu.shape
    assert torch.equal(bits(p_gpu[:HEADER_FIELDS]), bits(p_cpu[:HEADER_FIELDS])), \
        f"header differs: {p_gpu[:HEADER_FIELDS].tolist()} vs {p_cpu[:HEADER_FIELDS].tolist()}"
    if layout.index_kind == "dense":
        assert torch.equal(bits(p_gpu), bits(p_cpu))
        return
    io, so = layout.index_offset, layout.sketch_offset
    diff = (bits(p_gpu[io:so]) != bits(p_cpu[io:so])).nonzero().reshape(-1)
    assert diff.numel() == 0, f"index words differ at {diff[:10].tolist()}"
    mo = layout.mass_offset
    g, c = p_gpu[so:mo].double(), p_cpu[so:mo].double()
    err = (g - c).abs()
    tol = cell_bound(layout, x.float())
    bad = err > tol
    assert not bool(bad.any()), (f"{int(bad.sum())} sketch floats differ beyond rounding; first at "
                                 f"{bad.nonzero()[:5].reshape(-1).tolist()}")
    exact, mtol = mass_bound(layout, x.float())
    for name, p in (("GPU", p_gpu), ("CPU", p_cpu)):
        bad = (p[mo:].double() - exact).abs() > mtol
        assert not bool(bad.any()), f"{name} mass channel off at cells {bad.nonzero()[:5].reshape(-1).tolist()}"


def index_verdicts_agree(cpu: LosslessCodec, native, payload: torch.Tensor, averaged: bool = False):
    """Decode ``payload`` with the CPU backend and with the CUDA kernels of ``native`` (a GPU codec's
    ``_cuda.CudaLayout``, or the host emulation's on CPU tensors), below LosslessCodec's header checks,
    and require the CPU's raw verdict exactly: status (with its precedence), candidates, support,
    false positives; peeled and the output's zero/NaN pattern too unless the support overflowed the
    value peel's list (then the GPU skips the value peel: see tests/test_cuda_multilevel_emulated.py);
    and when the index failed, the same all-zero output. Returns (status, GPU output on the CPU, the
    GPU DecodeRun, the multilevel mode of the last level decoded: 0 list, 1 too many nodes, 2 replayed).
    """
    from lossless_hc.backends import cpu as _backend
    from lossless_hc.backends import cuda_lhc as _cuda
    from lossless_hc.lhc.layout import HDR_KEYS_HI, HDR_KEYS_LO, HDR_KEYS_MID
    L = cpu.layout
    scale = float(L.world_size) if averaged else 1.0
    host = payload.detach().cpu().contiguous()
    hdr, _ = cpu._read_header(host[:HEADER_FIELDS].double().tolist(), scale)
    total = hdr[HDR_KEYS_LO] + (hdr[HDR_KEYS_MID] << 11) + (hdr[HDR_KEYS_HI] << 22)
    y = torch.full((L.numel,), 7.0)
    pending = _backend.CPU.lhc_decode(cpu._native, host, y, scale, L.world_size, rtol=cpu.rtol)
    c, _ = pending.finish(total)
    out = torch.full((L.numel,), 7.0, device=native.device)   # poisoned: decode writes all of it
    run = _cuda.decode(native, scale, L.world_size, host.to(native.device), out, cpu.rtol)
    _, g = run.finish()
    mode = run.arena.view("ml_state", torch.int64)[7].item() >> 32 if L.index_kind == "multilevel" else 0
    out = out.cpu()
    want = (c.status, c.candidates, c.support_keys, c.false_positives)
    got = (g.status, g.candidates, g.support_keys, g.false_positives)
    assert got == want, f"GPU (status, candidates, support, false positives) {got}, CPU {want}"
    if g.support_keys <= native.key_cap:
        assert g.peeled == c.peeled, (g.peeled, c.peeled)
        assert torch.equal(torch.isnan(out), torch.isnan(y)) and torch.equal(out == 0, y == 0), "supports differ"
    if c.status in (1, 2, 5):   # the index failed: both outputs are all zeros
        assert torch.equal(bits(out), bits(y))
    if c.status == helpers.INEXACT:   # the same keys fail rtol on both
        assert torch.equal(run.inexact_keys(g.support_keys), pending.inexact_keys())
    return c.status, out, run, mode


CONFIGS = [
    pytest.param(dict(numel=5000, n=3, k=200, block=1, index="bitmap"), id="bitmap-b1"),
    pytest.param(dict(numel=5000, n=3, k=200, block=1, index="bloom"), id="bloom-b1"),
    pytest.param(dict(numel=32 * 300 - 7, n=4, k=40 * 32, block=32, index="bitmap"), id="bitmap-b32-partial"),
    pytest.param(dict(numel=32 * 300 - 7, n=4, k=40 * 32, block=32, index="bloom"), id="bloom-b32-partial"),
    pytest.param(dict(numel=1 << 20, n=4, k=70_000, block=1, index="bitmap"), id="bitmap-grouped"),
    pytest.param(dict(numel=1 << 20, n=4, k=70_000, block=1, index="bloom"), id="bloom-grouped"),
    pytest.param(dict(numel=1 << 20, n=4, k=8_000, block=1, index="multilevel"), id="multilevel-b1"),
    pytest.param(dict(numel=32 * 3000 - 7, n=4, k=40 * 32, block=32, index="multilevel"), id="multilevel-b32-partial"),
    pytest.param(dict(numel=1 << 22, n=4, k=300_000, block=1, index="multilevel"), id="multilevel-grouped"),
]


@pytest.mark.parametrize("cfg", CONFIGS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
def test_encode_matches_cpu(backend, cfg, dtype):
    rng = np.random.default_rng(helpers.stable_seed("enc", cfg, str(dtype)))
    cpu, gpu = codecs(cfg["numel"], cfg["n"], cfg["k"], cfg["block"], cfg["index"])
    assert gpu.index_kind == cfg["index"]
    xs = helpers.make_inputs(rng, cfg["numel"], cfg["block"], cfg["n"], cfg["k"] // cfg["block"], "random", "normal",
                             zero_lanes=0.3)
    for x in xs:
        x = x.to(dtype)
        assert_same_payload(cpu.layout, cpu.encode(x), gpu.encode(x.cuda()), x)


@pytest.mark.parametrize("cfg", CONFIGS)
def test_decode_is_lossless_and_agrees_with_cpu(backend, cfg):
    rng = np.random.default_rng(helpers.stable_seed("dec", cfg))
    cpu, gpu = codecs(cfg["numel"], cfg["n"], cfg["k"], cfg["block"], cfg["index"])
    xs = helpers.make_inputs(rng, cfg["numel"], cfg["block"], cfg["n"], cfg["k"] // cfg["block"], "random", "wide")
    summed = helpers.sum_payloads([cpu.encode(x) for x in xs], rng)
    y_gpu, r_gpu = gpu.decode(summed.cuda(), trace=True, error_bounds=True)
    helpers.assert_lossless(gpu.layout, xs, y_gpu.cpu(), r_gpu, strict_support=False)
    y_cpu, r_cpu = cpu.decode(summed, error_bounds=True)
    for field in ("ok", "reason", "contributors", "candidates", "false_positives", "support", "peeled", "total_keys"):
        assert getattr(r_gpu, field) == getattr(r_cpu, field), field
    # The same payload: the same values and bounds, bit for bit (peel_layers' layers are the rounds).
    assert torch.equal(bits(y_gpu), bits(y_cpu))
    assert torch.equal(r_gpu.error_bounds[0], r_cpu.error_bounds[0])
    assert torch.equal(r_gpu.error_bounds[1].view(torch.int64), r_cpu.error_bounds[1].view(torch.int64))


@given(seed=st.integers(0, 2**32 - 1), index=st.sampled_from(["bitmap", "bloom", "multilevel"]),
       block=st.sampled_from([1, 3, 8]),
       pattern=st.sampled_from(helpers.PATTERNS), dist=st.sampled_from(helpers.DISTS),
       averaged=st.booleans())
def test_lossless_on_random_inputs(seed, index, block, pattern, dist, averaged):
    rng = np.random.default_rng(seed)
    n, numel, density = helpers.draw_sizes(rng, max_n=12, max_numel=4000)
    k = max(1, int(density * numel / block))
    try:
        gpu = LosslessCodec(numel, n, k * block, block_size=block, seed=seed % 1000, index=index, device="cuda")
    except ValueError:
        return  # an index kind that cannot be built for this world size (tested elsewhere)
    xs = helpers.make_inputs(rng, numel, block, n, k, pattern, dist)
    payloads = [gpu.encode(x.cuda()) for x in xs]
    summed = helpers.sum_payloads(payloads, rng)
    if averaged:
        summed = helpers.average_payloads(summed, n)
    y, report = gpu.decode(summed, averaged=averaged, trace=True)
    if not helpers.peeled_ok(report):
        # Only a peeling failure is legitimate here (probability < 1e-3 per decode at capacity), and
        # the CPU backend must reach the same verdict on the same payload.
        cpu = LosslessCodec(numel, n, k * block, block_size=block, seed=seed % 1000, index=index)
        _, r_cpu = cpu.decode(summed.cpu(), averaged=averaged)
        assert not r_cpu.ok and "peeling failed" in report.reason, (report.reason, r_cpu.reason)
        return
    helpers.assert_lossless(gpu.layout, xs, y.cpu(), report, averaged=averaged, strict_support=dist == "normal")


@pytest.mark.parametrize("index", ["bitmap", "bloom", "multilevel"])
@pytest.mark.parametrize("block", [1, 16])
def test_decode_is_bitwise_deterministic(backend, index, block):
    rng = np.random.default_rng(helpers.stable_seed("det", index, block))
    numel, n = 200_000, 6
    keys = 6_000 // block   # non-zero keys per rank
    _, gpu = codecs(numel, n, keys * block, block, index)
    xs = helpers.make_inputs(rng, numel, block, n, keys, "random", "wide")
    summed = helpers.sum_payloads([gpu.encode(x.cuda()) for x in xs], rng)
    y0, r0 = gpu.decode(summed, trace=True)
    assert helpers.peeled_ok(r0), r0.reason   # "wide" values: some keys may be INEXACT (listed, not wrong)
    other = LosslessCodec(numel, n, keys * block, block_size=block, seed=0, index=index, device="cuda")
    for codec in (gpu, gpu, gpu, other):
        y, r = codec.decode(summed.clone(), trace=True)
        assert torch.equal(bits(y), bits(y0)), "decode of the same payload gave different bits"
        assert torch.equal(r.trace[0], r0.trace[0]) and torch.equal(r.trace[1], r0.trace[1])


@pytest.mark.parametrize("index", ["bitmap", "multilevel"])
def test_decode_bits_do_not_depend_on_the_peel_s_grid(backend, index, monkeypatch):
    """The cooperative peels' grid (blocks per SM, LHC_PEEL_BLOCKS_PER_SM) changes which block takes which
    cell and how rounds interleave across blocks, which the emulation (blocks one after another, two for a
    cooperative launch) cannot vary: the bits, the status and the peel's trace must not move."""
    rng = np.random.default_rng(helpers.stable_seed("grid", index))
    numel, n, keys = 1 << 21, 4, 60_000
    cpu, gpu = codecs(numel, n, keys, 1, index)
    xs = helpers.make_inputs(rng, numel, 1, n, keys, "random", "wide")
    summed = helpers.sum_payloads([gpu.encode(x.cuda()) for x in xs], rng)
    y_cpu, r_cpu = cpu.decode(summed.cpu())
    for blocks in ("1", "2", "4", "8"):
        monkeypatch.setenv("LHC_PEEL_BLOCKS_PER_SM", blocks)
        y, r = gpu.decode(summed.clone(), trace=True)
        assert r.status == r_cpu.status, (blocks, r.reason, r_cpu.reason)
        assert torch.equal(bits(y.cpu()), bits(y_cpu)), f"{blocks} blocks per SM: other bits than the CPU's"


@pytest.mark.parametrize("numel, k, auto_kind, seed", [(50_000, 1_000, None, 7), (1 << 20, 2_000, "multilevel", 11)])
def test_cpu_and_gpu_ranks_interoperate(numel, k, auto_kind, seed):
    """CPU- and GPU-encoded payloads sum to one aggregate that both backends decode exactly. ``auto``
    plans without regard to the device (``codecs`` asserts equal layouts), multilevel included."""
    rng = np.random.default_rng(seed)
    n = 4
    cpu, gpu = codecs(numel, n, k)
    if auto_kind is not None:
        assert gpu.index_kind == auto_kind
    xs = helpers.make_inputs(rng, numel, 1, n, k, "random", "normal")
    payloads = [cpu.encode(x) if r % 2 else gpu.encode(x.cuda()).cpu() for r, x in enumerate(xs)]
    summed = helpers.sum_payloads(payloads, rng)
    y_cpu, r_cpu = cpu.decode(summed, trace=True)
    y_gpu, r_gpu = gpu.decode(summed.cuda(), trace=True)
    helpers.assert_lossless(cpu.layout, xs, y_cpu, r_cpu)
    helpers.assert_lossless(gpu.layout, xs, y_gpu.cpu(), r_gpu)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
def test_decode_returns_input_dtype_and_shape(dtype):
    _, gpu = codecs(4096, 2, 64)
    x = torch.zeros(64, 64, dtype=dtype, device="cuda")
    x[3, 5], x[60, 1] = 1.5, -2.0
    y, report = gpu.decode(gpu.encode(x) * 2)
    assert report.ok, report.reason
    assert y.shape == x.shape and y.dtype == dtype and y.device == x.device
    assert torch.equal(y, 2 * x)


FAILURES = ["overloaded", "nan", "mismatch", "wrong_world", "averaged_as_sum", "dense_index"]


@pytest.mark.parametrize("case", FAILURES)
@pytest.mark.parametrize("index", ["bitmap", "bloom", "multilevel"])
def test_failure_reports_match_cpu(case, index):
    rng = np.random.default_rng(helpers.stable_seed("fail", case, index))
    numel, n, k = 20_000, 3, 200
    cpu, gpu = codecs(numel, n, k, index=index if case != "dense_index" else "dense")
    xs = helpers.make_inputs(rng, numel, 1, n, k, "random", "normal")
    averaged = False
    if case == "overloaded":
        xs[0] = torch.from_numpy(rng.standard_normal(numel).astype(np.float32))  # far over capacity
    elif case == "nan":
        xs[1][int(np.nonzero(xs[1].numpy())[0][0])] = float("nan")
    payloads = [cpu.encode(x) for x in xs]
    if case == "mismatch":
        other = LosslessCodec(numel, n, k, seed=1, index=index)
        payloads[2] = other.encode(xs[2])
    elif case == "wrong_world":
        payloads = payloads[:2]
    summed = helpers.sum_payloads(payloads, rng)
    if case == "averaged_as_sum":
        summed = helpers.average_payloads(summed, n)
    _, r_cpu = cpu.decode(summed, averaged=averaged)
    y, r_gpu = gpu.decode(summed.cuda(), averaged=averaged)
    assert r_gpu.ok == r_cpu.ok
    if case == "overloaded":
        # The root cause is named first on both; the consequence (which stage failed) may differ.
        assert r_gpu.reason.split(" (")[0] == r_cpu.reason.split(" (")[0]
    else:
        assert r_gpu.reason == r_cpu.reason
    assert (r_gpu.contributors, r_gpu.overloaded_ranks, r_gpu.total_keys) == \
        (r_cpu.contributors, r_cpu.overloaded_ranks, r_cpu.total_keys)
    assert r_gpu.ok == (case == "dense_index")


@pytest.mark.parametrize("index", ["bitmap", "bloom", "multilevel"])
def test_fuzzed_payloads_never_crash(index):
    """Corrupt a valid aggregate in many ways: the GPU decode must finish with the CPU backend's
    verdict (ok or its reason, candidates, support; a value-only corruption may decode ok on both)."""
    rng = np.random.default_rng(helpers.stable_seed("fuzz", index))
    numel, n, k = 30_000, 3, 600
    cpu, gpu = codecs(numel, n, k, index=index)
    L = cpu.layout
    xs = helpers.make_inputs(rng, numel, 1, n, k, "random", "normal")
    base = helpers.sum_payloads([cpu.encode(x) for x in xs], rng)
    specials = np.array([np.nan, np.inf, -np.inf, -0.0, 0.5, 1e30, -1.0, 2.0 ** 22, 3.0], dtype=np.float32)
    for trial in range(60):
        p = base.clone()
        region = rng.integers(0, 4)
        lo, hi = [(0, HEADER_FIELDS), (L.index_offset, L.sketch_offset), (L.sketch_offset, L.payload_numel),
                  (0, L.payload_numel)][region]
        where = rng.integers(lo, hi, size=int(rng.integers(1, 50)))
        how = rng.integers(0, 3)
        if how == 0:
            p[where] = torch.from_numpy(rng.choice(specials, size=where.size))
        elif how == 1:
            p[where] = torch.from_numpy(rng.integers(0, 2 ** 22, size=where.size).astype(np.float32))
        else:
            raw = p.view(torch.int32)
            raw[where] = torch.from_numpy(rng.integers(-2 ** 31, 2 ** 31, size=where.size, dtype=np.int64)
                                          .astype(np.int32))
        _, r_cpu = cpu.decode(p)
        y, r_gpu = gpu.decode(p.cuda())
        torch.cuda.synchronize()
        assert y.shape == (numel,)
        if r_gpu.ok:
            assert r_cpu.ok, f"trial {trial}: GPU says ok, CPU says {r_cpu.reason}"
        # Every index kind's verdict is the CPU's, failures included (the counts a failed index
        # reports too: tests/test_cuda_lhc_guards_emulated.py).
        assert (r_gpu.ok, r_gpu.reason, r_gpu.candidates, r_gpu.support) == \
            (r_cpu.ok, r_cpu.reason, r_cpu.candidates, r_cpu.support), trial


def test_an_index_claiming_every_key_is_reported_without_overflowing_scratch():
    """A consistent bitmap index (and header) claiming every key non-zero: more support keys than
    the sketch has cells, so more than the decode's buffers hold. Reported as a peeling failure by
    both backends; the GPU writes nothing out of bounds (compute-sanitizer runs this test)."""
    numel, n = 100_000, 2
    cpu, gpu = codecs(numel, n, 100, index="bitmap")
    L = gpu.layout
    x = torch.zeros(numel)
    x[:100] = 1.0
    p = cpu.encode(x) * n
    pos = torch.arange(L.index.words * L.index.per_word).reshape(L.index.words, L.index.per_word)
    powers = torch.tensor([float(L.index.base ** i) for i in range(L.index.per_word)], dtype=torch.float64)
    p[L.index_offset:L.sketch_offset] = ((pos < L.num_keys).double() * powers).sum(1).float()
    mask = (1 << 11) - 1
    p[3:6] = torch.tensor([L.num_keys & mask, (L.num_keys >> 11) & mask, L.num_keys >> 22], dtype=torch.float32)
    _, r_cpu = cpu.decode(p)
    y, r_gpu = gpu.decode(p.cuda())
    torch.cuda.synchronize()
    assert not r_gpu.ok and not r_cpu.ok
    assert r_gpu.reason == r_cpu.reason, (r_gpu.reason, r_cpu.reason)
    assert r_gpu.support == L.num_keys or r_gpu.support == gpu._native.key_cap


def test_encode_does_not_synchronise_and_decode_synchronises_once():
    _, gpu = codecs(100_000, 2, 2_000)
    x = torch.zeros(100_000, device="cuda")
    x[::50] = 1.0
    payload = gpu.encode(x)
    summed = payload * 2  # both ranks sent this payload: the world_size=2 aggregate
    gpu.decode(summed)  # warm-up: kernel loading may synchronise
    torch.cuda.synchronize()
    previous = torch.cuda.get_sync_debug_mode()
    try:
        torch.cuda.set_sync_debug_mode("error")
        gpu.encode(x, out=payload)       # raises if any torch op in encode synchronises
        torch.cuda.set_sync_debug_mode("warn")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _, report = gpu.decode(summed)
        syncs = [w for w in caught if "synchroniz" in str(w.message)]
        assert len(syncs) == 1, [str(w.message) for w in syncs]
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    assert report.ok


def test_encode_and_decode_run_on_the_current_stream():
    _, gpu = codecs(100_000, 2, 2_000)
    x = torch.zeros(100_000, device="cuda")
    x[::70] = 3.0
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        payload = gpu.encode(x) * 2
        y, report = gpu.decode(payload)
    s.synchronize()
    assert report.ok and torch.equal(y, 2 * x)


def test_wide_blocks_and_empty_inputs():
    _, gpu = codecs(64 * 500, 2, 64 * 20, block=64)
    x = torch.zeros(64 * 500, device="cuda")
    y, report = gpu.decode(gpu.encode(x) * 2)
    assert report.ok and report.support == 0 and torch.equal(y, x)
    x[64 * 7: 64 * 8] = torch.arange(64, device="cuda", dtype=torch.float32) - 10
    payload = gpu.encode(x) + gpu.encode(-x)
    y, report = gpu.decode(payload)
    # key 7 sums to exactly 0 while its mass channel does not: it is peeled as 0, and INEXACT because no
    # relative bound holds at 0 (the CPU's verdict too)
    assert helpers.peeled_ok(report) and report.support == 1 and report.peeled == 1
    assert bool((y == 0).all())
    _, r_cpu = LosslessCodec(64 * 500, 2, 64 * 20, block_size=64).decode(payload.cpu())
    assert r_cpu.status == report.status


def test_cuda_bench_runs_and_checks_itself():
    from lossless_hc.bench.codec import decode_verdict_ok, render_codec_cuda, run_codec_bench_cuda
    res = run_codec_bench_cuda(1 << 20, 0.01, 4, repeat=3)
    cor = res["correctness"]
    assert decode_verdict_ok(cor) and cor["deterministic"], cor
    assert res["timing"]["encode_over_copy"] > 0 and res["timing"]["decode_over_copy"] > 0
    assert "fraction of copy" in render_codec_cuda(res, "test")


@pytest.mark.parametrize("group,case", [(86953, 2), (36392, 3)])
def test_verify_lists_the_same_keys_as_cpu(backend, group, case):
    """verify=True on the GPU (lhc_verify_values and its ancestry walks, csrc/lhc_ancestry.h): on the
    two fuzz aggregates where a corrupted word reaches a checking cell along two peel paths, and on a
    plain 8-rank ~15,000-key sum (some ancestries above the cap), the same status, inexact keys and
    output bits as the CPU, and deterministic."""
    from test_cuda_verdicts_emulated import verdict_inputs
    from test_fuzz import corrupted_case
    g, cpu, p = corrupted_case(14, group, case)
    _, gpu, _ = corrupted_case(14, group, case, device="cuda")
    rng = np.random.default_rng(helpers.stable_seed("gpu-sound", group))
    plain = LosslessCodec(100_000, 8, 2000, seed=group, index="bitmap", verify=True)
    plain_gpu = LosslessCodec(100_000, 8, 2000, seed=group, index="bitmap", verify=True, device="cuda")
    summed = helpers.sum_payloads([plain.encode(x) for x in verdict_inputs(rng, 100_000, 1, 8, 2000, "normal")], rng)
    for c, d, payload in ((cpu, gpu, p), (plain, plain_gpu, summed)):
        y, r = c.decode(payload)
        outs = [d.decode(payload.cuda()) for _ in range(2)]
        for yg, rg in outs:
            assert rg.status == r.status and torch.equal(rg.inexact_keys.cpu(), r.inexact_keys)
            assert torch.equal(bits(yg), bits(y))
