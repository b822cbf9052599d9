"""The CUDA backend's multilevel index against the CPU backend, on a GPU at realistic sizes, where the
kernels' memory model and occupancy are real: its encode (the same index words) and its verdicts, ok or
failed (stalled fine tables whose outcome the CPU's peeling order decides, replayed; corrupted and
overflowing words; wrong key counts). tests/test_cuda_multilevel_emulated.py runs the same checks on the
host (emulated) at small sizes, with the stalled aggregates and corruptions defined here; the other GPU
tests of the CUDA backend, and the helpers comparing it with the CPU: tests/test_cuda.py.

Every test here is marked ``gpu`` and skipped, visibly, where torch sees no CUDA device (``pytest -m gpu``).
"""
import numpy as np
import pytest
import torch

import helpers
from lossless_hc.lhc import reference as reference
from test_cuda import assert_same_payload, bits, codecs, index_verdicts_agree

HAVE_CUDA = torch.cuda.is_available()
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not HAVE_CUDA, reason="no CUDA device: the GPU tests of the CUDA backend did not run")]


# Small aggregates over capacity whose fine peel stalls: level 0 with fewer non-zero nodes than cells
# (peeled from its node list), with more (peeled by node id), and a level 1 with more
# (tests/test_cuda_multilevel_emulated.py; layout seed 3, "normal" values, as its setup()).
ML_STALLS = {
    "list": dict(numel=6000, n=3, k=80, block=1, shape=(1,), union=60, data_seed=0),
    "too-many": dict(numel=6000, n=3, k=100, block=1, shape=(1,), union=60, data_seed=1),
    "level1": dict(numel=30000, n=2, k=130, block=1, shape=(1, 1), union=60, data_seed=1),
}


def corrupt_fine_words(base: torch.Tensor, layout, level: int, rng, trial: int) -> torch.Tensor:
    """A copy of ``base`` with two non-zero words of fine table ``level`` read short by 1, raised by up
    to 40, or replaced by a valid word (by ``trial`` % 3): inconsistent tables, each word still valid."""
    from lossless_hc.lhc.layout import INT_FIELD_LIMIT
    lo, size = layout.level_offsets[level], layout.multilevel.levels[level].numel
    nz = (base[lo:lo + size] != 0).nonzero().reshape(-1) + lo
    p = base.clone()
    pos = nz[torch.from_numpy(rng.integers(0, nz.numel(), size=2))]
    if trial % 3 == 0:
        p[pos] -= 1.0
    elif trial % 3 == 1:
        p[pos] += torch.from_numpy(rng.integers(1, 40, size=2).astype(np.float32))
    else:
        p[pos] = torch.from_numpy(rng.integers(0, INT_FIELD_LIMIT, size=2).astype(np.float32))
    return p


