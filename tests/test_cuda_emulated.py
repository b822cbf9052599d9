"""The CUDA kernels and their launch sequence, run on the host (no GPU needed).

tests/cuda_emulation/ builds csrc/cuda/codec_kernels.cuh with the host compiler against a small
emulation of the CUDA builtins (every CUDA thread a fiber, scheduled in a random order per launch;
barriers, warp exchanges and atomics emulated), behind the launch interface of lossless_hc._C_cuda.
lossless_hc/backends/cuda_lhc.py then runs its real launch sequence on CPU tensors through it. This checks
the kernels' logic, the arguments and sizes of every launch, the ordered compactions, the round-based
peeling and its determinism under varied orders of the threads' atomics and barrier passes, and
agreement with the CPU backend. It cannot check performance, data races or a real GPU's memory model:
tests/test_cuda.py (and compute-sanitizer, scripts/gpu_session.sh) do that on a GPU.
"""
import os
import shutil
import subprocess
import sys
import sysconfig
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import helpers
from lossless_hc import LosslessCodec
from lossless_hc.backends import cuda_lhc as _cuda
from lossless_hc.backends import cuda_runtime
from lossless_hc.lhc.codec import DEFAULT_RTOL
from lossless_hc.lhc import reference
from lossless_hc.lhc.layout import HDR_INDEX_CHECK0, HEADER_FIELDS
from lossless_hc.lhc.status import DecodeStatus, message
from test_cuda import assert_same_payload, bits

HERE = os.path.dirname(os.path.abspath(__file__))
CXX = shutil.which(os.environ.get("CXX", "g++")) or shutil.which("c++")


@pytest.fixture(scope="module")
def emulated(tmp_path_factory):
    """The host-thread launcher, installed for the module's tests."""
    if "_lhc_cuda_emulated" in sys.modules:
        # Built by an earlier test module of this session (from the same sources): a second build
        # could not be imported under the same name anyway.
        module = sys.modules["_lhc_cuda_emulated"]
    else:
        if CXX is None:
            pytest.skip("no C++ compiler: the host emulation of the CUDA kernels was not built")
        import pybind11
        out = tmp_path_factory.mktemp("cuda_emulation")
        target = out / ("_lhc_cuda_emulated" + sysconfig.get_config_var("EXT_SUFFIX"))
        cmd = [CXX, "-std=c++20", "-O1", "-shared", "-fPIC", f"-I{HERE}/cuda_emulation",
               f"-I{os.path.dirname(HERE)}/csrc", f"-I{pybind11.get_include()}",
               f"-I{sysconfig.get_paths()['include']}", os.path.join(HERE, "cuda_emulation", "emulated_kernels.cpp"),
               "-o", str(target), "-lpthread"]
        env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}  # not the sanitizer runtimes
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
        assert res.returncode == 0, res.stderr[-4000:]
        sys.path.insert(0, str(out))
        try:
            import _lhc_cuda_emulated as module
        finally:
            sys.path.remove(str(out))

    class EmulatedLauncher:
        name = "emulated"
        scan_threads = 64   # the one-block scan on fewer threads than on a GPU (SCAN_THREADS)

        def launch(self, kernel, grid, block, args, stream, cooperative=False):
            module.launch(kernel, int(grid), int(block), [int(a) & ((1 << 64) - 1) for a in args], int(stream),
                          cooperative)

        def resident_blocks(self, kernel, block):
            return 1

    cuda_runtime.reset_launcher(EmulatedLauncher())
    yield module
    cuda_runtime.reset_launcher()


def record_arenas(monkeypatch) -> list:
    """The sizes (a dict per arena, in order) every launch sequence asks cuda_runtime.Arena for from now on
    in the test; the arenas are built as asked."""
    asked = []

    class RecordingArena(cuda_runtime.Arena):
        def __init__(self, sizes, device):
            asked.append(dict(sizes))
            super().__init__(sizes, device)

    monkeypatch.setattr(cuda_runtime, "Arena", RecordingArena)
    return asked


def host_codecs(numel, n, k, block=1, index="auto", seed=0, verify=False):
    cpu = LosslessCodec(numel, n, k, block_size=block, seed=seed, index=index, verify=verify)
    return cpu, _cuda.CudaLayout(cpu.layout, torch.device("cpu"))


