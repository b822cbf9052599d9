"""The CPU kernels' checks at their exact thresholds, on payloads small enough to work out by hand:
each case sits one step on either side of a bound, so a check that is looser or tighter than the
contract's (csrc/lhc_layout.h, reference.decode) changes a verdict here."""
import numpy as np
import pytest
import torch

import helpers
from lossless_hc import LosslessCodec
from lossless_hc.lhc import reference
from lossless_hc.lhc import reference_peel as rp
from lossless_hc.lhc.reference_peel import UNIT_ROUNDOFF, pair_cells
from lossless_hc.lhc.status import DecodeStatus


def round_up_to_float(x: float) -> float:
    """lhc::round_up_to_float: the smallest float32 >= x (x >= 0)."""
    f = np.float32(x)
    return float(f if float(f) >= x else np.nextafter(f, np.float32(np.inf)))


def cell_error_bound(mass: float, deg: int, n: int) -> float:
    m = (deg + n + 2) * UNIT_ROUNDOFF
    return m * mass * (1.0 + 2.0 * m)


def one_key_payload(key: int, verify: bool):
    """A 64-coordinate codec for one rank (bitmap index) and its payload of the single value 1.0 at ``key``."""
    codec = LosslessCodec(64, 1, 4, index="bitmap", seed=3, verify=verify)
    x = torch.zeros(64)
    x[key] = 1.0
    return codec, codec.encode(x)


@pytest.mark.parametrize("verify", [False, True])
def test_residual_check_rejects_one_ulp_past_a_check_cell_bound(verify):
    """One key of value 1.0 on one rank: it is read from one of its cells; each of the other two must
    hold w x within acc = round_up(cell bound + |w| E(k)) after the key is subtracted. Moving that cell
    by d units in the last place is OK while d ulp <= acc and SKETCH_CORRUPT from the first d above it
    (with or without verify: both run the same check)."""
    key = 17
    codec, payload = one_key_payload(key, verify)
    L = codec.layout
    _, rep = codec.decode(payload.clone(), trace=True)
    assert rep.ok and rep.trace[0].tolist() == [key]
    read = int(rep.trace[1][0])
    cells, weights = reference.key_cells(L.sketch, torch.tensor([key]))
    cells, weights = cells[0].tolist(), weights[0].tolist()
    w_read = abs(weights[cells.index(read)])
    err = round_up_to_float(cell_error_bound(w_read, 1, 1)) / w_read  # E(k): exact (w is a power of 2)
    tested = 0
    for c, w in zip(cells, weights):
        if c == read:
            continue
        acc = round_up_to_float(round_up_to_float(cell_error_bound(abs(w), 1, 1)) + abs(w) * err)
        value = payload[L.sketch_offset + c].item()
        assert value == w
        ulp = abs(w) * 2.0 ** -23
        for d in range(1, 12):
            p = payload.clone()
            p[L.sketch_offset + c] = value + d * ulp * (1 if w > 0 else -1)
            assert abs(p[L.sketch_offset + c].item() - value) == d * ulp  # exactly representable
            _, rep = codec.decode(p)
            expect = DecodeStatus.SKETCH_CORRUPT if d * ulp > acc else DecodeStatus.OK
            assert rep.status == expect, (c, d, d * ulp / acc, rep.reason)
            tested += d * ulp > acc
    assert tested > 0


@pytest.mark.parametrize("verify", [False, True])
def test_a_value_in_a_cell_without_keys_is_corrupt(verify):
    """A cell no support key hashes to has mass 0 and bound 0: any non-zero value there (even the
    smallest subnormal) is SKETCH_CORRUPT, as in reference.decode (its check covers acc >= 0)."""
    key = 17
    codec, payload = one_key_payload(key, verify)
    L = codec.layout
    cells, _ = reference.key_cells(L.sketch, torch.tensor([key]))
    empty = [c for c in range(L.sketch.cells) if c not in cells[0].tolist()]
    assert empty and all(payload[L.mass_offset + c].item() == 0.0 for c in empty)
    for c in empty:
        for v in (1.0, -2.0 ** -149):
            p = payload.clone()
            p[L.sketch_offset + c] = v
            _, rep = codec.decode(p)
            assert rep.status == DecodeStatus.SKETCH_CORRUPT, (c, v, rep.reason)
            _, info = reference.decode(L, p, verify=verify)
            assert not info["ok"] and info["reason"].startswith("sketch corrupt"), (c, v, info["reason"])


