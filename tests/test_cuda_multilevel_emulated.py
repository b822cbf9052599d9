"""The multilevel index's CUDA kernels (csrc/cuda/codec_kernels.cuh, "multilevel index") and their
launch sequence (lossless_hc/backends/cuda_lhc.py), run on the host through tests/cuda_emulation (the fixture
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
from lossless_hc.backends import cuda_lhc as _cuda
from lossless_hc.backends import cuda_runtime
from lossless_hc.lhc import reference as reference
from lossless_hc.lhc.layout import HDR_KEYS_LO, INT_FIELD_LIMIT
from lossless_hc.lhc.sizing import build_layout
from test_cuda import assert_same_payload, bits, index_verdicts_agree
from test_cuda_multilevel import ML_STALLS, corrupt_fine_words, stalled_table_corruptions
from test_cuda_emulated import emulated  # noqa: F401  (the module-scoped fixture: builds and installs the emulation)


def setup(numel, n, k, block, shape, pattern="random", union=None, seed=3, data_seed=0):
    """A multilevel layout of the given shape, the CPU codec and the emulated CUDA layout, and the
    ranks' inputs (k non-zero keys each) and CPU payloads."""
    L = build_layout("multilevel", numel, n, max(1, k) * block, block, seed, union, shape)
    assert L is not None and len(L.multilevel.levels) == len(shape)
    cpu = helpers.codec_for(L)
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
                           peeled=st.peeled, trace=run.trace(st.support_keys), status=st.status,
                           inexact_keys=run.inexact_keys(st.support_keys) if st.status == helpers.INEXACT
                           else torch.zeros(0, dtype=torch.int64))


def test_emulation_holds_every_codec_kernel(emulated):
    assert set(cuda_runtime.header_kernels(cuda_runtime.KERNEL_HEADERS[0])) <= set(emulated.kernel_names())


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
        assert status in (0, helpers.INEXACT)
        _, st = run.finish()
        helpers.assert_lossless(case.L, case.xs, out, report_of(st, run), averaged=averaged)


STALLS = ML_STALLS   # aggregates over capacity whose fine peel stalls (tests/test_cuda_multilevel.py)


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


@pytest.mark.parametrize("word,status,level", [(float("nan"), 1, 0), (0.5, 1, 0), (-2.5, 1, 1),
                                               (float(INT_FIELD_LIMIT), 5, 0), (float(-INT_FIELD_LIMIT), 5, 1),
                                               (float("inf"), 5, 1), (float("-inf"), 5, 0),
                                               (float(INT_FIELD_LIMIT - 1), 1, 1), (-1.0, 1, 1),
                                               (float(1 - INT_FIELD_LIMIT), 1, 0)])
def test_corrupted_fine_word(emulated, word, status, level):
    """NaN, non-integer: corrupt; magnitude at or above 2^22: overflow (the CPU's read_fine_words,
    +-Inf included); a valid (signed) word that leaves the table no consistent set of patterns:
    corrupt once peeled. In either fine table."""
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
    from lossless_hc.lhc import reference as reference
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
    case = setup(numel=6000, n=3, k=60, block=1, shape=(1,), union=60, data_seed=0)
    summed = helpers.sum_payloads(case.payloads, case.rng)
    status, _, run, _ = agree(case, summed)
    assert status == 3 and run.finish()[1].support_keys > case.native.key_cap
    p = summed.clone()
    p[-1] = float("nan")
    assert agree(case, p)[0] == 4


def test_decode_is_bitwise_deterministic(emulated):
    """The emulated threads interleave differently on every run: outputs, traces and verdicts must not change
    (also on the replay path)."""
    case = setup(numel=20000, n=2, k=30, block=1, shape=(1, 1, 1, 2), pattern="random")
    summed = helpers.sum_payloads(case.payloads, case.rng)
    first = None
    for _ in range(3):
        st, out, run, _ = gpu_stats(case, summed)
        trace = run.trace(st.support_keys)
        if first is None:
            first = (st, out, trace)
            assert st.status in (0, helpers.INEXACT)
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
    from lossless_hc.lhc import sizing as lay
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
    assert status in (0, helpers.INEXACT)   # every key recovered (INEXACT: the unprovable ones listed)
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