def emulated_encode(native, x):
    payload = torch.full((native.layout.payload_numel,), 7.0)  # poisoned: encode must overwrite all of it
    _cuda.encode(native, x.reshape(-1).float().contiguous(), payload)
    return payload


def emulated_decode(native, payload, averaged=False, verify=False):
    L = native.layout
    out = torch.full((L.numel,), 7.0)  # poisoned
    scale = float(L.world_size) if averaged else 1.0
    run = _cuda.decode(native, scale, L.world_size, payload.contiguous(), out, DEFAULT_RTOL, verify)
    header, st = run.finish()
    report = SimpleNamespace(ok=st.status == 0, reason=message(st.status) or None, support=st.support_keys,
                             peeled=st.peeled, candidates=st.candidates, false_positives=st.false_positives,
                             status=st.status, trace=run.trace(st.support_keys),
                             inexact_keys=run.inexact_keys(st.support_keys) if st.status == helpers.INEXACT
                             else torch.zeros(0, dtype=torch.int64))
    # As LosslessCodec.decode(error_bounds=True): only where every key was recovered.
    report.error_bounds = run.error_bounds(st.support_keys) if helpers.peeled_ok(report) else None
    return out, report, header


def assert_same_bounds(report, r_cpu, what=None):
    """The emulated kernels' error bounds are the CPU backend's, key for key and bit for bit."""
    (k, e), (k_cpu, e_cpu) = report.error_bounds, r_cpu.error_bounds
    assert torch.equal(k, k_cpu), what
    assert torch.equal(e.view(torch.int64), e_cpu.view(torch.int64)), (what, (e - e_cpu).abs().max().item())


CONFIGS = [
    pytest.param(dict(numel=3000, n=3, k=60, block=1, index="bitmap"), id="bitmap-b1"),
    pytest.param(dict(numel=3000, n=3, k=60, block=1, index="bloom"), id="bloom-b1"),
    pytest.param(dict(numel=8 * 200 - 3, n=4, k=12 * 8, block=8, index="bitmap"), id="bitmap-b8-partial"),
    pytest.param(dict(numel=8 * 200 - 3, n=4, k=12 * 8, block=8, index="bloom"), id="bloom-b8-partial"),
]


def inputs(cfg, tag, dist="normal"):
    rng = np.random.default_rng(helpers.stable_seed(tag, cfg))
    return rng, helpers.make_inputs(rng, cfg["numel"], cfg["block"], cfg["n"], cfg["k"] // cfg["block"], "random",
                                    dist, zero_lanes=0.3)


def test_emulation_varies_the_order_of_atomics_and_reports_a_missed_barrier(emulated):
    """The emulation itself: every thread runs once, in an order that changes from launch to launch (so
    the determinism tests below can fail), and a barrier that some threads never reach raises."""
    orders = set()
    for _ in range(4):
        counter, out = torch.zeros(1, dtype=torch.int32), torch.full((256,), -1, dtype=torch.int32)
        emulated.launch("emu_selftest_atomic_order", 4, 64, [counter.data_ptr(), out.data_ptr()], 0)
        assert int(counter) == 256 and sorted(out.tolist()) == list(range(256))
        orders.add(tuple(out.tolist()))
    assert len(orders) == 4
    out = torch.zeros(64, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="32 of 64 threads wait at a barrier"):
        emulated.launch("emu_selftest_barrier_skipped", 1, 64, [out.data_ptr()], 0)


@pytest.mark.parametrize("cfg", CONFIGS)
def test_emulated_encode_matches_cpu(emulated, cfg):
    _, xs = inputs(cfg, "emu-enc")
    cpu, native = host_codecs(cfg["numel"], cfg["n"], cfg["k"], cfg["block"], cfg["index"])
    assert cpu.index_kind == cfg["index"]
    for x in xs:
        assert_same_payload(cpu.layout, cpu.encode(x), emulated_encode(native, x), x)