def test_verification_bound_counts_a_check_cell_residual():
    """With verify, a check cell verifies a key with V = acc + |residual| (lhc::verification_bound):
    a residual within acc (not corrupt) still widens F(k) = G(k) - E(k). One key of 1.0 and rtol
    2^-21: untouched, E and F are ~2^-22 and the key is OK; with both check cells 3 ulps off (acc is
    ~4 ulps), F is ~2.5 * 2^-22, past rtol: INEXACT with that key, as reference.decode says."""
    numel, key, rtol = 64, 17, 2.0 ** -21
    codec = LosslessCodec(numel, 1, 4, index="bitmap", seed=3, verify=True, rtol=rtol)
    L = codec.layout
    x = torch.zeros(numel)
    x[key] = 1.0
    payload = codec.encode(x)
    _, rep = codec.decode(payload.clone(), trace=True)
    assert rep.ok, rep.reason
    read = int(rep.trace[1][0])
    cells, weights = reference.key_cells(L.sketch, torch.tensor([key]))
    p = payload.clone()
    for c, w in zip(cells[0].tolist(), weights[0].tolist()):
        if c != read:
            p[L.sketch_offset + c] += 3 * w * 2.0 ** -23   # 3 ulps, away from 0
    y, rep = codec.decode(p)
    assert rep.status == DecodeStatus.INEXACT and rep.inexact_keys.tolist() == [key], rep.reason
    assert float(y[key]) == 1.0
    _, info = reference.decode(L, p, rtol=rtol, verify=True)
    assert info["reason"] == "inexact" and info["inexact_keys"].tolist() == [key]


def test_a_solved_pair_s_third_cell_is_checked_within_the_pair_s_bounds():
    """After a pair is solved from cells p and q, its third cell r must hold w_r(a) v_a + w_r(b) v_b
    within acc(r) = round_up(r's own bound + |w_r(a)| E(a) + |w_r(b)| E(b)). Values 1 and 3 make every
    sum exact (the residual is 0): moving cell r by d ulps is OK while d ulp <= acc(r) and
    SKETCH_CORRUPT beyond, where acc(r) counts the pair's bounds E(a), E(b) (the report's)."""
    codec = LosslessCodec(4000, 1, 8, index="bitmap", seed=11)
    L = codec.layout
    solvable, _ = helpers.colliding_pairs(L.sketch, L.num_keys)
    cells, weights = reference.key_cells(L.sketch, torch.arange(L.num_keys))
    widened = 0
    for a, b in solvable[:3]:
        x = torch.zeros(L.numel)
        x[a], x[b] = 1.0, 3.0
        payload = codec.encode(x)
        y, rep = codec.decode(payload.clone(), error_bounds=True)
        assert rep.ok and float(y[a]) == 1.0 and float(y[b]) == 3.0, rep.reason
        keys, bounds = rep.error_bounds
        ea, eb = float(bounds[keys == a]), float(bounds[keys == b])
        wa, wb = weights[a].tolist(), weights[b].tolist()
        p, q, _ = pair_cells(wa, wb)
        r = 3 - p - q
        c = int(cells[a, r])
        value = payload[L.sketch_offset + c].item()
        assert value == wa[r] * 1.0 + wb[r] * 3.0 != 0.0
        own = round_up_to_float(cell_error_bound(payload[L.mass_offset + c].item(), 2, 1))
        acc = round_up_to_float(own + abs(wa[r]) * ea + abs(wb[r]) * eb)
        ulp = float(np.spacing(np.float32(abs(value))))
        for d in range(1, 40):
            p_ = payload.clone()
            p_[L.sketch_offset + c] = value + np.sign(value) * d * ulp
            assert abs(p_[L.sketch_offset + c].item() - value) == d * ulp
            _, rep = codec.decode(p_)
            expect = DecodeStatus.SKETCH_CORRUPT if d * ulp > acc else DecodeStatus.OK
            assert rep.status == expect, ((a, b), d, d * ulp / acc, rep.reason)
            widened += own < d * ulp <= acc
    assert widened > 0


@pytest.fixture(scope="module")
def fan_in_codec():
    """A verify codec with one three-segment sketch of 512 cells a segment (1,000 planned keys) over
    600,000 keys, so that ~1,200 keys hash to each cell, and every key's cells."""
    codec = LosslessCodec(600_000, 1, 1000, index="bitmap", seed=0, verify=True)
    assert (codec.layout.sketch.seg_count, codec.layout.sketch.seg_len) == (3, 512)
    cells, _ = reference.key_cells(codec.layout.sketch, torch.arange(codec.layout.num_keys))
    return codec, cells.numpy()


