"""The reference decoder's peeling machinery (the test oracle; see :mod:`lossless_hc.lhc.reference`):
round-based peeling of a 3-hypergraph, the two-key stopping sets and their solution, and the error
bounds the decoders compute along the peel (``lhc::cell_error_bound``, ``lhc::within_rtol``,
``lhc::verification_bound`` of ``csrc/lhc_layout.h``), in float64 on whole tensors."""
from __future__ import annotations

import torch

def peel_rounds(cells: torch.Tensor, num_cells: int):
    """Round-based peeling of the 3-hypergraph whose edge i is ``cells[i]`` (three distinct cells).

    Each round resolves every unresolved key that is alone in one of its cells at the start of the
    round. Returns ``(rounds, resolved)``: ``rounds`` a list of ``(keys, pure_j)`` (indices into
    ``cells``, increasing, and which of their three cells was pure, the lowest such j), ``resolved``
    a bool mask. Peeling stops at the 2-core, so ``resolved`` does not depend on the order.

    Per cell it keeps the number of unresolved keys and the *sum* of their indices: where the count
    is 1 the sum is the index of the cell's only key.
    """
    cells = cells.to(torch.int64)
    K = cells.shape[0]
    flat = cells.reshape(-1)
    idx3 = torch.arange(K, dtype=torch.int64).repeat_interleave(3)
    deg = torch.bincount(flat, minlength=num_cells)
    ksum = torch.zeros(num_cells, dtype=torch.int64).index_add_(0, flat, idx3)
    resolved = torch.zeros(K, dtype=torch.bool)
    rounds = []
    while True:
        pure_cells = (deg == 1).nonzero().reshape(-1)
        if pure_cells.numel() == 0:
            break
        keys = torch.unique(ksum[pure_cells])                  # sorted, each key once
        kc = cells[keys]
        pure_j = (deg[kc] == 1).to(torch.int8).argmax(dim=1).to(torch.int64)
        rounds.append((keys, pure_j))
        resolved[keys] = True
        kf = kc.reshape(-1)
        deg.index_add_(0, kf, torch.full_like(kf, -1))
        ksum.index_add_(0, kf, -keys.repeat_interleave(3))
    return rounds, resolved


def pair_cells(wa, wb) -> tuple[int, int, int]:
    """``lhc::pair_cells``: the two cells ``p < q`` of a two-key stopping set with weights ``wa``,
    ``wb`` (three ints each) whose determinant ``wa[p] wb[q] - wa[q] wb[p]`` is largest in magnitude
    (the first of (0, 1), (0, 2), (1, 2) on ties), and that determinant (0: unsolvable)."""
    best = (0, 1, 0)
    for p, q in ((0, 1), (0, 2), (1, 2)):
        det = int(wa[p]) * int(wb[q]) - int(wa[q]) * int(wb[p])
        if abs(det) > abs(best[2]):
            best = (p, q, det)
    return best


def solvable_pairs(cells: torch.Tensor, weights: torch.Tensor, resolved: torch.Tensor) -> torch.Tensor:
    """The two-key stopping sets left after peeling that the value decoder solves: pairs ``a < b``
    of unresolved keys with the same three cells, no other unresolved key in those cells, and
    weight columns not proportional (:func:`pair_cells`; see ``sizing.sketch_table_for``). Returns
    an ``[P, 2]`` tensor of key indices, ordered by the pair's first cell.
    """
    cells = cells.to(torch.int64)
    left = (~resolved).nonzero().reshape(-1)
    if left.numel() < 2:
        return torch.zeros(0, 2, dtype=torch.int64)
    lc = cells[left]
    deg = torch.bincount(lc.reshape(-1), minlength=int(cells.max()) + 1)
    triples, inverse, counts = torch.unique(lc, dim=0, return_inverse=True, return_counts=True)
    pairs = []
    for t in (counts == 2).nonzero().reshape(-1).tolist():
        if not bool((deg[triples[t]] == 2).all()):
            continue
        a, b = left[(inverse == t).nonzero().reshape(-1)].tolist()
        if pair_cells(weights[a].tolist(), weights[b].tolist())[2] == 0:
            continue      # proportional: unsolvable
        pairs.append((int(triples[t][0]), min(a, b), max(a, b)))
    pairs.sort()
    return torch.tensor([[a, b] for _, a, b in pairs], dtype=torch.int64).reshape(-1, 2)


def pair_numerators(val: torch.Tensor, cells3: torch.Tensor, wa: torch.Tensor, wb: torch.Tensor):
    """``(num_a, num_b, det)`` of a solvable pair from its three residual cells ``val[cells3]`` (in
    ``val``'s dtype: float64 values, or int64 fine words): with cells p, q and ``det`` from
    :func:`pair_cells`, ``num_a = w_q(b) R_p - w_p(b) R_q`` and ``num_b = w_p(a) R_q - w_q(a) R_p``,
    so that ``v_a = num_a / det`` and ``v_b = num_b / det`` (products by the weights are exact)."""
    wa, wb = wa.tolist(), wb.tolist()
    p, q, det = pair_cells(wa, wb)
    R_p, R_q = val[cells3[p]], val[cells3[q]]
    return wb[q] * R_p - wb[p] * R_q, wa[p] * R_q - wa[q] * R_p, det