@pytest.mark.parametrize("index", ["bitmap", "bloom"])
def test_emulated_encode_scan_dense_sparse_and_unaligned(emulated, index):
    """lhc_encode_scan_b1's grid-stride loop over 4-coordinate groups: with 2^17 + 5 coordinates the
    emulated grid (32 blocks of 256) goes round it four times; a dense first half (90% non-zero, -0.0
    among the zeros) and a sparse second half, and an input that starts one float past a 16-byte
    boundary (the unaligned loads). The payload equals the CPU's."""
    numel = (1 << 17) + 5
    rng = np.random.default_rng(helpers.stable_seed("emu-scan", index))
    half = numel // 2
    dense = rng.standard_normal(numel).astype(np.float32)
    keep = np.concatenate([rng.random(half) < 0.9, rng.random(numel - half) < 0.01])
    dense[~keep] = 0.0
    dense[np.flatnonzero(~keep)[::7]] = -0.0
    x = torch.from_numpy(dense)
    k = int(np.count_nonzero(dense))
    cpu, native = host_codecs(numel, 2, k, 1, index)
    assert cpu.index_kind == index
    assert_same_payload(cpu.layout, cpu.encode(x), emulated_encode(native, x), x)
    storage = torch.zeros(numel + 1)
    storage[1:] = x
    shifted = storage[1:]
    assert shifted.data_ptr() % 16 != 0
    assert_same_payload(cpu.layout, cpu.encode(x), emulated_encode(native, shifted), x)


@pytest.mark.parametrize("block", [1, 3])
def test_emulated_encode_adds_weighted_values(emulated, block):
    """A key alone in its cells leaves w_j * v there, bit for bit: the weights +1, +2, -1, -2 of a
    weighted sketch (lhc_layout.h, reference.key_cells; this small one is weighted), multiplied in
    exactly (lhc_encode_scan_b1 for blocks of 1, lhc_encode_scatter_blocks above)."""
    cpu, native = host_codecs(3000 * block, 2, 60 * block, block, "bitmap")
    L = cpu.layout
    assert L.sketch.weighted, "a sketch this small is weighted (sizing.sketch_table_for): pick a smaller one"
    cells, weights = reference.key_cells(L.sketch, torch.arange(L.num_keys))
    chosen, used = [], set()
    for k in range(L.num_keys):   # keys whose cells no other chosen key touches
        if len(chosen) == 24:
            break
        if not used & set(cells[k].tolist()):
            chosen.append(k)
            used |= set(cells[k].tolist())
    assert set(weights[chosen].reshape(-1).tolist()) == {1, 2, -1, -2}
    x = torch.zeros(L.numel)
    rng = np.random.default_rng(helpers.stable_seed("emu-weights", block))
    for k in chosen:   # odd mantissas, and magnitudes near the top and bottom of float32
        x[k * block:(k + 1) * block] = torch.from_numpy(
            (rng.choice([-1.0, 1.0], block) * rng.choice([1.0 + 2.0 ** -23, 3.0e38 / 2, 1.5e-38, 0.1], block))
            .astype(np.float32))
    sketch = emulated_encode(native, x)[L.sketch_offset:L.mass_offset].reshape(-1, block)
    for k in chosen:
        for j in range(3):
            want = x[k * block:(k + 1) * block] * float(weights[k, j])
            assert torch.equal(bits(sketch[cells[k, j]]), bits(want)), (k, j, int(weights[k, j]))
    assert_same_payload(L, cpu.encode(x), emulated_encode(native, x), x)


@pytest.mark.parametrize("cfg", CONFIGS)
@pytest.mark.parametrize("averaged", [False, True])
def test_emulated_decode_is_lossless_and_agrees_with_cpu(emulated, cfg, averaged):
    rng, xs = inputs(cfg, "emu-dec", "wide")
    cpu, native = host_codecs(cfg["numel"], cfg["n"], cfg["k"], cfg["block"], cfg["index"])
    summed = helpers.sum_payloads([cpu.encode(x) for x in xs], rng)
    if averaged:
        summed = helpers.average_payloads(summed, cfg["n"])
    y, report, header = emulated_decode(native, summed, averaged)
    assert header == summed[:HEADER_FIELDS].double().tolist()
    helpers.assert_lossless(cpu.layout, xs, y, report, averaged=averaged, strict_support=False)
    _, r_cpu = cpu.decode(summed, averaged=averaged)
    assert (report.ok, report.support, report.peeled, report.candidates, report.false_positives) == \
        (r_cpu.ok, r_cpu.support, r_cpu.peeled, r_cpu.candidates, r_cpu.false_positives)