# -- two-node stopping sets of the signed fine tables (pairs) --------------------------------------
# Fine tables add s_j(v) * pattern(v) into cell j (s_j = +-1), so two nodes sharing all three cells are
# solved from two of them (lhc::pair_cells, checked against the third) unless their signs are
# proportional. The layouts below are small enough for colliding nodes to be common.
PAIR_LAYOUTS = {
    "1level": (20000, 2, 10, 1, 3, None, (1,)),       # level 0: 1667 nodes in 3 x 38 cells
    "2levels": (60000, 2, 10, 1, 3, None, (1, 1)),    # level 1: 5000 nodes in 3 x 38 cells
}


def pair_setup(name):
    """The layout, CPU codec and emulated CUDA layout of PAIR_LAYOUTS[name]; the pairs of its finest
    level: (solvable, proportional) lists of (a, b) node ids (a < b) with the same three cells; and that
    level's cells and signs of every node."""
    L = build_layout("multilevel", *PAIR_LAYOUTS[name])
    level = len(L.multilevel.levels) - 1
    lv = L.multilevel.levels[level]
    cells, signs = reference.key_cells(lv.table, torch.arange(lv.num_nodes))
    solvable, proportional = helpers.colliding_pairs(lv.table, lv.num_nodes)
    assert solvable and proportional, "no colliding node pairs of both kinds: pick another layout"
    return SimpleNamespace(L=L, cpu=helpers.codec_for(L), native=_cuda.CudaLayout(L, torch.device("cpu")), level=level,
                           lv=lv, cells=cells, signs=signs, solvable=solvable, proportional=proportional)


