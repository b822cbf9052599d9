"""The CPU kernels' checks at their exact thresholds, on payloads small enough to work out by hand:
each case sits one step on either side of a bound, so a check that is looser or tighter than the
contract's (csrc/lhc_layout.h, reference.decode) changes a verdict here."""
import numpy as np
import pytest
import torch

import helpers
from lossless_hc import LosslessCodec
from lossless_hc.lhc import reference
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
