"""Shared helpers for the codec tests: workload generators, payload aggregation in different float32
orders, the float64 ground truth, and a rigorous error bound for a decoded aggregate.

All randomness comes from ``numpy.random.Generator`` objects seeded by the caller (hypothesis draws
the seeds), so every failure is reproducible from the printed example.
"""
from __future__ import annotations

import os
import subprocess
import sys
import zlib

import numpy as np
import torch

from lossless_hc import LosslessCodec
from lossless_hc.backends import cpu as cpu_backend
from lossless_hc.bench.common import free_port  # noqa: F401  (the tests' launches import it from here)
from lossless_hc.lhc import reference as reference
from lossless_hc.lhc.codec import key_coordinates
from lossless_hc.lhc.contract import outside_bounds
from lossless_hc.lhc.layout import PayloadLayout

U32 = 2.0 ** -24          # unit roundoff of float32 (round to nearest)
PATTERNS = ("random", "identical", "disjoint", "clustered")
DISTS = ("normal", "wide")  # N(0, 1), and +-10**U(-6, 6)


def stable_seed(*parts) -> int:
    """A seed derived from test parameters, identical in every process (``hash`` of a str is not)."""
    return zlib.crc32(repr(parts).encode())


# -- workloads -----------------------------------------------------------------------------------

