"""Bitwise determinism: every rank must decode the same aggregate to the same bits (replicas must not
drift), whatever the run, the codec instance or the number of threads."""
import numpy as np
import pytest
import torch

import helpers
from lossless_hc import LosslessCodec
from lossless_hc.lhc import reference as reference
from lossless_hc.lhc.codec import key_coordinates


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.contiguous().view(torch.int32),
                                                                    b.contiguous().view(torch.int32))


def reports_equal(a, b) -> bool:
    """Equal fields; the trace, the inexact keys and the error bounds (bit for bit) included."""
    fa, fb = dict(a.__dict__), dict(b.__dict__)
    ta, tb = fa.pop("trace"), fb.pop("trace")
    if not torch.equal(fa.pop("inexact_keys"), fb.pop("inexact_keys")):
        return False
    ea, eb = fa.pop("error_bounds"), fb.pop("error_bounds")
    if (ea is None) != (eb is None):
        return False
    if ea is not None and not (torch.equal(ea[0], eb[0]) and
                               torch.equal(ea[1].view(torch.int64), eb[1].view(torch.int64))):
        return False
    if fa != fb:
        return False
    if ta is None or tb is None:
        return ta is tb
    return all(torch.equal(x, y) for x, y in zip(ta, tb))


# Sizes chosen so the multi-threaded code paths really run: the parallel sketch scatter starts at
# keys * block > 65536, and decode splits index words and candidate keys across threads.
BIG = [
    pytest.param(dict(numel=300_000, block=1, k=70_000, n=2, index="bitmap"), id="bitmap-b1-70k"),
    pytest.param(dict(numel=300_000, block=1, k=70_000, n=2, index="bloom"), id="bloom-b1-70k"),
    pytest.param(dict(numel=32 * 6000, block=32, k=2_200, n=3, index="bitmap"), id="bitmap-b32"),
    pytest.param(dict(numel=32 * 6000 - 5, block=32, k=2_200, n=3, index="bloom"), id="bloom-b32-partial"),
    # union > 2 * GROUP_KEYS: a grouped value sketch, scattered and peeled group-parallel
    pytest.param(dict(numel=1 << 20, block=1, k=70_000, n=4, index="bitmap"), id="bitmap-grouped"),
    pytest.param(dict(numel=1 << 20, block=1, k=70_000, n=4, index="bloom"), id="bloom-grouped"),
]


@pytest.mark.parametrize("cfg", BIG)
def test_thread_count_does_not_change_bits(cfg):
    rng = np.random.default_rng(helpers.stable_seed(cfg))
    numel, block, k, n, index = cfg["numel"], cfg["block"], cfg["k"], cfg["n"], cfg["index"]
    xs = helpers.make_inputs(rng, numel, block, n, k, "random", "wide")
    codecs = {t: LosslessCodec(numel, n, k * block, block_size=block, seed=9, index=index, num_threads=t)
              for t in (1, 2, 0)}
    assert all(c.index_kind == index for c in codecs.values())
    payloads = {t: [c.encode(x) for x in xs] for t, c in codecs.items()}
    for t in (2, 0):
        for p1, pt in zip(payloads[1], payloads[t]):
            assert same_bits(p1, pt), f"encode with num_threads={t} differs from num_threads=1"
    # and bit-identical to the reference (the parallel scatter keeps increasing key order per cell)
    assert same_bits(payloads[1][0], reference.encode(codecs[1].layout, xs[0]))
    summed = helpers.sum_payloads(payloads[1], rng)
    outs = {t: c.decode(summed, trace=True, error_bounds=True) for t, c in codecs.items()}
    assert helpers.peeled_ok(outs[1][1]), outs[1][1].reason
    for t in (2, 0):
        assert same_bits(outs[1][0], outs[t][0]), f"decode with num_threads={t} differs"
        assert reports_equal(outs[1][1], outs[t][1])


