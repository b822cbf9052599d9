"""The multilevel index's CUDA kernels (csrc/cuda/codec_kernels.cuh, "multilevel index") and their
launch sequence (lossless_hc/_cuda.py), run on host threads through tests/cuda_emulation (the fixture
of tests/test_cuda_emulated.py): no GPU needed.

What must hold, against the CPU backend on the same payload:
* encode: header, coarse and fine words bit for bit (sketch cells within float rounding, as for the
  other indexes: their atomic adds are summed in a different order);
* decode: the CPU's DecodeStats exactly -- status (with its precedence), candidates, support, peeled
  -- for every payload, valid or not, SUM or AVERAGE; the same zero and NaN pattern in the output
  (all zeros when the index fails), and the exact aggregate within the rigorous error bound when ok;
* bitwise determinism across runs (emulated threads interleave differently every time).

The value peel after the index is the one of the other indexes; its values come from a round-based
order instead of the CPU's queue, so they agree within rounding, not bit for bit (tests/test_cuda.py
says the same for bitmap and Bloom). One known difference shared with them: when the support holds
more keys than the value sketch has cells, the value peel is skipped (status 3, or 4 for a NaN/Inf
cell, as the CPU) and reports 0 peeled keys where the CPU reports the few it peeled before stalling.
"""
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import helpers
from lossless_hc import _cuda
from lossless_hc.layout import HDR_KEYS_LO, INT_FIELD_LIMIT, build_layout
from test_cuda import (ML_STALLS, assert_same_payload, bits, corrupt_fine_words, index_verdicts_agree,
                       stalled_table_corruptions)
from test_cuda_emulated import emulated  # noqa: F401  (the module-scoped fixture: builds and installs the emulation)
from test_multilevel import codec_for


def setup(numel, n, k, block, shape, pattern="random", union=None, seed=3, data_seed=0):
    """A multilevel layout of the given shape, the CPU codec and the emulated CUDA layout, and the
    ranks' inputs (k non-zero keys each) and CPU payloads."""
    L = build_layout("multilevel", numel, n, max(1, k) * block, block, seed, union, shape)
    assert L is not None and len(L.multilevel.levels) == len(shape)
    cpu = codec_for(L)
    rng = np.random.default_rng(data_seed)
    xs = helpers.make_inputs(rng, numel, block, n, k, pattern, "normal")
    payloads = [cpu.encode(x) for x in xs]
    return SimpleNamespace(L=L, cpu=cpu, native=_cuda.CudaLayout(L, torch.device("cpu")), xs=xs, payloads=payloads,
                           rng=rng)


def gpu_stats(case, payload, averaged=False):
    """The emulated CUDA decode: its DecodeStats, output, run (trace, scratch) and MlState mode."""
    L = case.L
    out = torch.full((L.numel,), 7.0)   # poisoned: decode must write all of it
    run = _cuda.decode(case.native, float(L.world_size) if averaged else 1.0, L.world_size, payload.contiguous(), out)
    _, st = run.finish()
    mode = run.arena.view("ml_state", torch.int64)[7].item() >> 32
    return st, out, run, mode


def agree(case, payload, averaged=False):
    """Both backends' raw verdicts on ``payload`` must be the same (tests/test_cuda.py
    index_verdicts_agree). Returns (status, GPU output, GPU run, mode of the last level decoded)."""
    return index_verdicts_agree(case.cpu, case.native, payload, averaged)


# lhc::gpu::MlMode of the last fine level decoded, as index_verdicts_agree returns it.
MODE_LIST, MODE_TOO_MANY, MODE_REPLAYED = 0, 1, 2


def report_of(st, run):
    return SimpleNamespace(ok=st.status == 0, reason=f"status {st.status}", support=st.support_keys,
                           peeled=st.peeled, trace=run.trace(st.support_keys))


def test_emulation_holds_every_codec_kernel(emulated):
    assert set(_cuda.header_kernels(_cuda.KERNEL_HEADERS[0])) <= set(emulated.kernel_names())