def _picker(cells: np.ndarray):
    """``pick(want, candidates=None)``: a key not chosen yet whose cells in the segments of ``want`` are
    the cells named there and whose other cells no chosen key holds; it is appended to the returned
    list ``chosen`` and its cells are marked held. Returns ``pick, chosen``."""
    used = np.zeros(int(cells.max()) + 1, dtype=bool)
    chosen = []

    def pick(want: dict, candidates=None):
        if candidates is None:
            ok = np.ones(len(cells), dtype=bool)
            for j, c in want.items():
                ok &= cells[:, j] == c
            candidates = np.flatnonzero(ok)
        for key in candidates:
            free = [j for j in range(3) if j not in want]
            if not used[cells[key, free]].any() and key not in chosen:
                used[cells[key]] = True
                chosen.append(int(key))
                return int(key), cells[key]
        raise AssertionError(f"no key with cells {want} and its other cells free")

    return pick, chosen


def _layer_one(pick, j: int, cell: int, candidates=None) -> int:
    """A key whose segment-j cell is ``cell`` and whose two other cells each hold a root (a key whose
    other cells are its own): it is read in layer 1 from the lower of those two, with that cell's root
    as its one parent (ancestry: 2 keys). Picks the key, then the roots."""
    key, Q = pick({j: cell}, candidates)
    for s in range(3):
        if s != j:
            pick({s: Q[s]})
    return key


def fan_in_support(cells: np.ndarray, roots: int):
    """Keys whose cells make the peel below (segment s of a key is its cell in sub-table s; every cell not
    named holds one key only). Key p shares its segment-1 cell C with ``roots`` keys, whose other cells are
    their own: they peel first, then p from C (its other cells hold a key of the first layer, b, and k), so
    p's ancestry is itself and the roots. Key k shares its segment-0 cell with p alone and is read from it
    next, with one parent, p; its two other cells each hold a key q of layer 1 (read from a segment-0
    cell it shares with a root), which is not their reader, so they check k (and q) while neither
    ancestry holds the other's keys. Returns p, k and an input of value 1 at the roots, 64 at the other
    keys, 0 elsewhere."""
    pick, chosen = _picker(cells)
    p, (E, C, D2) = pick({})
    k, (_, K1, K2) = pick({0: E})
    pick({2: D2})                                   # b: a root
    for j, K in ((1, K1), (2, K2)):                 # q, read from Q[0] once its root there is gone
        _layer_one(pick, j, K)
    in_C = np.flatnonzero(cells[:, 1] == C)
    for _ in range(roots):
        pick({1: C}, in_C)
    x = torch.zeros(len(cells))
    x[chosen] = 1.0
    x[chosen[:9]] = 64.0        # p, k and their partners: within rtol beside the roots' masses in C
    return p, k, x


def fan_in_pairs_support(cells: np.ndarray, singles: int, pairs: int):
    """A fan-in through parents of ancestry 2: key p shares its segment-0 cell C with ``singles`` roots
    (their other cells their own: layer 0) and ``pairs`` keys r of layer 1 (each read from its
    segment-1 cell, which it shares with a root r0; _layer_one). Each of p's two other cells holds a key
    b of layer 1 too, so all three of p's cells are pure at the start of layer 2 and p is read from C,
    the lowest: its parents are the singles and the r (``singles + pairs`` of them), its ancestry p,
    the singles, the r and their r0, ``1 + singles + 2 pairs`` keys. The b's cells that p shares are
    check cells holding p and b alone, whose ancestries are disjoint, so they verify p while its
    ancestry is within kAncestryCap. Returns p and an input of value 64 at p, the b's and their roots,
    1 at the other keys, 0 elsewhere."""
    pick, chosen = _picker(cells)
    p, (C, P1, P2) = pick({})
    for j, P in ((1, P1), (2, P2)):
        _layer_one(pick, j, P)
    in_C = np.flatnonzero(cells[:, 0] == C)
    for _ in range(pairs):
        _layer_one(pick, 0, C, in_C)
    for _ in range(singles):
        pick({0: C}, in_C)
    x = torch.zeros(len(cells))
    x[chosen] = 1.0
    x[chosen[:7]] = 64.0        # p and the b's: within rtol beside the masses in C
    return p, x