def stalled_table_corruptions(base: torch.Tensor, layout, xs, level: int) -> dict:
    """Two corruptions of ``base`` (an honest aggregate whose fine table ``level`` stalls) that the
    CPU decides differently, by its own peeling order, and the GPU only by replaying that order:
    ``"empty cell"``: +1 in a cell no node hashes to -- an inconsistency, but no step of any order
    touches that cell, so the stalled table is "peel failed" (2); ``"first pure cell"``: 2^22 - 1 (a
    valid word, no pattern) in the smallest cell holding one node -- the CPU dequeues it first and
    reads it as a pattern: corrupt (1). Returns {name: (payload, CPU status)}, without "empty cell"
    where every cell holds a node (tables far over capacity)."""
    from lossless_hc.lhc.layout import INT_FIELD_LIMIT
    lv = layout.multilevel.levels[level]
    keys = np.unique(np.concatenate([helpers.nonzero_keys(x, layout.block) for x in xs]))
    nodes = torch.from_numpy(np.unique(keys // lv.span))
    cells, _ = reference.key_cells(lv.table, nodes)
    deg = torch.bincount(cells.reshape(-1), minlength=lv.table.cells)
    word = lambda c: layout.level_offsets[level] + int(c) * lv.words_per_group  # noqa: E731  first word of cell c
    out = {}
    if bool((deg == 0).any()):
        empty = base.clone()
        empty[word((deg == 0).nonzero()[0])] += 1.0
        out["empty cell"] = (empty, 2)
    pure = base.clone()
    pure[word((deg == 1).nonzero()[0])] = float(INT_FIELD_LIMIT - 1)
    out["first pure cell"] = (pure, 1)
    return out


def multilevel_case(numel, n, k, block=1, shape=(1,), pattern="random", union=None, seed=0, data_seed=0,
                    dist="wide"):
    """A multilevel layout of the given shape (coarsest level first) as a CPU codec and a GPU codec,
    with the ranks' inputs and CPU payloads."""
    from lossless_hc.backends import cpu as _backend
    from lossless_hc.lhc.sizing import build_layout
    L = build_layout("multilevel", numel, n, max(1, k) * block, block, seed, union, shape)
    assert L is not None
    cpu, gpu = codecs(numel, n, max(1, k) * block, block, "multilevel", seed)
    for c, dev in ((cpu, torch.device("cpu")), (gpu, gpu.device)):
        c.layout = L
        c._native = c._backend.lhc_layout(L, dev)
    rng = np.random.default_rng(data_seed)
    xs = helpers.make_inputs(rng, numel, block, n, k, pattern, dist)
    return cpu, gpu, xs, [cpu.encode(x) for x in xs], rng


@pytest.mark.parametrize("shape,numel,n,k,block,pattern", [
    ((1,), 1 << 21, 2, 20_000, 1, "random"),
    ((2, 1), 1 << 22, 8, 5_000, 1, "clustered"),
    ((1, 1, 1), 1 << 23, 1, 3_000, 1, "random"),
    ((4, 1, 1, 2), 1 << 23, 5, 2_000, 1, "random"),
    ((1, 3), 64 * 20_000 - 5, 4, 300, 64, "random"),
    ((2, 1), 1 << 22, 2, 400_000, 1, "random"),     # level 1 in 3 groups
])
def test_multilevel_encode_and_verdicts_match_cpu(backend, shape, numel, n, k, block, pattern):
    cpu, gpu, xs, payloads, rng = multilevel_case(numel, n, k, block, shape, pattern)
    L = cpu.layout
    for x, p in list(zip(xs, payloads))[:2]:
        g = gpu.encode(x.cuda()).cpu()
        assert_same_payload(L, p, g, x)
        assert torch.equal(bits(g[:L.sketch_offset]), bits(p[:L.sketch_offset])), "index words differ"
    summed = helpers.sum_payloads(payloads, rng)
    for averaged in (False, True):
        payload = helpers.average_payloads(summed, n) if averaged else summed
        status, *_ = index_verdicts_agree(cpu, gpu._native, payload, averaged)
        assert status in (0, helpers.INEXACT)   # every key peeled; INEXACT keys are listed, not wrong
        y, report = gpu.decode(payload.cuda(), averaged=averaged, trace=True)
        helpers.assert_lossless(L, xs, y.cpu(), report, averaged=averaged, strict_support=False)


def test_multilevel_failures_match_cpu(backend):
    """Stalled fine tables at realistic sizes (fewer non-zero nodes than cells, and more: peeled by
    node id), corrupted so that the CPU's order decides (replayed: both outcomes), or at random;
    corrupted and overflowing words; wrong key counts."""
    from lossless_hc.lhc.layout import INT_FIELD_LIMIT
    cases = {"list": dict(numel=1 << 20, n=4, k=6_000, union=20_000, data_seed=1),
             "too-many": dict(numel=1 << 20, n=4, k=30_000, union=20_000, data_seed=2)}
    replayed = set()
    for name, cfg in cases.items():
        cpu, gpu, xs, payloads, rng = multilevel_case(**cfg)
        base = helpers.sum_payloads(payloads, rng)
        status, _, _, mode = index_verdicts_agree(cpu, gpu._native, base)
        assert status == 2 and mode == (0 if name == "list" else 1)
        for what, (p, want) in stalled_table_corruptions(base, cpu.layout, xs, 0).items():
            status, _, _, mode = index_verdicts_agree(cpu, gpu._native, p)
            assert (status, mode) == (want, 2), (name, what)
            replayed.add(status)
        for t in range(6):
            index_verdicts_agree(cpu, gpu._native, corrupt_fine_words(base, cpu.layout, 0, rng, t))
        lo = cpu.layout.level_offsets[0]
        first = lo + int((base[lo:cpu.layout.sketch_offset] != 0).nonzero()[0])
        # -1 is a valid signed word: the list peel finds the table inconsistent (corrupt), while with more
        # nodes than cells the peel stalls first (the CPU's verdict either way)
        for word, want in ((float("nan"), 1), (-1.0, 1 if name == "list" else 2), (0.5, 1),
                           (float(INT_FIELD_LIMIT), 5), (float("inf"), 5)):
            p = base.clone()
            p[first] = word
            assert index_verdicts_agree(cpu, gpu._native, p)[0] == want
    assert replayed == {1, 2}
    cpu, gpu, xs, payloads, rng = multilevel_case(1 << 21, 3, 10_000, shape=(1, 1))
    for delta in (1.0, -1.0):
        p = helpers.sum_payloads(payloads, rng)
        p[3] += delta
        assert index_verdicts_agree(cpu, gpu._native, p)[0] == 1