CONFIGS = [
    pytest.param(dict(numel=3000, n=2, k=40, block=1, shape=(1,), pattern="random"), id="1level-n2"),
    pytest.param(dict(numel=6000, n=5, k=30, block=1, shape=(2, 1), pattern="clustered"), id="2levels-n5-clustered"),
    pytest.param(dict(numel=9000, n=1, k=50, block=1, shape=(1, 1, 3), pattern="random"), id="3levels-n1-wpg3"),
    pytest.param(dict(numel=20000, n=2, k=30, block=1, shape=(1, 1, 1, 2), pattern="random"), id="4levels-wpg2"),
    pytest.param(dict(numel=8 * 400 - 3, n=2, k=20, block=8, shape=(1, 4), pattern="random"), id="block8-partial"),
    pytest.param(dict(numel=2500, n=5, k=0, block=3, shape=(2,), pattern="random"), id="empty-block3"),
]


@pytest.mark.parametrize("cfg", CONFIGS)
def test_encode_and_decode_agree_with_cpu(emulated, cfg):
    case = setup(**cfg)
    for x, p in list(zip(case.xs, case.payloads))[:2]:
        payload = torch.full((case.L.payload_numel,), 7.0)   # poisoned: encode must overwrite all of it
        _cuda.encode(case.native, x.reshape(-1).contiguous(), payload)
        assert_same_payload(case.L, p, payload, x)
        fo = case.L.fine_offset
        assert torch.equal(bits(payload[:case.L.sketch_offset]), bits(p[:case.L.sketch_offset])), \
            f"fine words differ at {(bits(payload[fo:case.L.sketch_offset]) != bits(p[fo:case.L.sketch_offset])).nonzero()[:8].tolist()}"
    summed = helpers.sum_payloads(case.payloads, case.rng)
    for averaged in (False, True):
        payload = helpers.average_payloads(summed, cfg["n"]) if averaged else summed
        status, out, run, _ = agree(case, payload, averaged)
        assert status == 0
        _, st = run.finish()
        helpers.assert_lossless(case.L, case.xs, out, report_of(st, run), averaged=averaged)


STALLS = ML_STALLS   # aggregates over capacity whose fine peel stalls (tests/test_cuda.py)


@pytest.mark.parametrize("name", list(STALLS))
def test_overloaded_aggregate_that_stalls_the_fine_peel(emulated, name):
    case = setup(**STALLS[name])
    status, _, _, mode = agree(case, helpers.sum_payloads(case.payloads, case.rng))
    assert status == 2
    # Honest tables never meet an inconsistency, so a stall needs no replay to be called "peel failed";
    # a level with more nodes than cells is peeled by node id.
    assert mode == (MODE_LIST if name == "list" else MODE_TOO_MANY)


@pytest.mark.parametrize("name", list(STALLS))
def test_stalled_and_inconsistent_tables_follow_the_cpu_order(emulated, name):
    """A stalled table with corrupted words: whether the CPU calls it corrupt (a bad step met in its
    own peeling order) or peel failed depends on that order, which the replay reproduces: both
    outcomes by construction (stalled_table_corruptions), then random damage, each as the CPU."""
    case = setup(**STALLS[name])
    base = helpers.sum_payloads(case.payloads, case.rng)
    level = len(case.L.multilevel.levels) - 1
    corruptions = stalled_table_corruptions(base, case.L, case.xs, level)
    assert len(corruptions) == 2
    for what, (p, want) in corruptions.items():
        status, _, _, mode = agree(case, p)
        assert (status, mode) == (want, MODE_REPLAYED), what
    rng = np.random.default_rng(helpers.stable_seed("replay", name))
    for t in range(4):
        agree(case, corrupt_fine_words(base, case.L, level, rng, t))


@pytest.mark.parametrize("word,status,level", [(float("nan"), 1, 0), (-1.0, 1, 1), (0.5, 1, 0), (float("-inf"), 1, 1),
                                               (float(INT_FIELD_LIMIT), 5, 0), (float("inf"), 5, 1),
                                               (float(INT_FIELD_LIMIT - 1), 1, 1)])
