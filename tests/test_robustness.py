"""Failure is never silent: overload, configuration mismatches, corrupted or fuzzed payloads and bad
inputs give ``report.ok == False`` (with a reason) or a clear exception -- never a crash, a hang or
a wrong answer reported as exact. The corrupted and fuzzed payloads: tests/test_robustness_fuzzed_payloads.py."""
import numpy as np
import pytest
import torch

import helpers
from lossless_hc import LosslessCodec, THCCodec, plan_layout
from lossless_hc.lhc.status import DecodeStatus

INDEXES = ["bitmap", "bloom", "multilevel", "dense"]


def summed_case(index, n=4, numel=800, k=25, block=1, seed=0, data_seed=0):
    rng = np.random.default_rng(data_seed)
    codec = LosslessCodec(numel, n, k * block, block_size=block, seed=seed, index=index)
    xs = helpers.make_inputs(rng, numel, block, n, k, "random", "normal")
    summed = helpers.sum_payloads([codec.encode(x) for x in xs], rng)
    return codec, xs, summed


# One summed payload per index: the wrong-shape tests below and the corrupted ones of
# tests/test_robustness_fuzzed_payloads.py decode them.
CODECS = {index: summed_case(index, n=3, numel=500, k=20, data_seed=7) for index in INDEXES}


# -- overload ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("index", ["bitmap", "bloom", "multilevel"])
@pytest.mark.parametrize("block", [1, 4])
def test_one_key_over_capacity_is_reported(index, block):
    n, numel, cap = 3, 1200, 20
    codec = LosslessCodec(numel, n, cap * block, block_size=block, index=index)
    rng = np.random.default_rng(helpers.stable_seed(index, block))
    xs = helpers.make_inputs(rng, numel, block, n, cap, "random", "normal")
    xs[1] = helpers.make_inputs(rng, numel, block, 1, cap + 1, "random", "normal")[0]
    y, rep = codec.decode(helpers.sum_payloads([codec.encode(x) for x in xs], rng))
    assert not rep.ok
    assert rep.overloaded_ranks == 1
    assert "overload" in rep.reason, rep.reason


@pytest.mark.parametrize("index", ["bitmap", "bloom", "multilevel"])
def test_heavy_overload_reason_names_overload(index):
    codec = LosslessCodec(1000, 2, 10, index=index)
    x = torch.zeros(1000)
    x[:200] = 1.0
    y, rep = codec.decode(codec.encode(x) * 2)
    assert not rep.ok and rep.overloaded_ranks == 2
    assert "overload" in rep.reason, rep.reason


