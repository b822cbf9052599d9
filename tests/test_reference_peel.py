"""The oracle's peeling machinery (lossless_hc/lhc/reference_peel.py) on small hand-built hypergraphs:
each function against the value its docstring (and csrc/lhc_layout.h, csrc/lhc_ancestry.h) states."""
import itertools

import pytest
import torch

from lossless_hc.lhc import reference_peel as rp

WEIGHTS = (-2, -1, 1, 2)  # the value sketch's weights: sign times magnitude 1 or 2


def test_pair_cells_takes_the_first_largest_determinant():
    """Over every pair of weight columns: the cells (p, q) of the largest |det|, the first of (0, 1),
    (0, 2), (1, 2) on ties, with det = wa[p] wb[q] - wa[q] wb[p]; (0, 1, 0) when all three are 0."""
    order = ((0, 1), (0, 2), (1, 2))
    ties = 0
    for wa in itertools.product(WEIGHTS, repeat=3):
        for wb in itertools.product(WEIGHTS, repeat=3):
            dets = [wa[p] * wb[q] - wa[q] * wb[p] for p, q in order]
            best = max(range(3), key=lambda i: abs(dets[i]))  # max keeps the first of equal keys
            ties += sum(abs(d) == abs(dets[best]) for d in dets) > 1 and dets[best] != 0
            want = (*order[best], dets[best]) if dets[best] != 0 else (0, 1, 0)
            assert rp.pair_cells(list(wa), list(wb)) == want, (wa, wb)
    assert ties > 0


def test_pair_numerators_use_the_tie_breaking_cells():
    """wa = (1, 1, 1), wb = (1, -1, 1): |det| is 2 on cells (0, 1) and (1, 2); cells (0, 1) solve the
    pair, so a residual on cell 2 alone (which (1, 2) would read) leaves both numerators 0."""
    wa, wb = torch.tensor([1, 1, 1]), torch.tensor([1, -1, 1])
    assert rp.pair_cells(wa.tolist(), wb.tolist()) == (0, 1, -2)
    val = torch.tensor([[0.0], [0.0], [8.0]], dtype=torch.float64)
    num_a, num_b, det = rp.pair_numerators(val, torch.tensor([0, 1, 2]), wa, wb)
    assert det == -2 and num_a.tolist() == [0.0] and num_b.tolist() == [0.0]
    # and from cells (0, 1): R_0 = v_a + v_b, R_1 = v_a - v_b with v_a = 3, v_b = 5
    val = torch.tensor([[8.0], [-2.0], [8.0]], dtype=torch.float64)
    v_a, v_b = rp.solve_pair(val, torch.tensor([0, 1, 2]), wa, wb)
    assert v_a.tolist() == [3.0] and v_b.tolist() == [5.0]


def _fan_in(n: int) -> torch.Tensor:
    """Keys 0..n-2 each with a private pure cell, all in cells 0 and 1 (key 0 in cell 2 instead of 1);
    key n-1 in cells 0, 1, 2. Round 1 peels keys 0..n-2; round 2 peels key n-1 from cell 0, whose
    other keys are all n-1 others: its ancestry is all n keys."""
    rows = [[0, 2, 3]] + [[0, 1, 3 + i] for i in range(1, n - 1)] + [[0, 1, 2]]
    return torch.tensor(rows, dtype=torch.int64)


def test_ancestry_of_exactly_the_cap_is_kept():
    """``None for a key with more than cap``: an ancestry of exactly ANCESTRY_CAP keys is tracked, one
    key more is not."""
    for n, kept in ((rp.ANCESTRY_CAP, True), (rp.ANCESTRY_CAP + 1, False)):
        cells = _fan_in(n)
        rounds, resolved = rp.peel_rounds(cells, n + 2)
        assert bool(resolved.all()) and len(rounds) == 2 and rounds[1][0].tolist() == [n - 1]
        assert rounds[1][1].tolist() == [0]                        # read from cell 0
        anc = rp.ancestries(cells, rounds, rp.cell_members(cells))
        assert all(anc[k] == frozenset([k]) for k in range(n - 1))
        assert anc[n - 1] == (frozenset(range(n)) if kept else None), n
    # the same boundary with an explicit cap
    cells = _fan_in(5)
    rounds, _ = rp.peel_rounds(cells, 7)
    members = rp.cell_members(cells)
    assert rp.ancestries(cells, rounds, members, cap=5)[4] == frozenset(range(5))
    assert rp.ancestries(cells, rounds, members, cap=4)[4] is None