def test_emulated_bloom_decode_without_false_positives_reports_none(emulated):
    """A Bloom decode whose candidates are exactly the support reports 0 false positives, as the CPU
    (the count is candidates - support, never a floor above 0)."""
    numel, n = 3000, 2
    cpu, native = host_codecs(numel, n, 60, index="bloom")
    x = torch.zeros(numel)
    x[[17, 1234]] = torch.tensor([0.5, -3.0])
    summed = cpu.encode(x) * n
    y, report, _ = emulated_decode(native, summed)
    _, r_cpu = cpu.decode(summed)
    assert r_cpu.ok and (r_cpu.candidates, r_cpu.support, r_cpu.false_positives) == (2, 2, 0)
    assert (report.ok, report.candidates, report.support, report.false_positives) == (True, 2, 2, 0)
    assert torch.equal(y, x * n)


@pytest.mark.parametrize("index", ["bitmap", "bloom"])
def test_emulated_codec_decode_through_the_cuda_backend(emulated, index):
    """LosslessCodec.decode through the CUDA backend interface (CudaBackend.lhc_decode, PendingDecode)
    returns what the CPU backend's does: output bits, status, counts, inexact keys, trace and error
    bounds."""
    from lossless_hc.backends.cuda import CUDA
    cfg = dict(numel=3000, n=3, k=60, block=1, index=index)
    rng, xs = inputs(cfg, "emu-backend", "wide")
    cpu, native = host_codecs(cfg["numel"], cfg["n"], cfg["k"], 1, index)
    gpu, _ = host_codecs(cfg["numel"], cfg["n"], cfg["k"], 1, index)
    gpu._backend, gpu._native = CUDA, native
    summed = helpers.sum_payloads([cpu.encode(x) for x in xs], rng)
    y_cpu, r_cpu = cpu.decode(summed, trace=True, error_bounds=True)
    y, r = gpu.decode(summed, trace=True, error_bounds=True)
    # The wide values leave some keys above rtol: an INEXACT decode, with its inexact keys listed.
    assert r.status == r_cpu.status == helpers.INEXACT and r.reason == r_cpu.reason
    assert torch.equal(r.inexact_keys, r_cpu.inexact_keys) and r.inexact_keys.numel() > 0
    assert torch.equal(bits(y), bits(y_cpu))
    for field in ("candidates", "false_positives", "support", "peeled", "total_keys"):
        assert getattr(r, field) == getattr(r_cpu, field), field
    assert r.trace is not None and torch.equal(r.trace[0].sort().values, r_cpu.trace[0].sort().values)
    assert_same_bounds(r, r_cpu)


@pytest.mark.parametrize("index", ["bitmap", "bloom"])
def test_emulated_decode_is_bitwise_deterministic(emulated, index):
    """The emulated threads interleave differently on every run, and the one-block scan runs on the
    emulation's 64 threads and on the GPU's SCAN_THREADS: the output bits must not change."""
    cfg = dict(numel=4000, n=5, k=120, block=1, index=index)
    rng, xs = inputs(cfg, "emu-det", "wide")
    cpu, native = host_codecs(cfg["numel"], cfg["n"], cfg["k"], 1, index)
    summed = helpers.sum_payloads([cpu.encode(x) for x in xs], rng)
    y0, r0, _ = emulated_decode(native, summed)
    assert helpers.peeled_ok(r0), r0.reason
    launcher = cuda_runtime.launcher()
    for scan_threads in (launcher.scan_threads, _cuda.SCAN_THREADS):
        launcher.scan_threads = scan_threads
        try:
            y, r, _ = emulated_decode(native, summed)
        finally:
            del launcher.scan_threads  # the fixture's again
        assert torch.equal(bits(y), bits(y0))
        assert r.status == r0.status and torch.equal(r.inexact_keys, r0.inexact_keys)
        assert torch.equal(r.trace[0], r0.trace[0]) and torch.equal(r.trace[1], r0.trace[1])