def supports(rng: np.random.Generator, pattern: str, n: int, num_keys: int, k: int) -> list[np.ndarray]:
    """Per-worker sets of (at most) ``k`` distinct keys in ``[0, num_keys)``, sorted.

    random     every worker draws its own k keys independently
    identical  every worker holds the same k keys
    disjoint   workers hold pairwise disjoint sets (k each while ``n * k <= num_keys``)
    clustered  every worker holds a few contiguous runs of keys, runs drawn around shared centres
               (overlapping partially across workers, like embedding rows of popular items)
    """
    k = max(0, min(k, num_keys))
    if pattern == "random":
        return [np.sort(rng.choice(num_keys, size=k, replace=False)) for _ in range(n)]
    if pattern == "identical":
        keys = np.sort(rng.choice(num_keys, size=k, replace=False))
        return [keys.copy() for _ in range(n)]
    if pattern == "disjoint":
        perm = rng.permutation(num_keys)
        per = min(k, num_keys // max(1, n))
        return [np.sort(perm[w * per:(w + 1) * per]) for w in range(n)]
    if pattern == "clustered":
        centres = rng.integers(0, num_keys, size=max(1, min(4, k)))
        out = []
        for _ in range(n):
            keys: set[int] = set()
            tries = 0
            while len(keys) < k and tries < 64:
                tries += 1
                c = int(rng.choice(centres)) + int(rng.integers(-k, k + 1))
                run = int(rng.integers(1, max(2, k // 2) + 1))
                for key in range(c, c + run):
                    if 0 <= key < num_keys and len(keys) < k:
                        keys.add(key)
            out.append(np.array(sorted(keys), dtype=np.int64))
        return out
    raise ValueError(f"unknown pattern {pattern!r}")


def values(rng: np.random.Generator, dist: str, size) -> np.ndarray:
    """Non-zero float32 values: ``normal`` ~ N(0, 1); ``wide`` = random sign * 10**U(-6, 6)."""
    if dist == "normal":
        v = rng.standard_normal(size)
    elif dist == "wide":
        v = rng.choice([-1.0, 1.0], size=size) * 10.0 ** rng.uniform(-6, 6, size=size)
    else:
        raise ValueError(f"unknown dist {dist!r}")
    v = v.astype(np.float32)
    v[v == 0] = 1.0  # a key in a worker's support must really be non-zero
    return v


def make_inputs(rng: np.random.Generator, numel: int, block: int, n: int, k: int, pattern: str, dist: str,
                zero_lanes: float = 0.0) -> list[torch.Tensor]:
    """``n`` float32 tensors of ``numel`` coordinates, worker w non-zero exactly on the blocks of
    ``supports(...)[w]``. With ``zero_lanes`` > 0 that fraction of the lanes of a non-zero block is
    zeroed (keeping at least one non-zero lane)."""
    num_keys = -(-numel // block)
    xs = []
    for keys in supports(rng, pattern, n, num_keys, k):
        x = np.zeros(num_keys * block, dtype=np.float32)
        blocks = x.reshape(num_keys, block)
        if len(keys):
            vals = values(rng, dist, (len(keys), block))
            if zero_lanes > 0 and block > 1:
                drop = rng.random((len(keys), block)) < zero_lanes
                drop[:, 0] = False
                vals[drop] = 0.0
            # the last block may be partial: its first lane is a real coordinate, keep it non-zero
            blocks[keys] = vals
        xs.append(torch.from_numpy(x[:numel].copy()))
    return xs


def draw_sizes(rng: np.random.Generator, max_n: int = 16, max_numel: int = 1500, max_density: float = 0.4):
    """``(n, numel, density)`` for a random workload: n uniform in 1..max_n, numel uniform in
    1..max_numel, density log-uniform in [0.002, max_density] (0 in one case of 20).

    Tests draw these from a hypothesis-seeded numpy generator rather than from hypothesis integers:
    derandomized hypothesis with a few dozen examples otherwise spends most of them at the
    boundaries (one worker, no keys), which dedicated tests cover explicitly."""
    n = int(rng.integers(1, max_n + 1))
    numel = int(rng.integers(1, max_numel + 1))
    density = 0.0 if rng.random() < 0.05 else float(np.exp(rng.uniform(np.log(0.002), np.log(max_density))))
    return n, numel, density


def colliding_pairs(table, count: int) -> tuple[list, list]:
    """``(solvable, proportional)``: the pairs ``(a, b)``, ``a < b``, of ids in ``[0, count)`` that
    ``table`` hashes to the same three cells, split by whether their weight columns are proportional
    (``wa[j] wb[0] == wa[0] wb[j]`` for every j: an integer test, independent of
    ``reference.pair_cells``). Such a pair cannot be peeled; the decoders solve the solvable ones."""
    cells, weights = reference.key_cells(table, torch.arange(count))
    _, pairs = shared_cells(cells.numpy())
    weights = weights.numpy().astype(np.int64)
    wa, wb = weights[pairs[:, 0]], weights[pairs[:, 1]]
    prop = (wa[:, 1:] * wb[:, :1] == wa[:, :1] * wb[:, 1:]).all(axis=1)
    return [tuple(p) for p in pairs[~prop].tolist()], [tuple(p) for p in pairs[prop].tolist()]


def shared_cells(cells: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For rows of ``cells`` (a key's three cells each): how many rows have each row's three cells, and
    the pairs ``(a, b)``, ``a < b``, of rows whose cells exactly one other row has, ordered by cells."""
    _, triple, count = np.unique(cells, axis=0, return_inverse=True, return_counts=True)
    triple = triple.reshape(-1)
    two = np.nonzero(count[triple] == 2)[0]
    return count[triple], two[np.argsort(triple[two], kind="stable")].reshape(-1, 2)


def nonzero_keys(x: torch.Tensor, block: int) -> np.ndarray:
    """Keys (blocks) of ``x`` with a non-zero coordinate, as a sorted int64 array."""
    flat = x.reshape(-1).to(torch.float64).numpy()
    num_keys = -(-flat.size // block)
    pad = np.zeros(num_keys * block)
    pad[: flat.size] = flat
    return np.nonzero((pad.reshape(num_keys, block) != 0).any(axis=1))[0]


# -- aggregation -----------------------------------------------------------------------------------

def sum_payloads(payloads: list[torch.Tensor], rng: np.random.Generator, how: str = "sequential") -> torch.Tensor:
    """Element-wise float32 SUM of ``payloads`` in a random order:
    ``sequential`` (a ring: one running sum), ``tree`` (pairwise, random pairing), ``stack``
    (``torch.stack(...).sum(0)``, whatever order torch's reduction uses)."""
    order = list(rng.permutation(len(payloads)))
    ps = [payloads[i] for i in order]
    if how == "sequential":
        acc = ps[0].clone()
        for p in ps[1:]:
            acc = acc + p
        return acc
    if how == "tree":
        while len(ps) > 1:
            rng.shuffle(ps)
            nxt = [ps[i] + ps[i + 1] for i in range(0, len(ps) - 1, 2)]
            if len(ps) % 2:
                nxt.append(ps[-1])
            ps = nxt
        return ps[0].clone()
    if how == "stack":
        return torch.stack(ps).sum(dim=0)
    raise ValueError(how)


def average_payloads(summed: torch.Tensor, n: int, how: str = "divide") -> torch.Tensor:
    """What an AVERAGE allreduce delivers: ``sum / n`` in float32 (``divide``) or ``sum * fl(1/n)``
    (``reciprocal``, as engines that pre-scale do)."""
    if how == "divide":
        return summed / n
    if how == "reciprocal":
        return summed * torch.tensor(1.0 / n, dtype=torch.float32)
    raise ValueError(how)


def dense_sum64(xs: list[torch.Tensor]) -> torch.Tensor:
    """The ground truth: the float64 sum of the (float32) inputs, flattened."""
    acc = torch.zeros(xs[0].numel(), dtype=torch.float64)
    for x in xs:
        acc += x.reshape(-1).to(torch.float64)
    return acc


# -- the error bound -----------------------------------------------------------------------------

def peel_error_bound(layout: PayloadLayout, xs: list[torch.Tensor], trace, n_payloads: int) -> torch.Tensor:
    """A rigorous bound on ``|decoded - exact sum|`` per coordinate (before the final rounding of the
    output to float32), following the decoder's actual peeling order.

    A sketch cell c of the aggregated payload is a float32 sum: each worker adds its deg_w(c) <= deg(c)
    terms w_key(c) x_w[key] sequentially (exact products: weights +-1, +-2; deg_w - 1 roundings), then
    the engine adds n worker cells in some order (a summation tree of height <= n - 1). With M(c) = sum
    over workers and over support keys in c of |w_key(c)| |x_w[key]| (per lane), the cell's error is
    at most gamma_{deg + n - 2} M(c) (Higham, Thm 4.4 applied twice; gamma_m = m u / (1 - m u)). We use
    ``eps_c = (deg + n + 2) u M(c)``: the extra 4 u M covers the second-order terms, an AVERAGE's
    division or reciprocal multiplication (<= 2 u + u^2 relative), and the float64 peeling arithmetic
    (relative 2^-53 per operation, << u).

    A key k peeled from cell c reads c minus the (already peeled) weighted estimates of the other
    support keys of c, divided by its own weight (exact), so
    ``E(k) = (eps_c + sum_{B in c, B != k} |w_B(c)| E(B)) / |w_k(c)|``. This function *requires* every
    such B to have been peeled before k (otherwise the decoder's trace is not a valid peeling order)
    and that c is one of k's cells.

    A key of a solved pair (its partner o shares all three cells and was unresolved when the pair was
    solved; see ``sizing.sketch_table_for``) is ``(w_q(o) R_p - w_p(o) R_q) / det`` up to sign, with
    cells p, q and det from ``reference.pair_cells``, so its error is at most
    ``(|w_q(o)| ex_p + |w_p(o)| ex_q) / |det|`` with ``ex_x = eps_x + sum_{B in x, B not in pair}
    |w_B(x)| E(B)``, again requiring every such B peeled before (the division's own rounding is in
    float64, covered by the margin of eps).
    Returns the bound per coordinate (float64, numel), 0 outside the support.
    """
    L = layout
    B = L.block
    num_keys = L.num_keys
    absx = np.zeros((num_keys, B))
    for x in xs:
        a = np.zeros(num_keys * B)
        a[: L.numel] = np.abs(x.reshape(-1).to(torch.float64).numpy())
        absx += a.reshape(num_keys, B)
    support = np.nonzero((absx != 0).any(axis=1))[0]
    cells, weights = reference.key_cells(L.sketch, torch.from_numpy(support))
    cells, weights = cells.numpy().astype(np.int64), weights.numpy().astype(np.int64)
    wabs = np.abs(weights)
    C = L.sketch.cells
    M = np.zeros((C, B))
    deg = np.zeros(C, dtype=np.int64)
    for j in range(3):
        np.add.at(M, cells[:, j], wabs[:, j:j + 1] * absx[support])
        np.add.at(deg, cells[:, j], 1)
    eps = (deg + n_payloads + 2)[:, None] * U32 * M

    # The trace as support indices s (support[s] is the key), checked.
    tk = np.asarray(trace[0], dtype=np.int64).reshape(-1)
    tc = np.asarray(trace[1], dtype=np.int64).reshape(-1)
    s = np.minimum(np.searchsorted(support, tk), max(len(support) - 1, 0))
    held = support[s] == tk if len(support) else np.zeros(len(tk), dtype=bool)
    assert held.all(), f"trace peels key {tk[~held][0]}, which no worker holds"
    seen, first = np.unique(s, return_index=True)
    if len(seen) < len(s):
        again = np.setdiff1d(np.arange(len(s)), first)[0]
        raise AssertionError(f"trace peels key {tk[again]} twice")
    read_j = (cells[s] == tc[:, None])
    bad = ~read_j.any(axis=1)
    assert not bad.any(), f"key {tk[bad][0]} peeled from cell {tc[bad][0]}, not one of its cells"
    read_j = read_j.argmax(axis=1)
    order = np.full(len(support), np.iinfo(np.int64).max)  # trace position of each support key
    order[s] = np.arange(len(s))

    # The members of every cell, in support order (CSR): member[start[c]:start[c + 1]] and their
    # |weight| there.
    flat_cell = cells.reshape(-1)
    by_cell = np.argsort(flat_cell, kind="stable")
    member = by_cell // 3
    member_w = wabs.reshape(-1)[by_cell]
    start = np.zeros(C + 1, dtype=np.int64)
    np.add.at(start, flat_cell + 1, 1)
    start = np.cumsum(start)
    # Keys sharing all three cells (a pair's partner): the other key of a triple held by two.
    sharing, pairs = shared_cells(cells)
    many = sharing[s] > 2
    assert not many.any(), f"key {tk[many][0]} shares its cells with more than one key: not a pair"
    partner = np.full(len(support), -1)
    partner[pairs[:, 0]], partner[pairs[:, 1]] = pairs[:, 1], pairs[:, 0]

    # Rows: a peeled key's read cell; a pair key's three cells (its partner left out of each). A row's
    # value is eps of its cell plus |w| E(other) over its cell's other members, in support order.
    is_pair = partner[s] >= 0
    row_t = np.concatenate([np.nonzero(~is_pair)[0], np.repeat(np.nonzero(is_pair)[0], 3)])
    row_j = np.concatenate([read_j[~is_pair], np.tile(np.arange(3), int(is_pair.sum()))])
    order_rows = np.lexsort((row_j, row_t))
    row_t, row_j = row_t[order_rows], row_j[order_rows]   # by trace position, then segment
    row_key = s[row_t]
    row_cell = cells[row_key, row_j]
    counts = start[row_cell + 1] - start[row_cell]
    edge_row = np.repeat(np.arange(len(row_t)), counts)
    offsets = np.arange(len(edge_row)) - np.repeat(np.cumsum(counts) - counts, counts)
    at = np.repeat(start[row_cell], counts) + offsets
    edge_dep, edge_w = member[at], member_w[at]
    keep = (edge_dep != row_key[edge_row]) & (edge_dep != partner[row_key][edge_row])
    edge_row, edge_dep, edge_w = edge_row[keep], edge_dep[keep], edge_w[keep]
    late = order[edge_dep] > row_t[edge_row]
    if late.any():
        r = edge_row[late][0]
        key, other, cell = support[row_key[r]], support[edge_dep[late][0]], row_cell[r]
        if is_pair[row_t[r]]:
            raise AssertionError(f"pair ({key}, {support[partner[row_key[r]]]}) solved while key {other} of cell "
                                 f"{cell} was still unresolved")
        raise AssertionError(f"key {key} peeled from cell {cell} while key {other} of that cell was still "
                             "unresolved: the cell was not pure")

    # Each trace position's depth: 1 + the largest depth of the keys it depends on (all peeled before
    # it); the positions of one depth are computed together, row values in the loop's order.
    edge_t, dep_t = row_t[edge_row], order[edge_dep]
    depth = np.zeros(len(s), dtype=np.int64)
    while True:
        new = np.zeros_like(depth)
        np.maximum.at(new, edge_t, depth[dep_t] + 1)
        if np.array_equal(new, depth):
            break
        depth = new
    E = np.zeros((len(support), B))
    row_depth = depth[row_t]
    edge_depth = depth[edge_t]
    rows_by_depth = np.argsort(row_depth, kind="stable")
    edges_by_depth = np.argsort(edge_depth, kind="stable")
    row_bounds = np.searchsorted(row_depth[rows_by_depth], np.arange(depth.max(initial=0) + 2))
    edge_bounds = np.searchsorted(edge_depth[edges_by_depth], np.arange(depth.max(initial=0) + 2))
    local = np.empty(len(row_t), dtype=np.int64)  # a row's index among the rows of its depth
    local[rows_by_depth] = np.arange(len(row_t)) - row_bounds[row_depth[rows_by_depth]]
    pair_rows = {}
    for d in range(len(row_bounds) - 1):
        rows = rows_by_depth[row_bounds[d]:row_bounds[d + 1]]
        edges = edges_by_depth[edge_bounds[d]:edge_bounds[d + 1]]
        acc = eps[row_cell[rows]].copy()
        np.add.at(acc, local[edge_row[edges]], edge_w[edges][:, None] * E[edge_dep[edges]])
        single = ~is_pair[row_t[rows]]
        keys = row_key[rows[single]]
        E[keys] = acc[single] / wabs[keys, row_j[rows[single]]][:, None]
        for i in np.nonzero(~single)[0]:
            pair_rows.setdefault(int(row_key[rows[i]]), {})[int(row_j[rows[i]])] = acc[i]
        for k in {int(row_key[rows[i]]) for i in np.nonzero(~single)[0]}:
            o = int(partner[k])
            p, q, det = reference.pair_cells(weights[k].tolist(), weights[o].tolist())
            assert det != 0, f"pair ({support[k]}, {support[o]}) has proportional weights: it cannot have been solved"
            ex = pair_rows[k]
            E[k] = (abs(int(weights[o, q])) * ex[p] + abs(int(weights[o, p])) * ex[q]) / abs(det)
    out = np.zeros((num_keys, B))
    out[support[s]] = E[s]
    return torch.from_numpy(out.reshape(-1)[: L.numel].copy())


INEXACT = 6   # DecodeStatus.INEXACT (csrc/lhc_status.h)


def inexact_keys_of(report) -> torch.Tensor:
    """The report's inexact keys: a DecodeReport's, or a reference info dict's."""
    if isinstance(report, dict):
        return report["inexact_keys"]
    keys = getattr(report, "inexact_keys", None)
    return keys if keys is not None else torch.zeros(0, dtype=torch.int64)


def peeled_ok(report) -> bool:
    """ok, or INEXACT: every key recovered, some of them (``inexact_keys``) not provably within rtol."""
    if isinstance(report, dict):
        return report["ok"] or report["reason"] == "inexact"
    return bool(report.ok) or int(getattr(report, "status", -1)) == INEXACT or getattr(report, "reason", "") == "inexact"


def assert_contract(layout: PayloadLayout, xs: list[torch.Tensor], y: torch.Tensor, inexact_keys: torch.Tensor,
                    rtol: float, *, averaged: bool = False) -> None:
    """The decoder's contract: every coordinate of every key outside ``inexact_keys`` is within
    ``rtol`` of the float64 sum (relative), and keys zero in the sum are exact zeros. The float64 sum
    of float32 inputs is itself rounded (by at most n 2^-53 of their mass): that much is allowed."""
    B = layout.block
    ref = dense_sum64(xs) * (1.0 / layout.world_size if averaged else 1.0)
    mass = sum(x.reshape(-1).abs().to(torch.float64) for x in xs)
    yf = y.reshape(-1).to(torch.float64)
    key_of = torch.arange(layout.numel) // B
    covered = ~torch.isin(key_of, inexact_keys)
    tol = rtol * ref.abs() + len(xs) * 2.0 ** -52 * mass
    bad = covered & ((yf - ref).abs() > tol)
    assert not bool(bad.any()), (f"{int(bad.sum())} coordinates outside rtol={rtol} and not reported inexact; "
                                 f"first at {bad.nonzero()[:5].reshape(-1).tolist()}: y={yf[bad][:5].tolist()} "
                                 f"ref={ref[bad][:5].tolist()}")


def assert_error_bounds(layout: PayloadLayout, ref: torch.Tensor, mass: torch.Tensor, y: torch.Tensor, error_bounds,
                        truth_keys, trace_bound: torch.Tensor) -> None:
    """The decoder's own bounds (``DecodeReport.error_bounds``) are sound: they list exactly the true
    support keys, sorted; every coordinate of key k is within E(k) of the float64 truth ``ref``
    (absolute mass ``mass``) as the contract's :func:`~lossless_hc.lhc.contract.outside_bounds`
    judges (E(k) before the output's rounding, then that rounding); and E(k) is at least
    ``trace_bound`` (:func:`peel_error_bound`, per coordinate) on each of k's coordinates. That bound
    follows the same recursion over the same peeling order from the inputs' exact masses; the
    decoder's cell masses are float32 sums inflated past their rounding (at least the exact ones, and
    a key's is its largest lane's) and every bound it stores is rounded up, so it can only be larger.
    Being a bound, the first check alone would miss an E(k) a few times too small (measured errors
    stay below a quarter of E); this one does not."""
    keys, E = error_bounds
    assert keys.dtype == torch.int64 and E.dtype == torch.float64
    assert keys.tolist() == sorted(truth_keys), "error_bounds lists other keys than the support"
    assert bool((E >= 0).all()), "an error bound is negative or NaN"
    bad = outside_bounds(y, ref, mass, layout.world_size, error_bounds, layout.block)
    if bool(bad.any()):
        i = int(bad.nonzero()[0])
        key = i // layout.block
        raise AssertionError(f"{int(bad.sum())} coordinates outside their decoder-reported bound; e.g. coordinate {i}: "
                             f"y = {float(y.reshape(-1)[i])!r}, ref = {float(ref[i])!r}, "
                             f"E = {float(E[int(torch.searchsorted(keys, key))])!r}")
    coords, rows = key_coordinates(keys, layout.block, layout.numel)
    Ec = E[rows]
    low = Ec < trace_bound[coords] * (1 - 2.0 ** -40)
    assert not bool(low.any()), (f"{int(low.sum())} coordinates with a reported bound below the trace's; e.g. "
                                 f"coordinate {int(coords[low][0])}: E = {Ec[low][0].item()!r} < "
                                 f"{trace_bound[coords][low][0].item()!r}")


def assert_lossless(layout: PayloadLayout, xs: list[torch.Tensor], y: torch.Tensor, report, *,
                    averaged: bool = False, strict_support: bool = True) -> None:
    """Check a decoded aggregate against the float64 truth with the rigorous trace bound.

    * ``report.ok`` (or INEXACT) and the trace covers exactly the union of the workers' non-zero keys;
    * the contract (:func:`assert_contract`) with the codec's default rtol, where the report
      carries ``inexact_keys``;
    * keys that are zero in the truth are exact zeros in ``y`` (the generators never cancel exactly);
    * ``|y - ref| <= E + u |ref| + 1e-30`` per coordinate (E from ``peel_error_bound``; u |ref| is
      the final rounding of the output to float32);
    * where the report carries ``error_bounds``, those too (:func:`assert_error_bounds`);
    * with ``strict_support`` every key non-zero in the truth is non-zero in ``y``. Without it this
      is required only where the bound rules out an exact zero (values spanning 12 decades can be
      swallowed by a large cell-mate: 1e6 + 1e-6 == 1e6 in float32).
    """
    n = layout.world_size
    assert peeled_ok(report), report.reason
    ref = dense_sum64(xs)
    scale = 1.0 / n if averaged else 1.0
    ref = ref * scale
    yf = y.reshape(-1).to(torch.float64)
    block = layout.block

    truth_keys = set(np.unique(np.concatenate([nonzero_keys(x, block) for x in xs] + [np.zeros(0, np.int64)]))
                     .tolist())
    if layout.index_kind != "dense":
        tk, _ = report.trace
        assert sorted(tk.tolist()) == sorted(truth_keys), "decoder peeled a different key set than the union"
        assert report.support == len(truth_keys)
        E = peel_error_bound(layout, xs, report.trace, n) * scale
    else:
        # dense: one float32 sum per coordinate, n - 1 roundings (+ the average's <= 2)
        E = (n + 2) * U32 * sum(x.reshape(-1).abs().to(torch.float64) for x in xs) * scale

    tol = E + U32 * ref.abs() + 1e-30
    if getattr(report, "error_bounds", None) is not None:
        mass = sum(x.reshape(-1).abs().to(torch.float64) for x in xs) * scale
        assert_error_bounds(layout, ref, mass, y, report.error_bounds, truth_keys, E)

    err = (yf - ref).abs()
    bad = err > tol
    assert not bool(bad.any()), (f"{int(bad.sum())} coordinates outside the bound; worst at "
                                 f"{int((err - tol).argmax())}: y={yf[(err - tol).argmax()].item()!r} "
                                 f"ref={ref[(err - tol).argmax()].item()!r} bound={tol[(err - tol).argmax()].item()!r}")

    num_keys = layout.num_keys
    pad = lambda t: torch.cat([t, torch.zeros(num_keys * block - t.numel(), dtype=t.dtype)]).reshape(num_keys, block)
    ref_nz = (pad(ref) != 0).any(dim=1)
    y_nz = (pad(yf) != 0).any(dim=1)
    assert not bool((y_nz & ~ref_nz).any()), "a key that is zero in the dense sum is non-zero in the output"
    missing = ref_nz & ~y_nz
    inexact = inexact_keys_of(report)
    if layout.index_kind != "dense" and hasattr(report, "inexact_keys"):
        from lossless_hc.lhc.codec import DEFAULT_RTOL
        assert_contract(layout, xs, y, inexact, DEFAULT_RTOL, averaged=averaged)
    if inexact.numel():
        missing[inexact] = False   # reported, not claimed
    if strict_support:
        assert not bool(missing.any()), "a key that is non-zero in the dense sum decoded to exact zeros"
    else:
        # an all-zero decode is only acceptable where the bound allows every lane to be zero
        could_be_zero = (pad(ref).abs() <= pad(tol)).all(dim=1)
        assert not bool((missing & ~could_be_zero).any()), "a key decoded to zeros although the bound forbids it"


def assert_mean_of_decodes_unbiased(decode_once, truth: torch.Tensor, trials: int) -> None:
    """Unbiasedness smoke test of a randomised codec: ``decode_once(t)`` decodes the same inputs with
    independent randomness (seed t) and returns the estimate of ``truth``. If the estimator is
    unbiased with per-trial squared error E, the mean of ``trials`` estimates has expected squared
    error E / trials; allow twice that."""
    acc = torch.zeros_like(truth, dtype=torch.float64)
    errs = []
    for t in range(trials):
        y = decode_once(t).double().cpu()
        errs.append(float((y - truth).pow(2).sum()))
        acc += y
    mean_err = float((acc / trials - truth).pow(2).sum())
    assert mean_err <= 2.0 * (sum(errs) / trials) / trials


def emulated_cluster_skip_reason(horovod: bool = False):
    """Why the emulated cluster (``bench cluster``/``bench tta``) cannot run here, or None: it needs root,
    ``ip netns`` and, for Horovod modes, Horovod. Probes by adding and deleting one namespace."""
    if os.geteuid() != 0:
        return "needs root (network namespaces, veth, tc)"
    if horovod:
        try:
            import horovod.torch  # noqa: F401
        except ImportError:
            return "needs Horovod"
    name = f"lhcc{os.getpid()}probe"
    res = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    if res.returncode != 0:
        return f"`ip netns add` fails here: {res.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return None


def run_python(code: str, **env: str) -> subprocess.CompletedProcess:
    """``python -c code`` in a fresh process (settings read at start-up, such as ``LHC_CPU_ISA``, take effect
    there), importing this checkout's lossless_hc (run from the package's root), with ``env`` over this
    process's environment; stdout and stderr captured as text."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(cpu_backend.__file__)))   # .../lossless_hc
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          cwd=os.path.dirname(package), env=dict(os.environ, **env))


def codec_for(layout):
    """A LosslessCodec running an explicit (e.g. several-level) multilevel layout."""
    c = LosslessCodec(layout.numel, layout.world_size, layout.capacity * layout.block, block_size=layout.block,
                      seed=layout.seed, index="bitmap")
    c.layout = layout
    c._native = cpu_backend.CpuLhcLayout(layout)
    return c