def test_verify_keeps_an_ancestry_of_exactly_the_cap(fan_in_codec):
    """lhc_ancestry.h tracks an ancestry of up to kAncestryCap = 256 keys; a larger one counts as
    meeting every key, so that key's check cells verify neither it nor their other keys. With 254 roots
    k's ancestry is exactly 256 keys through one parent (p: 255): k is verified by its check cells (OK);
    the C++ verify pass lists what reference.decode (with Python sets) lists. (More roots put more than
    kMaxCellDegree keys in p's cell, which no backend peels: the test below.)"""
    roots = 254
    codec, cells = fan_in_codec
    L = codec.layout
    p, k, x = fan_in_support(cells, roots)
    payload = codec.encode(x)
    support = torch.nonzero(x).reshape(-1)
    sc, _ = reference.key_cells(L.sketch, support)
    rounds, resolved = rp.peel_rounds(sc, L.sketch.cells)
    anc = rp.ancestries(sc, rounds, rp.cell_members(sc), cap=10**6)
    at = {int(key): i for i, key in enumerate(support)}
    assert bool(resolved.all()) and len(rounds) == 3
    assert (len(anc[at[p]]), len(anc[at[k]])) == (roots + 1, roots + 2)
    assert anc[at[k]] == anc[at[p]] | {at[k]}        # one parent, p
    over = sorted(key for key in (p, k) if len(anc[at[key]]) > rp.ANCESTRY_CAP)
    y, rep = codec.decode(payload)
    _, info = reference.decode(L, payload, verify=True)
    assert rep.inexact_keys.tolist() == info["inexact_keys"].tolist() == over, roots
    assert rep.status == (DecodeStatus.INEXACT if over else DecodeStatus.OK), rep.reason
    assert torch.equal(y, x)


@pytest.mark.parametrize("singles, pairs", [(253, 1), (251, 2), (252, 2), (250, 3)])
def test_verify_keeps_an_ancestry_of_exactly_the_cap_through_several_parents(fan_in_codec, singles, pairs):
    """The cap where a key has several parents (the C++ pass adds up their ancestry sizes): p's
    ancestry is 1 + singles + 2 pairs keys through singles + pairs parents, its read cell holding
    1 + singles + pairs <= kMaxCellDegree keys. At exactly kAncestryCap = 256 keys p is verified by its
    check cells (OK); at 257 it is INEXACT; the C++ verify pass lists what reference.decode (with
    Python sets) lists."""
    codec, cells = fan_in_codec
    L = codec.layout
    p, x = fan_in_pairs_support(cells, singles, pairs)
    payload = codec.encode(x)
    support = torch.nonzero(x).reshape(-1)
    sc, _ = reference.key_cells(L.sketch, support)
    rounds, resolved = rp.peel_rounds(sc, L.sketch.cells)
    members = rp.cell_members(sc)
    anc = rp.ancestries(sc, rounds, members, cap=10**6)
    at = {int(key): i for i, key in enumerate(support)}
    assert bool(resolved.all()) and len(rounds) == 3
    last, pure_j = rounds[2][0].tolist(), rounds[2][1].tolist()
    assert at[p] in last and pure_j[last.index(at[p])] == 0             # read in layer 2 from C
    assert len(members[int(sc[at[p], 0])]) - 1 == singles + pairs >= 2   # its parents
    assert len(anc[at[p]]) == 1 + singles + 2 * pairs and rp.ANCESTRY_CAP == 256
    over = [p] if len(anc[at[p]]) > rp.ANCESTRY_CAP else []
    y, rep = codec.decode(payload)
    _, info = reference.decode(L, payload, verify=True)
    assert rep.inexact_keys.tolist() == info["inexact_keys"].tolist() == over, (singles, pairs)
    assert rep.status == (DecodeStatus.INEXACT if over else DecodeStatus.OK), rep.reason
    assert torch.equal(y, x)


@pytest.mark.parametrize("roots", [254, 255])
def test_a_cell_of_more_than_the_degree_cap_keys_fails_to_peel(fan_in_codec, roots):
    """A support that puts more than kMaxCellDegree = 255 keys in one sketch cell (p's cell, with the
    roots) fails as SKETCH_PEEL_FAILED, no key counted as peeled, on the CPU as in the reference (and on
    CUDA: test_cuda_emulated); one of exactly 255 keys peels."""
    codec, cells = fan_in_codec
    _, _, x = fan_in_support(cells, roots)
    payload = codec.encode(x)
    y, rep = codec.decode(payload)
    _, info = reference.decode(codec.layout, payload, verify=True)
    if roots + 1 <= reference.MAX_CELL_DEGREE:
        assert rep.status == DecodeStatus.OK and info["ok"] and torch.equal(y, x), rep.reason
    else:
        assert rep.status == DecodeStatus.SKETCH_PEEL_FAILED and rep.peeled == 0, rep.reason
        assert not info["ok"] and info["reason"].startswith("sketch peeling failed: a cell holds 256 support keys")
        assert rep.inexact_keys.numel() == 0