@pytest.mark.parametrize("index", ["bitmap", "bloom", "dense"])
@pytest.mark.parametrize("block", [1, 3])
def test_repeated_decode_and_fresh_instances_are_bitwise_identical(index, block):
    rng = np.random.default_rng(helpers.stable_seed(index, block))
    n, numel, k = 6, 3000, 60
    codec = LosslessCodec(numel, n, k * block, block_size=block, seed=4, index=index)
    xs = helpers.make_inputs(rng, numel, block, n, k, "clustered", "wide")
    summed = helpers.sum_payloads([codec.encode(x) for x in xs], rng)
    y1, r1 = codec.decode(summed, trace=True)
    y2, r2 = codec.decode(summed, trace=True)
    assert helpers.peeled_ok(r1), r1.reason
    assert same_bits(y1, y2) and reports_equal(r1, r2)
    # another "rank": a codec built independently from the same arguments
    other = LosslessCodec(numel, n, k * block, block_size=block, seed=4, index=index)
    for x in xs:
        assert same_bits(codec.encode(x), other.encode(x))
    y3, r3 = other.decode(summed, trace=True)
    assert same_bits(y1, y3) and reports_equal(r1, r3)
    # decoding must not modify the payload
    before = summed.clone()
    codec.decode(summed)
    assert same_bits(before, summed)