def pair_inputs(case, pairs, rng, extra=2, fill=0):
    """Two ranks' inputs: each holds a key (a random child) under every node of ``pairs``, rank 0 also
    under ``extra`` nodes of the finest level whose cells avoid the pairs' (they peel), and ``fill``
    more such nodes are spread over the ranks (to give the level more non-zero nodes than cells). Nodes
    of the levels above are few: they peel. Returns the inputs and the extra nodes."""
    L, lv, cells = case.L, case.lv, case.cells
    taken = {c for p in pairs for v in p for c in cells[v].tolist()}
    pool = [v for v in rng.permutation(lv.num_nodes).tolist()
            if not taken & set(cells[v].tolist()) and v * lv.span < L.num_keys]
    if case.level > 0:   # keep the levels above small: extra nodes under the pairs' parents first
        up = case.L.multilevel.levels[case.level - 1]
        parents = {v * lv.span // up.span for p in pairs for v in p} | {0, 1}
        near = {v for v in pool if v * lv.span // up.span in parents}
        pool = [v for v in pool if v in near] + [v for v in pool if v not in near]
    others = pool[:extra + fill]
    xs = [torch.zeros(L.numel) for _ in range(2)]
    for r, x in enumerate(xs):
        mine = [v for p in pairs for v in p] + (others[:extra] if r == 0 else []) + others[extra + r::2]
        for v in mine:
            lo, hi = v * lv.span, min(L.numel, (v + 1) * lv.span)
            x[int(rng.integers(lo, hi))] = float(rng.standard_normal()) + 3.0
    return xs, others


def pair_words(case, summed, pair):
    """The payload positions of word 0 of the pair's three cells, their words there, and the pair's
    pattern words 0 solved from them (only the pair lives in those cells)."""
    lv, L = case.lv, case.L
    cell = case.cells[pair[0]].tolist()
    pos = [L.level_offsets[case.level] + c * lv.words_per_group for c in cell]
    R = [int(summed[p]) for p in pos]
    sa, sb = case.signs[pair[0]].tolist(), case.signs[pair[1]].tolist()
    p, q, det = reference.pair_cells(sa, sb)
    pa, pb = (sb[q] * R[p] - sb[p] * R[q]) // det, (sa[p] * R[q] - sa[q] * R[p]) // det
    assert all(R[j] == sa[j] * pa + sb[j] * pb for j in range(3))
    return pos, R, sa, sb, pa, pb


@pytest.mark.parametrize("name", list(PAIR_LAYOUTS))
def test_fine_pair_solved_as_the_cpu(emulated, name):
    """Two non-zero nodes sharing all three cells of the finest table, signs not proportional: the
    GPU encodes the signed words bit for bit as the CPU and solves the pair as the CPU does: lossless,
    summed and averaged."""
    case = pair_setup(name)
    rng = np.random.default_rng(helpers.stable_seed("gpu-finepair", name))
    for pair in case.solvable[:3]:
        xs, _ = pair_inputs(case, [pair], rng)
        payloads = [case.cpu.encode(x) for x in xs]
        g = torch.full((case.L.payload_numel,), 7.0)
        _cuda.encode(case.native, xs[0], g)
        assert torch.equal(bits(g[:case.L.sketch_offset]), bits(payloads[0][:case.L.sketch_offset]))
        lo = case.L.level_offsets[case.level]
        assert bool((g[lo:case.L.sketch_offset] < 0).any()) or bool((g[lo:case.L.sketch_offset] > 0).any())
        summed = helpers.sum_payloads(payloads, rng)
        for averaged in (False, True):
            payload = helpers.average_payloads(summed, 2) if averaged else summed
            status, out, run, mode = agree(case, payload, averaged)
            assert (status, mode) == (0, MODE_LIST)
            _, st = run.finish()
            helpers.assert_lossless(case.L, xs, out, report_of(st, run), averaged=averaged)


@pytest.mark.parametrize("name", list(PAIR_LAYOUTS))
def test_proportional_fine_pair_fails_as_the_cpu(emulated, name):
    """A pair whose signs are proportional cannot be solved: 'index peeling failed' on both, without a
    replay (an honest table meets no inconsistency); a corrupted word in its cells changes nothing
    (an unsolvable pair's cells are never read)."""
    case = pair_setup(name)
    rng = np.random.default_rng(helpers.stable_seed("gpu-proppair", name))
    for pair in case.proportional[:2]:
        xs, _ = pair_inputs(case, [pair], rng)
        summed = helpers.sum_payloads([case.cpu.encode(x) for x in xs], rng)
        assert agree(case, summed)[0::3] == (2, MODE_LIST)
        cell = case.cells[pair[0]].tolist()
        p = summed.clone()
        p[case.L.level_offsets[case.level] + cell[1] * case.lv.words_per_group] += 1.0
        assert agree(case, p)[0::3] == (2, MODE_LIST)


@pytest.mark.parametrize("name", list(PAIR_LAYOUTS))
def test_corrupted_fine_pair_as_the_cpu(emulated, name):
    """Words of a solvable pair's cells changed: an odd change (a division by det = +-2 that leaves a
    half, or a third cell that disagrees), a pattern driven negative or to base^w with all three cells
    consistent, a malformed word (NaN, magnitude 2^22): the CPU's status every time; and changes the
    pair check need not see (an even change of one cell, which the third cell misses where its relative
    sign matches the other solving cell's; a consistent pair of valid patterns): whatever the CPU says."""
    case = pair_setup(name)
    rng = np.random.default_rng(helpers.stable_seed("gpu-badpair", name))
    pair = case.solvable[0]
    xs, _ = pair_inputs(case, [pair], rng)
    summed = helpers.sum_payloads([case.cpu.encode(x) for x in xs], rng)
    pos, R, sa, sb, pa, pb = pair_words(case, summed, pair)
    limit = case.L.index.base ** case.lv.digits_per_word
    want = {}
    for j in range(3):
        for delta in (1.0, -1.0, 3.0):
            p = summed.clone()
            p[pos[j]] += delta
            want[f"cell {j} {delta:+}"] = (p, 1)
    for what, new_a in (("negative", -1), ("base^w", limit)):
        p = summed.clone()
        for j in range(3):
            p[pos[j]] = float(R[j] + sa[j] * (new_a - pa))
        want[what] = (p, 1)
    for what, word, status in (("nan", float("nan"), 1), ("-2^22", float(-INT_FIELD_LIMIT), 5)):
        p = summed.clone()
        p[pos[2]] = word
        want[what] = (p, status)
    for what, (p, status) in want.items():
        assert agree(case, p)[0::3] == (status, MODE_LIST), what
    for j in range(3):
        p = summed.clone()
        p[pos[j]] += 2.0
        agree(case, p)
    # Consistent cells: pattern words a digit apart.
    for delta_a, delta_b in ((1, 0), (0, 1), (case.L.index.base, -1)):
        p = summed.clone()
        for j in range(3):
            p[pos[j]] = float(R[j] + sa[j] * delta_a + sb[j] * delta_b)
        agree(case, p)


def test_stalled_table_with_pairs_replays_the_cpu_order(emulated):
    """A table holding a solvable and an unsolvable pair stalls ('index peeling failed', no replay);
    corrupted, the verdict is the CPU's after replaying its order, pairs included: a bad solvable pair
    is corrupt, an inconsistency no step meets (a word in an empty cell) is not."""
    case = pair_setup("1level")
    rng = np.random.default_rng(helpers.stable_seed("gpu-stalledpairs"))
    good = case.solvable[0]
    bad_cells = set(case.cells[good[0]].tolist())
    prop = next(p for p in case.proportional if not bad_cells & set(case.cells[p[0]].tolist()))
    xs, others = pair_inputs(case, [good, prop], rng, extra=3)
    summed = helpers.sum_payloads([case.cpu.encode(x) for x in xs], rng)
    assert agree(case, summed)[0::3] == (2, MODE_LIST)
    pos, R, sa, _, pa, _ = pair_words(case, summed, good)
    nodes = [v for p in (good, prop) for v in p] + others
    deg = torch.bincount(case.cells[nodes].reshape(-1), minlength=case.lv.table.cells)
    lo, wpg = case.L.level_offsets[0], case.lv.words_per_group
    p = summed.clone()
    p[pos[0]] += 1.0
    assert agree(case, p)[0::3] == (1, MODE_REPLAYED), "bad solvable pair"
    p = summed.clone()
    for j in range(3):
        p[pos[j]] = float(R[j] - sa[j] * (pa + 1))   # consistent cells, pattern -1
    assert agree(case, p)[0::3] == (1, MODE_REPLAYED), "negative pattern"
    p = summed.clone()
    p[lo + int((deg == 0).nonzero()[0]) * wpg] += 1.0
    assert agree(case, p)[0::3] == (2, MODE_REPLAYED), "empty cell"
    p = summed.clone()
    p[lo + int((deg == 1).nonzero()[0]) * wpg] = float(INT_FIELD_LIMIT - 1)
    assert agree(case, p)[0] == 1, "first pure cell"


def test_pairs_in_a_level_with_more_nodes_than_cells(emulated):
    """A level with more non-zero nodes than cells (peeled by node id) holding a solvable pair: peel
    failed when honest; its pair corrupted, corrupt (the pair is found by streaming the nodes by id,
    then in the replay), as on the CPU."""
    case = pair_setup("1level")
    rng = np.random.default_rng(helpers.stable_seed("gpu-toomanypairs"))
    pair = case.solvable[0]
    xs, _ = pair_inputs(case, [pair], rng, extra=0, fill=case.lv.table.cells + 4)
    summed = helpers.sum_payloads([case.cpu.encode(x) for x in xs], rng)
    assert agree(case, summed)[0::3] == (2, MODE_TOO_MANY)
    pos, R, sa, _, pa, _ = pair_words(case, summed, pair)
    for j, delta in ((0, 1.0), (2, -1.0), (1, 3.0)):
        p = summed.clone()
        p[pos[j]] += delta
        assert agree(case, p)[0::3] == (1, MODE_REPLAYED), (j, delta)
    p = summed.clone()
    for j in range(3):
        p[pos[j]] = float(R[j] - sa[j] * (pa + 1))   # consistent cells, pattern -1
    assert agree(case, p)[0::3] == (1, MODE_REPLAYED), "negative pattern"
    p = summed.clone()
    p[pos[0]] += 2.0   # the third cell may or may not see it: whatever the CPU says
    agree(case, p)