def solve_pair(val: torch.Tensor, cells3: torch.Tensor, wa: torch.Tensor, wb: torch.Tensor):
    """The values of a solvable pair from its three residual cells ``val[cells3]`` ([3, B] float64),
    as the C++ decoder computes them: :func:`pair_numerators` divided by ``det``."""
    num_a, num_b, det = pair_numerators(val, cells3, wa, wb)
    return num_a / det, num_b / det


UNIT_ROUNDOFF = 2.0 ** -24


def cell_error_bound(mass: torch.Tensor, deg: torch.Tensor, n: int) -> torch.Tensor:
    """``lhc::cell_error_bound``: the rounding bound ``(deg + n + 2) u M (1 + 2 (deg + n + 2) u)`` of
    each value cell, from its (scaled) aggregated mass and its number of support keys (float64)."""
    m = (deg.to(torch.float64) + n + 2) * UNIT_ROUNDOFF
    return m * mass * (1.0 + 2.0 * m)


def within_rtol(v: torch.Tensor, err: torch.Tensor, rtol: float) -> torch.Tensor:
    """``lhc::within_rtol``: ``err (1 + rtol) + u |v| <= rtol |v|``, which makes the float32 output
    within ``rtol`` of the true sum."""
    a = v.abs()
    return err * (1.0 + rtol) + UNIT_ROUNDOFF * a <= rtol * a


# A key's ancestry (ancestors and itself) is tracked up to this many keys (``lhc::kAncestryCap``);
# a larger one counts as sharing an ancestor with every key.
ANCESTRY_CAP = 256


def cell_members(cells: torch.Tensor) -> dict:
    """``{cell: [keys]}``: the keys (indices into ``cells``, increasing) hashed into each cell."""
    members = {}
    for i, row in enumerate(cells.tolist()):
        for c in row:
            members.setdefault(c, []).append(i)
    return members


def ancestries(cells: torch.Tensor, rounds, members: dict, cap: int = ANCESTRY_CAP) -> list:
    """Each peeled key's ancestry: itself and, transitively, the keys subtracted into its read cell
    before it was read (its parents), as a frozenset; None for a key with more than ``cap`` (and for
    keys not peeled: a solved pair's, whose values two cells give together). A corrupted read cell of
    a key a changes exactly the keys whose ancestry holds a. ``members``: :func:`cell_members`."""
    anc = [None] * cells.shape[0]
    for idx, pj in rounds:
        for k, c in zip(idx.tolist(), cells[idx, pj].tolist()):
            a = {k}
            for p in members[c]:
                if p != k:
                    a = None if anc[p] is None else a | anc[p]
                    if a is None:
                        break
            anc[k] = frozenset(a) if a is not None and len(a) <= cap else None
    return anc


def verification_bound(cells: torch.Tensor, weights: torch.Tensor, rounds, acc: torch.Tensor, val: torch.Tensor,
                       err: torch.Tensor, cap: int = ANCESTRY_CAP) -> torch.Tensor:
    """``F(k) = G(k) - E(k)`` per key (``lhc::verification_bound``): what the cells a key was subtracted
    into prove about its error whatever happened upstream of it. A check cell j (``acc >= 0`` after
    peeling) verifies ``V(j) = acc(j) + max |residual(j)|``; the pure cell of a later key m verifies
    ``|w_j(m)| G(m)``; a solved pair's cells (``acc == -2``) verify nothing; and
    ``G(k) = min_j V(j) / |w_j(k)|`` over the key's two other cells, computed from the last round
    back. A cell counts for k only if none of its keys other than k and its reader shares an
    ancestor with k (:func:`ancestries`; ``lhc::verifies_soundly``): a corrupted word upstream of k
    reaches such a key too, and its error could cancel k's there. ``F`` is rounded up by ``2^-52 G``."""
    inf = float("inf")
    V = torch.full((acc.numel(),), inf, dtype=torch.float64)
    checked = acc >= 0
    V[checked] = acc[checked] + val[checked].abs().amax(dim=1)
    K = cells.shape[0]
    members = cell_members(cells)
    anc = ancestries(cells, rounds, members, cap)
    reader = {}
    for idx, pj in rounds:
        for k, c in zip(idx.tolist(), cells[idx, pj].tolist()):
            reader[c] = k

    def sound(c: int, k: int) -> bool:
        others = [i for i in members[c] if i != k and i != reader.get(c)]
        return not others or (anc[k] is not None and
                              all(anc[i] is not None and anc[i].isdisjoint(anc[k]) for i in others))

    G = torch.full((K,), inf, dtype=torch.float64)
    for idx, pj in reversed(rounds):
        for k, j in zip(idx.tolist(), pj.tolist()):
            g = inf
            for o in range(3):
                c = int(cells[k, o])
                if o != j and sound(c, k):
                    g = min(g, float(V[c]) / abs(float(weights[k, o])))
            G[k] = g
            V[int(cells[k, j])] = abs(float(weights[k, j])) * g
    return (G - err).clamp(min=0.0) + G * 2.0 ** -52
