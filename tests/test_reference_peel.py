"""The oracle's peeling machinery (lossless_hc/lhc/reference_peel.py) on small hand-built hypergraphs:
each function against the value its docstring (and csrc/lhc_layout.h, csrc/lhc_ancestry.h) states."""
import itertools

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