def test_corrupted_fine_word(emulated, word, status, level):
    """NaN, negative, non-integer: corrupt; at or above 2^22: overflow (the CPU's read_fine_words,
    +Inf included); a valid word no pattern can be: corrupt once peeled. In either fine table."""
    case = setup(numel=6000, n=3, k=40, block=1, shape=(1, 2), pattern="random")
    summed = helpers.sum_payloads(case.payloads, case.rng)
    L = case.L
    lo, size = L.level_offsets[level], L.multilevel.levels[level].numel
    p = summed.clone()
    p[lo + int((summed[lo:lo + size] != 0).nonzero()[0])] = word
    assert agree(case, p)[0] == status


def test_child_count_above_its_node_count(emulated):
    """A consistent fine table whose pattern claims a child count above its node's count (the coarse
    level says fewer ranks hold the node): corrupt at the expansion, as on the CPU."""
    from lossless_hc import reference
    case = setup(numel=3000, n=3, k=30, block=1, shape=(1,), pattern="random")
    L, lv = case.L, case.L.multilevel.levels[0]
    summed = helpers.sum_payloads(case.payloads, case.rng)
    held = [set(helpers.nonzero_keys(x, 1).tolist()) for x in case.xs]
    node_count = lambda v: sum(any(k // lv.span == v for k in h) for h in held)  # noqa: E731
    # A key under a node that one rank alone holds: its digit (and its node's count) is 1.
    key = next(k for k in sorted(set().union(*held)) if node_count(k // lv.span) == 1)
    node, child = key // lv.span, key % lv.span
    # Raise that child's digit to 2 in all three cells of its node: the peel stays consistent.
    cells, _ = reference.key_cells(lv.table, torch.tensor([node]))
    p = summed.clone()
    for c in cells[0].tolist():
        p[L.level_offsets[0] + c * lv.words_per_group + child // lv.digits_per_word] += float(
            L.index.base ** (child % lv.digits_per_word))
    status, *_ = agree(case, p)
    assert status == 1


@pytest.mark.parametrize("delta", [1.0, -1.0])
def test_header_key_count_disagrees(emulated, delta):
    """One key more than the index holds: the last check fails (the CPU reports the support as its
    candidates then); one fewer: the children already sum past it."""
    case = setup(numel=6000, n=2, k=40, block=1, shape=(1, 1), pattern="random")
    p = helpers.sum_payloads(case.payloads, case.rng)
    p[HDR_KEYS_LO] += delta
    status, _, run, _ = agree(case, p)
    assert status == 1
    assert (run.finish()[1].candidates > 0) == (delta > 0)


def test_coarse_corruption(emulated):
    """Coarse words that are no packed integers (NaN, non-integer, negative, too large): corrupt; a
    valid word that claims one more node: whatever the CPU says."""
    case = setup(numel=6000, n=2, k=40, block=1, shape=(2, 1), pattern="clustered")
    summed = helpers.sum_payloads(case.payloads, case.rng)
    L = case.L
    for value in (float("nan"), 0.5, -1.0, float(L.index.base ** L.index.per_word)):
        p = summed.clone()
        p[L.index_offset] = value
        assert agree(case, p)[0] == 1
    # A valid word that adds a node: its fine table no longer matches (and the key count disagrees).
    p = summed.clone()
    p[L.index_offset + L.index.words - 1] += 1.0
    agree(case, p)


def test_fuzzed_index_agrees_with_cpu(emulated):
    """Random damage anywhere in the index (coarse and every fine level), summed and averaged."""
    case = setup(numel=8000, n=3, k=40, block=1, shape=(2, 1), pattern="random")
    summed = helpers.sum_payloads(case.payloads, case.rng)
    L = case.L
    rng = np.random.default_rng(5)
    statuses = []
    for t in range(6):
        averaged = t % 3 == 2
        p = summed.clone()
        pos = rng.integers(L.index_offset, L.sketch_offset, size=int(rng.integers(1, 6)))
        p[pos] += torch.from_numpy(rng.integers(-3, 4, size=pos.size).astype(np.float32))
        if averaged:
            p = helpers.average_payloads(p, L.world_size)
        statuses.append(agree(case, p, averaged)[0])
    assert set(statuses) - {0}, statuses


def test_support_overflow_reports_as_the_cpu(emulated):
    """More support keys than the value sketch has cells (an aggregate far over capacity that the
    index still resolves): status 3 on both, 4 with a NaN sketch cell; support and candidates exact."""
    case = setup(numel=6000, n=3, k=90, block=1, shape=(1,), union=60, data_seed=90)
    summed = helpers.sum_payloads(case.payloads, case.rng)
    status, _, run, _ = agree(case, summed)
    assert status == 3 and run.finish()[1].support_keys > case.native.key_cap
    p = summed.clone()
    p[-1] = float("nan")
    assert agree(case, p)[0] == 4


def test_decode_is_bitwise_deterministic(emulated):
    """Host threads interleave differently on every run: outputs, traces and verdicts must not change
    (also on the replay path)."""
    case = setup(numel=20000, n=2, k=30, block=1, shape=(1, 1, 1, 2), pattern="random")
    summed = helpers.sum_payloads(case.payloads, case.rng)
    first = None
    for _ in range(3):
        st, out, run, _ = gpu_stats(case, summed)
        trace = run.trace(st.support_keys)
        if first is None:
            first = (st, out, trace)
            assert st.status == 0
            continue
        assert torch.equal(bits(out), bits(first[1]))
        assert torch.equal(trace[0], first[2][0]) and torch.equal(trace[1], first[2][1])
    stall = setup(**STALLS["too-many"])
    p = helpers.sum_payloads(stall.payloads, stall.rng)
    p[stall.L.level_offsets[0] + 1] += 3.0
    runs = [gpu_stats(stall, p) for _ in range(2)]
    assert runs[0][0] == runs[1][0] and torch.equal(bits(runs[0][1]), bits(runs[1][1]))


def test_grouped_fine_tables(emulated, monkeypatch):
    """Fine tables split into groups (made small here: the decoder's groups and the replay's per-group
    queues): encode and verdicts as the CPU, on a valid aggregate and on stalled, corrupted ones."""
    from lossless_hc import layout as lay
    monkeypatch.setattr(lay, "GROUP_KEYS", 64)
    monkeypatch.setattr(lay, "PEEL_FAILURE_TARGET", 0.5)   # lifts the pair bound's cap on the groups
    case = setup(numel=30000, n=2, k=600, block=1, shape=(1,), pattern="random", data_seed=1)
    assert case.L.multilevel.levels[0].table.seg_count // 3 > 1
    x = case.xs[0]
    payload = torch.zeros(case.L.payload_numel)
    _cuda.encode(case.native, x, payload)
    assert torch.equal(bits(payload[:case.L.sketch_offset]), bits(case.payloads[0][:case.L.sketch_offset]))
    summed = helpers.sum_payloads(case.payloads, case.rng)
    status, out, run, _ = agree(case, summed)
    _, st = run.finish()
    assert status == 0
    helpers.assert_lossless(case.L, case.xs, out, report_of(st, run))
    stalled = setup(numel=30000, n=2, k=900, block=1, shape=(1,), pattern="random", union=600, data_seed=2)
    assert stalled.L.multilevel.levels[0].table.seg_count // 3 > 1
    base = helpers.sum_payloads(stalled.payloads, stalled.rng)
    assert agree(stalled, base)[0] == 2
    corruptions = stalled_table_corruptions(base, stalled.L, stalled.xs, 0)
    assert len(corruptions) == 2
    for what, (p, want) in corruptions.items():
        status, _, _, mode = agree(stalled, p)
        assert (status, mode) == (want, MODE_REPLAYED), what