@pytest.mark.parametrize("index", ["bitmap", "bloom"])
def test_emulated_corrupted_payloads_are_never_ok_when_cpu_rejects_them(emulated, index):
    cfg = dict(numel=2000, n=3, k=40, block=1, index=index)
    rng, xs = inputs(cfg, "emu-fuzz")
    cpu, native = host_codecs(cfg["numel"], cfg["n"], cfg["k"], 1, index)
    L = cpu.layout
    base = helpers.sum_payloads([cpu.encode(x) for x in xs], rng)
    rejected = 0
    for trial in range(6):
        p = base.clone()
        lo, hi = (L.index_offset, L.sketch_offset) if trial % 2 else (L.sketch_offset, L.payload_numel)
        where = rng.integers(lo, hi, size=int(rng.integers(1, 6)))
        p[where] = torch.from_numpy(rng.choice(np.array([np.nan, -1.0, 0.5, 3.0, 1e30, 2.0 ** 21],
                                                        dtype=np.float32), size=where.size))
        _, r_cpu = cpu.decode(p)
        y, r, _ = emulated_decode(native, p)
        if r.ok:
            assert r_cpu.ok, f"trial {trial}: emulated GPU decode ok, CPU: {r_cpu.reason}"
        else:
            rejected += 1
            assert not torch.equal(y, torch.full_like(y, 7.0)), "out was never written"
    assert rejected > 0


def test_emulated_index_claiming_every_key_is_reported(emulated):
    numel, n = 3000, 2
    cpu, native = host_codecs(numel, n, 20, index="bitmap")
    L = cpu.layout
    x = torch.zeros(numel)
    x[:20] = 1.0
    p = cpu.encode(x) * n
    pos = torch.arange(L.index.words * L.index.per_word).reshape(L.index.words, L.index.per_word)
    powers = torch.tensor([float(L.index.base ** i) for i in range(L.index.per_word)], dtype=torch.float64)
    p[L.index_offset:L.sketch_offset] = ((pos < L.num_keys).double() * powers).sum(1).float()
    mask = (1 << 11) - 1
    p[3:6] = torch.tensor([L.num_keys & mask, (L.num_keys >> 11) & mask, L.num_keys >> 22], dtype=torch.float32)
    # The index checksum still says 20 keys: the forged support is index corruption on both.
    _, r_cpu = cpu.decode(p)
    _, r, _ = emulated_decode(native, p)
    assert r.status == r_cpu.status == DecodeStatus.INDEX_CORRUPT, (r.reason, r_cpu.reason)
    # With the checksum forged too, the index is consistent: too many keys to peel (on the GPU, more
    # than the value peel's list holds).
    p[HDR_INDEX_CHECK0:HDR_INDEX_CHECK0 + 2] = torch.tensor(reference.index_check(L, torch.arange(L.num_keys)),
                                                              dtype=torch.float32)
    _, r_cpu = cpu.decode(p)
    _, r, _ = emulated_decode(native, p)
    assert not r.ok and not r_cpu.ok
    assert r.status == 3 and "sketch peeling failed" in r_cpu.reason


@pytest.mark.parametrize("non_finite", [False, True])
def test_emulated_support_beyond_the_peel_s_list_reports_as_the_cpu(emulated, non_finite):
    """A bitmap's aggregate support larger than the value peel's list (ranks over capacity: ~800 keys for
    40 each; Bloom and multilevel indexes fail first there): the CUDA decode skips the cell loads and
    the peel. It reported the list's cap as the support (201 of 747 keys) and, with a NaN/Inf cell,
    SKETCH_PEEL_FAILED where the CPU, which loads every cell, says SKETCH_OVERFLOW (a capacity status
    against a non-finite one; only the multilevel index checked). Now the status and the support
    count are the CPU's."""
    numel, n = 4000, 2
    cpu, native = host_codecs(numel, n, 40, index="bitmap")
    rng = torch.Generator().manual_seed(5)
    xs = [torch.randn(numel, generator=rng) * (torch.rand(numel, generator=rng) < 0.1) for _ in range(n)]
    p = sum(cpu.encode(x) for x in xs)
    if non_finite:
        p[cpu.layout.sketch_offset + 3] = float("inf")
    _, r_cpu = cpu.decode(p)
    _, r, _ = emulated_decode(native, p)
    assert r.support > native.key_cap, (r.support, native.key_cap)
    assert (r.status, r.support) == (r_cpu.status, r_cpu.support), (r.reason, r.support, r_cpu.reason, r_cpu.support)
    assert r.status == (DecodeStatus.SKETCH_OVERFLOW if non_finite else DecodeStatus.SKETCH_PEEL_FAILED), r.reason