def test_fewer_threads_than_requested_still_encode_everything(tmp_path):
    """OpenMP may grant fewer threads than a codec asks for (OMP_THREAD_LIMIT, nested regions). Work
    must be split over the threads actually running: the payload and the decode must not change."""
    import os
    import subprocess
    import sys
    script = tmp_path / "limited.py"
    script.write_text(
        "import torch, lossless_hc as lhc\n"
        "g = torch.Generator().manual_seed(0)\n"
        "x = torch.zeros(300_000); i = torch.randperm(300_000, generator=g)[:3000]\n"
        "x[i] = torch.randn(3000, generator=g)\n"
        "c = lhc.LosslessCodec(numel=300_000, world_size=1, max_nnz=3000, num_threads=4)\n"
        "p = c.encode(x); y, r = c.decode(p)\n"
        "torch.save({'p': p, 'y': y, 'status': int(r.status)}, %r)\n" % str(tmp_path / "out.pt"))
    # The child imports the package this process imported (scripts/sanitize.sh runs a scratch copy
    # that is not on the default path), not whatever `import lossless_hc` finds from tmp_path.
    import lossless_hc
    here = os.path.dirname(os.path.dirname(os.path.abspath(lossless_hc.__file__)))
    env = dict(os.environ, OMP_THREAD_LIMIT="1",
               PYTHONPATH=os.pathsep.join([here] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    subprocess.run([sys.executable, str(script)], check=True, env=env, timeout=300)
    got = torch.load(tmp_path / "out.pt")
    g = torch.Generator().manual_seed(0)
    x = torch.zeros(300_000)
    i = torch.randperm(300_000, generator=g)[:3000]
    x[i] = torch.randn(3000, generator=g)
    c = LosslessCodec(numel=300_000, world_size=1, max_nnz=3000, num_threads=4)
    payload = c.encode(x)
    y, report = c.decode(payload)
    assert got["status"] == int(report.status) and helpers.peeled_ok(report)
    assert torch.equal(got["p"], payload)
    assert torch.equal(got["y"], y)
    assert torch.equal(y != 0, x != 0)


def test_a_corrupted_index_reports_the_same_on_every_thread_count():
    """An index word that is not an integer stops each thread at its own first bad block: the keys
    listed until then depended on the thread count, and report.candidates with them. A corrupt index
    reports none."""
    g = torch.Generator().manual_seed(0)
    numel, n = 2_000_000, 4
    codec = LosslessCodec(numel, n, 20_000, index="bitmap", num_threads=1)
    xs = []
    for _ in range(n):
        x = torch.zeros(numel)
        x[torch.randint(0, numel, (20_000,), generator=g)] = 1.0
        xs.append(x)
    summed = sum(codec.encode(x) for x in xs)
    summed[codec.layout.index_offset + 5] += 0.5
    seen = set()
    for threads in (1, 2, 3):
        codec.num_threads = threads
        _, report = codec.decode(summed)
        seen.add((report.status.name, report.candidates, report.support, report.peeled))
    assert seen == {("INDEX_CORRUPT", 0, 0, 0)}, seen


# The value peel's AVX-512 step (csrc/cpu/peel_batch.cpp) resolves eight keys of a layer at once and
# must give the scalar step's bits: outputs, statuses, inexact keys, error bounds. Small tables make batches whose
# keys share a cell (declined, resolved key by key) common; a corrupted sketch gives NaN values and
# keys failing rtol inside batches.
ISA_CASES = [
    pytest.param(dict(numel=300_000, k=70_000, n=2, verify=False, corrupt=0), id="70k"),
    pytest.param(dict(numel=1 << 20, k=70_000, n=4, verify=False, corrupt=0), id="grouped"),
    pytest.param(dict(numel=1 << 20, k=70_000, n=4, verify=True, corrupt=0), id="grouped-verify"),
    pytest.param(dict(numel=6000, k=900, n=3, verify=False, corrupt=0), id="small"),
    pytest.param(dict(numel=6000, k=900, n=3, verify=True, corrupt=0), id="small-verify"),
    pytest.param(dict(numel=300_000, k=70_000, n=2, verify=False, corrupt=40), id="corrupted"),
    pytest.param(dict(numel=300_000, k=70_000, n=2, verify=True, corrupt=40), id="corrupted-verify"),
]


def _scan_input(numel: int, pattern: str, rng) -> torch.Tensor:
    """Inputs for the encoder's non-zero scan: signed zeros (zero), subnormals (non-zero), whole
    non-zero chunks of 64 and a tail past the last whole chunk; `pattern` adds an Inf or a NaN."""
    x = torch.zeros(numel)
    at = torch.from_numpy(rng.choice(numel, numel // 50, replace=False))
    x[at] = torch.from_numpy(rng.standard_normal(at.numel())).float()
    x[64 * 7: 64 * 9] = torch.from_numpy(rng.standard_normal(128)).float()  # two whole chunks
    x[numel - 5:] = torch.tensor([1.5, 0.0, -2.0, 0.0, 3.0])  # the tail
    neg_zero = torch.from_numpy(rng.choice(numel, numel // 50, replace=False))
    x[neg_zero[x[neg_zero] == 0]] = -0.0
    x.view(torch.int32)[numel // 3] = 1            # the smallest subnormal
    x.view(torch.int32)[numel // 3 + 1] = -(1 << 31) + 1  # and its negative
    if pattern == "inf":
        x[numel // 2] = float("inf")
    elif pattern == "nan":
        x[numel - 1] = float("nan")
    return x


@pytest.mark.parametrize("pattern", ["finite", "inf", "nan"])
@pytest.mark.parametrize("numel,block", [(1000, 1), (300_001, 1), (300_001, 5)])
def test_encoder_scan_is_the_same_at_every_cpu_level(numel, block, pattern):
    """The block-1 encoder finds non-zero keys with AVX-512 where the CPU has it, otherwise with SSE2:
    the same payload bits (keys, values, the non-finite flag) at every level and thread count; blocks
    of 5 (one scan at every level, a partial last block) find Inf/NaN among their values too."""
    from lossless_hc.backends import cpu
    rng = np.random.default_rng(helpers.stable_seed((numel, block, pattern)))
    x = _scan_input(numel, pattern, rng)
    max_nnz = numel // 20 + 200 if block == 1 else numel // 4
    codec = LosslessCodec(numel, 1, max_nnz, block_size=block, seed=3, index="bitmap")
    payloads = {}
    try:
        for isa in cpu.thc_cpu_isas():
            cpu.thc_cpu_isa(isa)
            for threads in (1, 2, 3):  # 3: thread ranges that end inside a chunk of 64
                codec.num_threads = threads
                payloads[isa, threads] = codec.encode(x)
    finally:
        cpu.thc_cpu_isa("default")
    first = next(iter(payloads.values()))
    for key, payload in payloads.items():
        assert same_bits(payload, first), f"{key} encodes other bits"
    if pattern == "finite":  # the payload carries every non-zero block (and no signed zero)
        y, report = codec.decode(first)
        assert report.ok or report.status.name == "INEXACT", report.reason
        proven = torch.ones(numel, dtype=torch.bool)  # a subnormal beside 1.0 in a cell is INEXACT
        proven[key_coordinates(report.inexact_keys, block, numel)[0]] = False
        assert torch.equal((y != 0)[proven], (x != 0)[proven])
    else:
        _, report = codec.decode(first)
        assert report.status.name == "NON_FINITE_INPUT", report.reason


@pytest.mark.parametrize("cfg", ISA_CASES)
def test_avx512_value_peel_matches_the_scalar_step(cfg):
    from lossless_hc.backends import cpu
    isas = cpu.thc_cpu_isas()
    if "x86-64-v4" not in isas:
        pytest.skip("the value peel's AVX-512 step needs a CPU with AVX-512 (this one runs " + ", ".join(isas) + ")")
    rng = np.random.default_rng(helpers.stable_seed(cfg))
    numel, k, n = cfg["numel"], cfg["k"], cfg["n"]
    codec = LosslessCodec(numel, n, k, block_size=1, seed=5, index="bitmap", verify=cfg["verify"])
    xs = helpers.make_inputs(rng, numel, 1, n, k, "random", "wide")
    summed = helpers.sum_payloads([codec.encode(x) for x in xs], rng)
    if cfg["corrupt"]:
        L = codec.layout
        at = L.sketch_offset + torch.from_numpy(rng.choice(L.sketch.cells, cfg["corrupt"], replace=False))
        summed[at[:10]] = float("nan")
        summed[at[10:]] *= torch.from_numpy(rng.uniform(0.5, 2.0, cfg["corrupt"] - 10)).float()
    outs = {}
    try:
        # The step is off by default on AMD's CPUs (cpu.lhc_peel_batch): "on" runs it on any CPU with AVX-512.
        for isa, batch in (("x86-64-v4", "on"), ("x86-64-v4", "off"), ("x86-64-v3", "on"), ("portable", "on")):
            cpu.thc_cpu_isa(isa)
            assert cpu.lhc_peel_batch(batch) == (batch == "on")
            outs[isa, batch] = codec.decode(summed, error_bounds=True)
    finally:
        cpu.thc_cpu_isa("default")
        cpu.lhc_peel_batch("default")
    y, report = outs["x86-64-v4", "on"]
    if not cfg["corrupt"]:
        assert helpers.peeled_ok(report), report.reason
    else:
        assert not report.ok
    for key in (("x86-64-v4", "off"), ("x86-64-v3", "on"), ("portable", "on")):
        assert same_bits(y, outs[key][0]), f"{key} decodes other bits than the AVX-512 step"
        assert reports_equal(report, outs[key][1])


# World sizes whose bitmap words hold 22, 13, 11, 9, 8, 7, 6, 5, 4 and 3 digits (base n + 1): the
# AVX-512 key listing's 16-slot chunks cross words at every offset; 45_001 keys end in a part-filled
# block of 64 words.
@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 6, 8, 15, 31, 63])
def test_bitmap_index_lists_the_same_keys_at_every_cpu_level(n):
    """The bitmap index's keys are listed with AVX-512 where the CPU has it, otherwise word run by word
    run: the same support (every key some rank holds, counted as often as ranks hold it) and the same
    decode, bit for bit, at every level and thread count."""
    from lossless_hc.backends import cpu
    rng = np.random.default_rng(helpers.stable_seed(("bitmap-listing", n)))
    numel, k = 45_001, 4_000
    codec = LosslessCodec(numel, n, k, block_size=1, seed=7, index="bitmap")
    xs = helpers.make_inputs(rng, numel, 1, n, k, "random", "wide")
    summed = helpers.sum_payloads([codec.encode(x) for x in xs], rng)
    union = int(torch.count_nonzero(torch.stack(xs).ne(0).any(0)))
    outs = {}
    try:
        for isa in cpu.thc_cpu_isas():
            cpu.thc_cpu_isa(isa)
            for threads in (1, 3):
                codec.num_threads = threads
                outs[isa, threads] = codec.decode(summed, error_bounds=True)
    finally:
        cpu.thc_cpu_isa("default")
    (y, report), *rest = outs.values()
    assert report.support == union and report.candidates == union
    assert report.ok or report.status.name == "INEXACT", report.reason
    for key, (y_other, report_other) in zip(list(outs)[1:], rest):
        assert same_bits(y, y_other), f"{key} decodes other bits"
        assert reports_equal(report, report_other), key


def test_peel_batch_setting_is_checked_and_restored():
    """lhc_peel_batch: 'on' and 'off' stick until 'default', which gives back the CPU's own default;
    any other request is a ValueError that changes nothing."""
    from lossless_hc.backends import cpu
    default = cpu.lhc_peel_batch()
    try:
        assert cpu.lhc_peel_batch("on") is True and cpu.lhc_peel_batch() is True
        with pytest.raises(ValueError, match="'on', 'off' or 'default'"):
            cpu.lhc_peel_batch("yes")
        assert cpu.lhc_peel_batch() is True
        assert cpu.lhc_peel_batch("off") is False and cpu.lhc_peel_batch() is False
    finally:
        assert cpu.lhc_peel_batch("default") == default


PEEL_BATCH_AT_START_UP = ("from lossless_hc.backends import cpu; a = cpu.lhc_peel_batch(); "
                          "cpu.lhc_peel_batch('off' if a else 'on'); print(a, cpu.lhc_peel_batch('default'))")


@pytest.fixture(scope="module")
def own_peel_batch():
    """The CPU's own default as a fresh process sees it (LHC_PEEL_BATCH empty: the same, silently)."""
    own = helpers.run_python(PEEL_BATCH_AT_START_UP, LHC_PEEL_BATCH="").stdout.strip()
    assert own in ("True True", "False False")
    return own


@pytest.mark.parametrize("env", ["on", "off", "maybe", ""])
def test_peel_batch_default_comes_from_the_environment(env, own_peel_batch):
    """LHC_PEEL_BATCH sets lhc_peel_batch's default at start-up ("on", "off"), which "default" gives back
    after a request; any other value is said on stderr and the CPU's own default stands (unset: the same)."""
    proc = helpers.run_python(PEEL_BATCH_AT_START_UP, LHC_PEEL_BATCH=env)
    assert proc.returncode == 0, proc.stderr
    want = {"on": "True True", "off": "False False"}.get(env, own_peel_batch)
    assert proc.stdout.strip() == want
    assert ("LHC_PEEL_BATCH=maybe is neither on nor off; ignored" in proc.stderr) == (env == "maybe")


@pytest.mark.parametrize("block", [1, 3])
def test_output_stage_writes_exactly_its_range_at_any_thread_count(block):
    """The decode's output stage merges the groups' sorted runs a chunk at a time, each thread its own
    range of keys: every thread count (ranges that end inside a chunk; with block 3, a last key shorter
    than its block) gives the same bits, into a fresh tensor or into an ``out`` view that starts 4 bytes
    into its storage, and nothing outside the view is written."""
    rng = np.random.default_rng(helpers.stable_seed(("output stage", block)))
    numel, n = 200_003, 3  # not a multiple of the block: the last key is short
    k = 9_000 * block
    codec = LosslessCodec(numel, n, k, block_size=block, seed=11, index="bitmap")
    xs = helpers.make_inputs(rng, numel, block, n, k // block, "random", "wide")
    summed = helpers.sum_payloads([codec.encode(x) for x in xs], rng)
    outs = {}
    for threads in (1, 2, 3):
        codec.num_threads = threads
        outs["fresh", threads] = codec.decode(summed)
        storage = torch.full((numel + 2,), float("nan"))
        view = storage[1:numel + 1]
        y, report = codec.decode(summed, out=view)
        assert y.data_ptr() == view.data_ptr() and torch.isnan(storage[[0, numel + 1]]).all()
        outs["view", threads] = (view.clone(), report)
    y, report = outs["fresh", 1]
    assert report.ok or report.status.name == "INEXACT", report.reason
    dense = torch.stack(xs).double().sum(0)
    proven = torch.ones(numel, dtype=torch.bool)
    proven[key_coordinates(report.inexact_keys, block, numel)[0]] = False
    assert torch.count_nonzero(y) > 0 and torch.equal((y != 0)[proven], (dense != 0)[proven])
    for key, (other, other_report) in outs.items():
        assert same_bits(y, other), f"{key} decodes other bits"
        assert reports_equal(report, other_report)


def test_decodes_in_between_and_on_other_threads_change_no_bit():
    """The CPU decoder keeps its working memory per thread from one decode to the next (docs/DESIGN.md, "The
    CPU decoder keeps its working memory"): a decode must not depend on what its thread decoded before, nor on
    decodes running at the same time on other threads (the bindings release the GIL). Three aggregates of
    other layouts (a grouped bitmap sketch of 2^20 coordinates, a smaller multilevel one, a Bloom one with
    3-wide rows), decoded in turn, in another order (the large one after the small ones, so into memory a
    smaller decode last sized) and on two Python threads at once: the same bits and reports every time, and
    lossless against the float64 sum."""
    import threading
    cases = []
    for numel, block, k, n, index in ((1 << 20, 1, 70_000, 4, "bitmap"), (300_000, 1, 20_000, 3, "multilevel"),
                                      (3 * 20_000, 3, 1_500, 3, "bloom")):
        rng = np.random.default_rng(helpers.stable_seed("kept memory", index))
        codec = LosslessCodec(numel, n, k * block, block_size=block, seed=7, index=index)
        assert codec.index_kind == index
        xs = helpers.make_inputs(rng, numel, block, n, k, "random", "wide")
        cases.append((codec, xs, helpers.sum_payloads([codec.encode(x) for x in xs], rng)))
    first = [c.decode(summed, trace=True, error_bounds=True) for c, _, summed in cases]
    for (codec, xs, _), (y, report) in zip(cases, first):
        assert helpers.peeled_ok(report), report.reason
        helpers.assert_lossless(codec.layout, xs, y, report)

    def same(i, got) -> bool:
        return same_bits(first[i][0], got[0]) and reports_equal(first[i][1], got[1])

    for i in (2, 1, 0, 0, 2, 1):
        assert same(i, cases[i][0].decode(cases[i][2], trace=True, error_bounds=True)), i
    results, errors = {}, []

    def decode_in_turn(name, order):
        try:
            results[name] = [(i, cases[i][0].decode(cases[i][2], trace=True, error_bounds=True)) for i in order]
        except Exception as e:   # re-raised below, on the test's thread
            errors.append(e)

    threads = [threading.Thread(target=decode_in_turn, args=(name, order))
               for name, order in (("a", (0, 1, 0, 2)), ("b", (2, 0, 1, 0)))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert all(same(i, got) for name in "ab" for i, got in results[name])


def _resident_mib() -> float:
    import os
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2 ** 20


@pytest.mark.parametrize("index, k, measured", [("bitmap", 250_000, True), ("multilevel", 4_000, False)])
def test_release_decoder_memory_hands_the_kept_memory_back_and_changes_no_bit(index, k, measured):
    """``backends.cpu.release_decoder_memory`` frees what the decoder kept for the next decode (its support
    buckets, key values and peeling tables, and the multilevel index's levels: tens of MiB for the bitmap
    index at 2^24 coordinates on 8 ranks, where the resident memory is measured), and the decode after it
    allocates afresh with the same bits and report. The resident-memory check is skipped under the
    sanitizers, whose allocator keeps freed memory."""
    import os
    from lossless_hc.backends import cpu
    numel, n = 1 << 24, 8
    rng = np.random.default_rng(helpers.stable_seed("release decoder memory", index))
    codec = LosslessCodec(numel, n, k, seed=3, index=index)
    assert codec.index_kind == index
    xs = helpers.make_inputs(rng, numel, 1, n, k, "random", "wide")
    summed = helpers.sum_payloads([codec.encode(x) for x in xs], rng)
    out = torch.zeros(numel)  # its pages touched before the first measurement
    cpu.release_decoder_memory()  # whatever earlier tests in this process kept
    before = _resident_mib()
    y, report = codec.decode(summed, out=out)
    kept = _resident_mib()
    assert helpers.peeled_ok(report), report.reason
    cpu.release_decoder_memory()
    released = _resident_mib()
    if measured and not os.environ.get("LHC_EXPECT_SANITIZED"):
        assert kept - before > 16, (before, kept)
        assert kept - released > 0.75 * (kept - before), (before, kept, released)
    y2, report2 = codec.decode(summed)
    assert same_bits(y.clone(), y2) and reports_equal(report, report2)
    cpu.release_decoder_memory()
    cpu.release_decoder_memory()  # with nothing kept: nothing to do