@pytest.mark.parametrize("acc1,G", [(1.0, 2.0), (0.0, 1.5)])
def test_verification_bound_counts_the_check_cells_residual(acc1, G):
    """One key read from cell 0 and checked by cells 1 and 2: ``V(j) = acc(j) + max |residual(j)|``,
    ``G = min_j V(j) / |w_j|`` and ``F = G - err`` rounded up by ``2^-52 G``. A cell with ``acc == 0``
    is a check cell too (``acc >= 0``): its residual alone bounds the key."""
    cells = torch.tensor([[0, 1, 2]])
    weights = torch.tensor([[1, 2, -1]])
    rounds, _ = rp.peel_rounds(cells, 3)
    assert rounds[0][1].tolist() == [0]
    acc = torch.tensor([-1.0, acc1, 2.0], dtype=torch.float64)      # cell 0 read, cells 1 and 2 check
    val = torch.tensor([[0.0, 0.0], [0.5, -3.0], [0.25, 0.0]], dtype=torch.float64)
    err = torch.tensor([0.125], dtype=torch.float64)
    F = rp.verification_bound(cells, weights, rounds, acc, val, err)
    assert G == min((acc1 + 3.0) / 2, (2.0 + 0.25) / 1)             # from cell 1 either way
    assert F.tolist() == [G - 0.125 + G * 2.0 ** -52]


def test_cell_error_bound_is_the_documented_formula():
    """``(deg + n + 2) u M (1 + 2 (deg + n + 2) u)`` with u = 2^-24, on values where every step is exact:
    m = 4u, 8u, 3u and 3u (deg 1, 5, 0 and 0, n = 1; an empty cell has no mass)."""
    mass = torch.tensor([1.0, 0.5, 0.0, 2.0], dtype=torch.float64)
    deg = torch.tensor([1, 5, 0, 0])
    got = rp.cell_error_bound(mass, deg, 1).tolist()
    assert got == [2.0 ** -22 + 2.0 ** -43, 2.0 ** -22 + 2.0 ** -42, 0.0, 3 * 2.0 ** -23 + 9 * 2.0 ** -46]


def test_within_rtol_accepts_its_equality_edge():
    """``err (1 + rtol) + u |v| <= rtol |v|`` holds with equality (not just strictly) at rtol = 2u,
    err = u, v = +-(1 + 2u) (each side 2u (1 + 2u), exact in float64); a hair more error fails."""
    u = rp.UNIT_ROUNDOFF
    v = torch.tensor([1 + 2 * u, -(1 + 2 * u), 1 + 2 * u], dtype=torch.float64)
    err = torch.tensor([u, u, u * (1 + 2.0 ** -40)], dtype=torch.float64)
    assert rp.within_rtol(v, err, 2 * u).tolist() == [True, True, False]


def test_solvable_pairs_are_ordered_by_their_first_cell():
    """Two solvable pairs in one group of a table of seg_len 10 (cells 0-9, 10-19, 20-29 are its three
    segments), where the order of their first cells (0 < 1) is not that of their other cells (11 > 10,
    21 > 20) nor of their key indices: ``[P, 2]`` ordered by the pair's first cell. With fewer than two
    keys left there are none: still ``[0, 2]``."""
    cells = torch.tensor([[1, 10, 20], [1, 10, 20], [0, 11, 21], [0, 11, 21]])
    weights = torch.tensor([[1, 1, 1], [1, -1, 1]] * 2)                # det -2: solvable
    pairs = rp.solvable_pairs(cells, weights, torch.zeros(4, dtype=torch.bool))
    assert pairs.tolist() == [[2, 3], [0, 1]]
    for left in (0, 1):
        resolved = torch.ones(4, dtype=torch.bool)
        resolved[:left] = False
        none = rp.solvable_pairs(cells, weights, resolved)
        assert none.shape == (0, 2) and none.dtype == torch.int64