@pytest.mark.parametrize("index", ["bitmap", "bloom", "multilevel"])
def test_over_capacity_is_never_ok(index):
    """Hundreds of random cases with per-rank key counts around and far above capacity: an overloaded
    payload is never reported ok, and an ok report is always exact."""
    rng = np.random.default_rng(helpers.stable_seed("overload", index))
    seen_ok = seen_over = 0
    for trial in range(150):
        n = int(rng.integers(1, 9))
        block = int(rng.choice([1, 1, 3]))
        numel = int(rng.integers(100, 2000))
        num_keys = -(-numel // block)
        cap = int(rng.integers(1, max(2, num_keys // (2 * n))))
        codec = LosslessCodec(numel, n, cap * block, block_size=block, seed=trial, index=index)
        counts = [int(rng.integers(max(0, cap - 3), cap + 1)) for _ in range(n)]
        over = int(rng.integers(0, n + 1))                  # ranks pushed over capacity
        for w in range(over):
            counts[w] = min(num_keys, cap + int(rng.choice([1, 2, cap, 10 * cap])))
        pattern = str(rng.choice(helpers.PATTERNS))
        xs = [helpers.make_inputs(rng, numel, block, 1, c, pattern, "normal")[0] for c in counts]
        n_over = sum(len(helpers.nonzero_keys(x, block)) > codec.layout.capacity for x in xs)
        y, rep = codec.decode(helpers.sum_payloads([codec.encode(x) for x in xs], rng), trace=True)
        assert rep.overloaded_ranks == n_over
        if n_over:
            seen_over += 1
            assert not rep.ok, f"trial {trial}: {n_over} overloaded ranks but ok"
        if helpers.peeled_ok(rep):   # ok, or INEXACT: exact outside its listed keys
            seen_ok += 1
            helpers.assert_lossless(codec.layout, xs, y, rep)
    assert seen_ok > 20 and seen_over > 20  # both branches really exercised


# -- configuration mismatch -------------------------------------------------------------------------

def _variants(name):
    """Candidate (base, other) configurations differing in ``name``, first match wins. Pairs differing
    in ``name`` alone come first, so they win wherever one has the same payload length (world_size:
    bitmap, bloom and dense at numel 64, multilevel at 48; block_size: bitmap at numel 40, dense
    anywhere). Only then pairs that also differ in max_nnz/world_size (bloom and multilevel have no
    same-length pair differing in block_size alone); the test checks separately that ``name`` alone
    changes the fingerprint."""
    base = dict(numel=60, world_size=4, max_nnz=20, block_size=1, seed=0)
    if name == "seed":
        for s in (1, 2, 12345):
            yield base, {**base, "seed": s}
    elif name == "max_nnz":
        for m in range(1, 200):
            yield base, {**base, "max_nnz": m}
    elif name == "world_size":
        for numel in (64, 48):   # world_size alone: at 64 for bitmap, bloom and dense, at 48 for multilevel
            b0 = {**base, "numel": numel}
            for w in (3, 5, 2, 6, 7, 8, 1):
                yield b0, {**b0, "world_size": w}
        for numel in (64, 60):
            b0 = {**base, "numel": numel}
            for w in (3, 5, 2, 6, 7, 8, 1):   # never the base's 4: that pair would differ in max_nnz alone
                for m in range(1, 80):
                    yield b0, {**b0, "world_size": w, "max_nnz": m}
    elif name == "block_size":
        for numel in (200, 40):   # block_size alone: dense at 200, bitmap at 40
            b0 = {**base, "numel": numel}
            for b in range(2, 5):
                yield b0, {**b0, "block_size": b}
        for numel in (200, 60, 64):   # 200 first: it has a same-length pair for every index
            b0 = {**base, "numel": numel}
            for b in range(2, 5):
                for w in (4, 3, 1, 2, 5, 6, 7, 8):
                    for m in range(1, 80):
                        yield b0, {**b0, "block_size": b, "world_size": w, "max_nnz": m}


def same_length_pair(index, name):
    length = {}   # the bases recur: each planned once

    def payload_numel(kw):
        key = tuple(sorted(kw.items()))
        if key not in length:
            length[key] = plan_layout(**kw).payload_numel
        return length[key]

    for a, b in _variants(name):
        a, b = {**a, "index": index}, {**b, "index": index}
        if a != b and payload_numel(a) == payload_numel(b):
            return a, b
    pytest.fail(f"no {name} variant gives the same payload length")  # never silently vacuous


@pytest.mark.parametrize("index", INDEXES)
@pytest.mark.parametrize("name", ["seed", "max_nnz", "world_size", "block_size"])
def test_config_mismatch_same_length_is_detected(index, name):
    # small tensors: the union saturates at num_keys, so many configurations share a payload length
    a_kw, b_kw = same_length_pair(index, name)
    a, b = LosslessCodec(**a_kw), LosslessCodec(**b_kw)
    assert a.payload_numel == b.payload_numel and a.layout.fingerprint != b.layout.fingerprint
    # The pair may also differ in max_nnz/world_size (where no same-length pair differs in `name` alone):
    # `name` alone, set back to a's value with everything else b's, must change the fingerprint too.
    only = {**b_kw, name: a_kw[name]}
    assert plan_layout(**only).fingerprint != b.layout.fingerprint, f"{name} does not join the fingerprint"
    n, numel = a.world_size, a.numel
    rng = np.random.default_rng(0)
    xs = helpers.make_inputs(rng, numel, 1, n, 5, "random", "normal")
    for odd in range(n):      # rank `odd` built the codec differently
        payloads = [(b if w == odd else a).encode(x) for w, x in enumerate(xs)]
        y, rep = a.decode(helpers.sum_payloads(payloads, rng))
        assert not rep.ok
        assert "mismatch" in rep.reason, rep.reason
    # every rank on the other configuration, decoded with this one
    y, rep = a.decode(helpers.sum_payloads([b.encode(x) for x in xs], rng))
    assert not rep.ok, rep


@pytest.mark.parametrize("index", INDEXES)
def test_missing_or_extra_contributions_are_detected(index):
    codec, xs, summed = summed_case(index)
    one = codec.encode(xs[0])
    for payload in (summed - one, summed + one, one):
        y, rep = codec.decode(payload)
        assert not rep.ok and "contributions" in rep.reason, rep.reason


# -- aggregate overflow ---------------------------------------------------------------------------

def test_aggregate_overflow_is_not_silent():
    """Two ranks each send 3e38 at one key: the float32 aggregate overflows to Inf there (as a dense
    float32 allreduce would). Keys whose true sum is finite must not come out NaN/Inf with ok=True."""
    bad = []
    for seed in range(60):
        rng = np.random.default_rng(seed)
        numel, k = 400, 60
        codec = LosslessCodec(numel, 2, k, seed=seed, index="bitmap")
        x = helpers.make_inputs(rng, numel, 1, 1, k, "random", "normal")[0]
        x[helpers.nonzero_keys(x, 1)[0]] = 3e38
        y, rep = codec.decode(codec.encode(x) * 2)
        dense = x * 2                                   # float32 dense sum: Inf at the huge key only
        if rep.ok and not bool(((y == dense) | ((y - dense).abs() <= 1e-5 * dense.abs().clamp(min=1))).all()):
            bad.append(seed)
        if not rep.ok:
            assert "overflow" in rep.reason, rep.reason
    assert not bad, f"ok=True with non-finite/wrong outputs for seeds {bad}"


def test_dense_aggregate_overflow_counts_its_values():
    """The dense layout: two ranks' finite 3e38 and -3e38 sum to +-Inf in float32; the decode is
    SKETCH_OVERFLOW counting the two overflowed values (no rank's input was non-finite), output NaN."""
    codec = LosslessCodec(100, 2, 100, index="dense")
    x = torch.zeros(100)
    x[[3, 5, 7]] = torch.tensor([3e38, -3e38, 1.0])
    y, rep = codec.decode(codec.encode(x) * 2)
    assert rep.status == DecodeStatus.SKETCH_OVERFLOW, rep.reason
    assert rep.reason.endswith("(2 dense value(s))") and bool(torch.isnan(y).all())


# -- wrong payload shape / dtype ------------------------------------------------------------------

@pytest.mark.parametrize("index", INDEXES)
def test_wrong_payload_length_dtype_or_shape_raise(index):
    codec, xs, summed = CODECS[index]
    P = summed.numel()
    for bad in (summed[:-1], torch.cat([summed, summed[:1]]), torch.zeros(0), summed.reshape(1, P)):
        with pytest.raises(ValueError, match="payload"):
            codec.decode(bad)
    for dt in (torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64):
        with pytest.raises(TypeError, match="float32"):
            codec.decode(summed.to(dt))
    with pytest.raises(TypeError, match="payload must be a torch.Tensor"):
        codec.decode(summed.numpy())
    # non-contiguous but right length: accepted
    wide = torch.stack([summed, summed], dim=1)[:, 0]
    assert not wide.is_contiguous()
    assert codec.decode(wide)[1].ok


# -- bad inputs to encode ---------------------------------------------------------------------------

@pytest.mark.parametrize("index", INDEXES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_inputs(index, dtype):
    rng = np.random.default_rng(0)
    n, numel, k = 4, 300, 15
    codec = LosslessCodec(numel, n, k, index=index)
    xs = [x.to(dtype) for x in helpers.make_inputs(rng, numel, 1, n, k, "random", "normal")]
    summed = helpers.sum_payloads([codec.encode(x) for x in xs], rng)
    y, rep = codec.decode(summed, trace=True)
    assert rep.ok and y.dtype == dtype and y.shape == (numel,)
    xs32 = [x.float() for x in xs]                         # half -> float32 is exact
    y32, _ = codec.decode(summed, dtype=torch.float32, trace=True)
    helpers.assert_lossless(codec.layout, xs32, y32, rep)
    assert torch.equal(y, y32.to(dtype))


def test_float16_sum_beyond_its_range_rounds_to_inf_as_the_dense_sum_does():
    # The contract holds for the float32 sum; the rounding back to float16 then overflows exactly as
    # torch's cast (and an fp16 allreduce) does, while the float32 decode keeps the finite sum.
    codec = LosslessCodec(100, 2, 4)
    xs = [torch.zeros(100, dtype=torch.float16) for _ in range(2)]
    xs[0][[3, 7]] = torch.tensor([40000.0, -1.5], dtype=torch.float16)
    xs[1][[3, 9]] = torch.tensor([40000.0, -40000.0], dtype=torch.float16)
    summed = codec.encode(xs[0]) + codec.encode(xs[1])
    y, rep = codec.decode(summed)
    y32, rep32 = codec.decode(summed, dtype=torch.float32)
    assert rep.ok and rep32.ok and y.dtype == torch.float16
    assert y32[3].item() == 80000.0 and torch.isinf(y[3]) and y[3] > 0
    assert torch.equal(y, (xs[0].float() + xs[1].float()).half())


@pytest.mark.parametrize("dtype", [torch.float64, torch.int32, torch.int64, torch.int8, torch.bool,
                                   torch.complex64])
def test_rejected_input_dtypes(dtype):
    codec = LosslessCodec(10, 2, 3)
    with pytest.raises(TypeError, match="dtype"):
        codec.encode(torch.zeros(10, dtype=dtype))


def test_non_tensor_and_wrong_size_inputs():
    codec = LosslessCodec(10, 2, 3)
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        codec.encode([0.0] * 10)
    with pytest.raises(ValueError, match="numel"):
        codec.encode(torch.zeros(11))


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
@pytest.mark.parametrize("layout", ["coo", "csr", "csc", "bsr"])
@pytest.mark.parametrize("codec_type", ["lossless", "thc"])
def test_sparse_inputs_are_refused_naming_their_layout(layout, codec_type):
    # Every sparse layout, not only COO (x.is_sparse): a CSR tensor reached reshape and failed there.
    codec = LosslessCodec(64, 2, 8) if codec_type == "lossless" else THCCodec(64, 2, 0)
    x = torch.zeros(8, 8)
    x[1, 2] = 1.0
    sparse = {"coo": x.to_sparse, "csr": x.to_sparse_csr, "csc": x.to_sparse_csc,
              "bsr": lambda: x.to_sparse_bsr((2, 2))}[layout]()
    with pytest.raises(TypeError, match=rf"x is a sparse tensor \(torch\.sparse_{layout}\); pass it dense"):
        codec.encode(sparse)


@pytest.mark.parametrize("index", ["dense", "bitmap", "multilevel"])
def test_an_out_overlapping_the_input_is_refused(index):
    # The kernels read x (the payload) while they write out: a payload buffer whose first elements held
    # x encoded to a wrong payload without a word.
    numel = 4096
    codec = LosslessCodec(numel, 2, numel // 3, index=index)
    P = codec.payload_numel
    x = torch.zeros(numel)
    x[::5] = 1.0
    for offset in (0, P - numel):
        buf = torch.zeros(P)
        buf[offset:offset + numel] = x
        with pytest.raises(ValueError, match="out and x overlap in memory"):
            codec.encode(buf[offset:offset + numel], out=buf)
        summed = codec.encode(x) + codec.encode(x)
        with pytest.raises(ValueError, match="out and payload overlap in memory"):
            codec.decode(summed, out=summed[offset:offset + numel])
    y, report = codec.decode(codec.encode(x) + codec.encode(x), out=torch.empty(numel))
    assert report.ok and torch.equal(y, 2 * x)


def test_decode_refuses_a_shape_of_other_size_before_decoding():
    codec = LosslessCodec(1000, 2, 20)
    x = torch.zeros(1000)
    x[3] = 1.0
    summed = codec.encode(x) * 2
    # also shapes whose product is numel without being one: negative sizes, two -1s, a bool size
    for shape in [(3,), (10, 10), ("a",), (-10, -100), (-1, -1, 1000), (True, 1000)]:
        with pytest.raises(ValueError, match=r"decode\(shape=.*\): not a shape of numel=1000 elements"):
            codec.decode(summed, shape=shape)
    for shape, expected in [((10, 100), (10, 100)), ((-1, 10), (100, 10)), (1000, (1000,))]:
        y, report = codec.decode(summed, shape=shape)
        assert report.ok and y.shape == expected and torch.equal(y.reshape(-1), 2 * x)


def test_thc_out_overlapping_the_input_is_refused():
    numel = 4096
    x = torch.randn(numel)
    codec = THCCodec(numel, 2, 0)
    # One float32 storage: the payload (float64) in its first 2 P elements, x from 10 before their end.
    words = 2 * codec.payload_numel
    storage = torch.zeros(words + numel)
    with pytest.raises(ValueError, match="out and x overlap in memory"):
        codec.encode(storage[words - 10:words - 10 + numel].copy_(x), out=storage[:words].view(torch.float64))
    payloads = [THCCodec(numel, 2, r).encode(x) for r in range(2)]
    codec.encode(x)
    storage[:words].view(torch.float64).copy_(payloads[0] + payloads[1])
    with pytest.raises(ValueError, match="out and payload overlap in memory"):
        codec.decode(storage[:words].view(torch.float64), out=storage[words - 10:words - 10 + numel])
    # Refused before any state changed: the step's decode still comes, into a separate out.
    y = codec.decode(payloads[0] + payloads[1], out=torch.empty(numel))
    assert codec.step == 1 and torch.isfinite(y).all()


@pytest.mark.parametrize("index", INDEXES)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_input_is_reported(index, bad):
    rng = np.random.default_rng(0)
    codec = LosslessCodec(200, 3, 10, index=index)
    xs = helpers.make_inputs(rng, 200, 1, 3, 10, "random", "normal")
    xs[2][17] = bad
    y, rep = codec.decode(helpers.sum_payloads([codec.encode(x) for x in xs], rng))
    assert not rep.ok and "non-finite" in rep.reason, rep.reason


@pytest.mark.parametrize("index", INDEXES)
@pytest.mark.parametrize("block", [1, 5])
def test_non_contiguous_and_multidimensional_inputs(index, block):
    rng = np.random.default_rng(1)
    n, rows, cols = 3, 20, 15
    codec = LosslessCodec(rows * cols, n, 8 * block, block_size=block, index=index)
    base = helpers.make_inputs(rng, rows * cols, block, n, 8, "random", "normal")
    xs = [b.reshape(rows, cols).t().contiguous().t() for b in base]   # same values, column-major storage
    assert not xs[0].is_contiguous()
    summed = helpers.sum_payloads([codec.encode(x) for x in xs], rng)
    y, rep = codec.decode(summed, trace=True)
    assert helpers.peeled_ok(rep) and y.shape == (rows, cols)
    flat = [x.reshape(-1) for x in xs]                      # the codec's coordinate order: x.reshape(-1)
    helpers.assert_lossless(codec.layout, flat, y.reshape(-1), rep)
    # and a 3-D one
    codec3 = LosslessCodec(2 * 3 * 50, 2, 20, block_size=block, index=index)
    x3 = torch.zeros(2, 3, 50)
    x3[1, 2, 7] = 3.0
    x3[0, 0, 0] = -1.0
    y3, rep3 = codec3.decode(codec3.encode(x3) + codec3.encode(x3))
    # With blocks of 5 the key of x3[0, 0, 0] also holds exact zeros: the per-key mass bounds them by
    # the block's largest magnitude, so that key is INEXACT (listed), its values still exact.
    assert helpers.peeled_ok(rep3) and y3.shape == (2, 3, 50) and torch.equal(y3, 2 * x3)
    assert rep3.ok == (block == 1 or index == "dense")


@pytest.mark.parametrize("index", ["auto", "bitmap", "bloom", "dense"])
def test_empty_and_single_element(index):
    codec = LosslessCodec(0, 4, 0, index=index)
    p = codec.encode(torch.zeros(0))
    y, rep = codec.decode(p * 4)
    assert rep.ok and y.shape == (0,)
    codec = LosslessCodec(1, 4, 1, index=index)
    xs = [torch.tensor([v]) for v in (1.5, 0.0, -0.25, 2.0)]
    y, rep = codec.decode(sum(codec.encode(x) for x in xs))
    assert rep.ok and y.item() == 3.25
    y, rep = codec.decode(sum(codec.encode(torch.zeros(1)) for _ in range(4)))
    assert rep.ok and y.item() == 0.0


@pytest.mark.parametrize("index", INDEXES)
def test_max_nnz_above_numel_and_fully_dense_input(index):
    rng = np.random.default_rng(2)
    codec = LosslessCodec(50, 3, 10_000, index=index)
    assert codec.layout.capacity == 50
    xs = [torch.from_numpy(helpers.values(rng, "normal", 50)) for _ in range(3)]
    y, rep = codec.decode(helpers.sum_payloads([codec.encode(x) for x in xs], rng), trace=True)
    helpers.assert_lossless(codec.layout, xs, y, rep)


def test_world_size_1024_round_trip():
    rng = np.random.default_rng(3)
    n, numel = 1024, 4096
    codec = LosslessCodec(numel, n, 2, index="bitmap")
    xs = helpers.make_inputs(rng, numel, 1, n, 2, "random", "normal")
    summed = helpers.sum_payloads([codec.encode(x) for x in xs], rng, "stack")
    y, rep = codec.decode(summed, trace=True)
    helpers.assert_lossless(codec.layout, xs, y, rep)
    y, rep = codec.decode(helpers.average_payloads(summed, n), averaged=True, trace=True)
    helpers.assert_lossless(codec.layout, xs, y, rep, averaged=True)


def test_decode_into_a_reused_buffer():
    """decode(out=buf) overwrites every element of buf (stale values must not leak into zeros) and
    returns the same values as a fresh decode; a wrong buffer is rejected clearly."""
    codec = LosslessCodec(5000, 2, 50)
    g = torch.Generator().manual_seed(3)
    xs = []
    for _ in range(2):
        x = torch.zeros(5000)
        x[torch.randperm(5000, generator=g)[:50]] = torch.randn(50, generator=g)
        xs.append(x)
    summed = codec.encode(xs[0]) + codec.encode(xs[1])
    fresh, rep = codec.decode(summed)
    buf = torch.full((5000,), 7.0)
    y, rep2 = codec.decode(summed, out=buf)
    assert rep.ok and rep2.ok
    assert torch.equal(y, fresh) and y.data_ptr() == buf.data_ptr()
    for bad in (torch.zeros(4999), torch.zeros(5000, dtype=torch.float64), torch.zeros(10000)[::2]):
        with pytest.raises(ValueError, match="out must be"):
            codec.decode(summed, out=bad)


# 400k: every thread writes several chunks of index words; 1.1M with every third key non-zero: a
# sketch of several groups, each zeroed just before its keys are added
@pytest.mark.parametrize("numel,stride", [(5000, 97), (400_000, 97), (1_100_000, 3)])
@pytest.mark.parametrize("index", INDEXES)
def test_encode_into_a_reused_buffer(index, numel, stride):
    """encode(x, out=buf) overwrites all of buf (stale values must not leak into the payload) and
    equals a fresh encode; a wrong buffer is rejected clearly."""
    codec = LosslessCodec(numel, 2, numel // stride + 1, index=index)
    if stride == 3:
        assert codec.layout.sketch.seg_count > 3
    x = torch.zeros(numel)
    x[::stride] = 1.5
    buf = torch.full((codec.payload_numel,), 3.0)
    payload = codec.encode(x, out=buf)
    assert payload.data_ptr() == buf.data_ptr()
    assert torch.equal(payload, codec.encode(x))
    with pytest.raises(ValueError, match="out must be"):
        codec.encode(x, out=torch.zeros(codec.payload_numel + 1))