@pytest.mark.parametrize("block", [1, 3])
@pytest.mark.parametrize("index", ["bitmap", "bloom"])
def test_emulated_pairs_agree_with_cpu(emulated, block, index):
    """Two-key stopping sets (tests/test_pairs.py): lhc_solve_pairs solves the solvable ones exactly
    and leaves proportional ones unresolved, as the CPU backend does."""
    from lossless_hc.lhc.sizing import build_layout
    from test_pairs import colliding_pairs, pair_inputs

    n = 3
    # The seed's own streams, which hold proportional pairs (the planner would take others).
    L = build_layout(index, 2000 * block, n, 8 * block, block, 11)
    cpu, native = helpers.codec_for(L), _cuda.CudaLayout(L, torch.device("cpu"))
    solvable, proportional = colliding_pairs(cpu.layout)
    rng = np.random.default_rng(helpers.stable_seed("emu-pair", block, index))
    for pair, expect_ok in ((solvable[0], True), (proportional[0], False)):
        xs = pair_inputs(rng, cpu.layout, pair, n, others=3)
        summed = helpers.sum_payloads([cpu.encode(x) for x in xs], rng)
        y, report, _ = emulated_decode(native, summed)
        y_cpu, r_cpu = cpu.decode(summed, error_bounds=True)
        assert (report.status, report.peeled, report.support) == (r_cpu.status, r_cpu.peeled, r_cpu.support)
        assert torch.equal(report.inexact_keys, r_cpu.inexact_keys)
        assert helpers.peeled_ok(report) == expect_ok
        if expect_ok:
            assert_same_bounds(report, r_cpu)
            helpers.assert_lossless(cpu.layout, xs, y, report, strict_support=False)
            # the solved pair comes last in the trace (round kPairRound, after every peeling round)
            assert sorted(report.trace[0][-2:].tolist()) == sorted(pair)
        else:
            assert torch.equal(torch.isnan(y), torch.isnan(y_cpu))


def test_emulated_pair_values_match_cpu_bitwise(emulated):
    """lhc_solve_pairs evaluates lhc::pair_cells' formula as the CPU backend does (exact products, one
    subtraction, one division in double): with nothing else in the pair's cells (pair_inputs keeps the
    other keys out), both read the same residuals, so the pair's outputs agree bit for bit, for every
    |det| among the layout's colliding pairs (1, 2, 3, 4, 5, 6 and 8 here: divisions exact or not)."""
    from test_pairs import colliding_pairs, pair_inputs

    n = 2
    cpu, native = host_codecs(4000, n, 8, 1, "bitmap", seed=11)
    L = cpu.layout
    solvable, _ = colliding_pairs(L)
    _, weights = reference.key_cells(L.sketch, torch.arange(L.num_keys))
    by_det = {}
    for a, b in solvable:
        by_det.setdefault(abs(reference.pair_cells(weights[a].tolist(), weights[b].tolist())[2]), (a, b))
    assert by_det, "the layout has no solvable colliding pair: pick another seed"
    rng = np.random.default_rng(helpers.stable_seed("emu-pair-bits"))
    assert len(by_det) >= 3, sorted(by_det)
    for det, pair in sorted(by_det.items()):
        xs = pair_inputs(rng, L, pair, n, others=2)
        summed = helpers.sum_payloads([cpu.encode(x) for x in xs], rng)
        y, report, _ = emulated_decode(native, summed)
        y_cpu, r_cpu = cpu.decode(summed, error_bounds=True)
        assert helpers.peeled_ok(report) and helpers.peeled_ok(r_cpu), (det, report.reason, r_cpu.reason)
        assert torch.equal(report.inexact_keys, r_cpu.inexact_keys)
        assert_same_bounds(report, r_cpu, det)
        keys = torch.tensor(pair)
        assert torch.equal(bits(y[keys]), bits(y_cpu[keys])), (det, pair, y[keys].tolist(), y_cpu[keys].tolist())
