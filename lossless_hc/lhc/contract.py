r"""The exactness contract of a decode, stated once: the fuzzer, the codec benchmark and the tests
judge decodes with these functions (:func:`outside_contract`, and :func:`outside_bounds` for the
per-key bounds a decode reports).

For a coordinate i with float32 inputs :math:`x_{r,i}` on n ranks, true sum
:math:`s_i = \sum_r x_{r,i}` and absolute mass :math:`a_i = \sum_r |x_{r,i}|`, a decoded value
:math:`y_i` (``report.ok``, or any key a decode did not report inexact) is within the contract iff

.. math:: |y_i - s_i| \le \max\big(\mathrm{rtol}\,|s_i|,\ \gamma_{n-1} a_i\big) + u_{out} |s_i|,
   \qquad \gamma_m = \frac{m u}{1 - m u},\ u = 2^{-24}

* :math:`\mathrm{rtol}\,|s_i|`: the codec's relative tolerance (``rtol``);
* :math:`\gamma_{n-1} a_i`: what a dense float32 allreduce of the same tensors could be off at that
  coordinate, in any summation order (n - 1 float32 additions, each rounding by at most u of a
  partial sum bounded by :math:`a_i`; Higham, *Accuracy and Stability*, 2nd ed., (4.4)) -- built
  from the coordinate's own magnitudes, not the tensor's largest value;
* :math:`u_{out} |s_i|`: rounding the result to the output dtype (0 for float32, whose rounding
  :math:`\gamma_{n-1}` already covers; :math:`2^{-11}` for float16, :math:`2^{-8}` for bfloat16),
  plus :math:`u |s_i|` for an average (the division by n rounds once more), plus half the output
  dtype's smallest subnormal (rounding below its normal range is absolute, not relative).

For an average, :math:`s_i` and :math:`a_i` are the sum's divided by n.

So a coordinate no rank touched (:math:`a_i = 0`) must decode to exactly 0, a non-finite output is
never within it (except the infinity of :math:`s_i`'s sign where :math:`s_i` is, within the bound, at
or beyond the output dtype's largest finite value: the dense sum in that dtype can overflow too), and a
small value next to a large one in the same sketch cell must keep its own relative accuracy. The
truth is computed in float64 (:func:`truth`), whose own rounding (:math:`\le n\,2^{-53} a_i`, n
additions of exact float64 values) is added to the allowance with a margin, as
:math:`(n + 1)\,2^{-53} a_i`, so that it never decides a verdict.
"""
from __future__ import annotations

import math
from typing import Sequence

import torch

from lossless_hc.lhc.codec import key_coordinates
from lossless_hc.lhc.status import DecodeStatus

UNIT_ROUNDOFF = {torch.float32: 2.0 ** -24, torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8}
HALF_SUBNORMAL = {torch.float32: 2.0 ** -150, torch.float16: 2.0 ** -25, torch.bfloat16: 2.0 ** -134}


def truth(xs: Sequence[torch.Tensor]) -> tuple:
    """``(s, a)``: the float64 sum and absolute mass of the ranks' tensors, flattened."""
    s = torch.zeros(xs[0].numel(), dtype=torch.float64)
    a = torch.zeros_like(s)
    for x in xs:
        v = x.detach().reshape(-1).to(device="cpu", dtype=torch.float64)
        s += v
        a += v.abs()
    return s, a


def allowed_error(s: torch.Tensor, a: torch.Tensor, world_size: int, rtol: float,
                  dtype: torch.dtype = torch.float32, averaged: bool = False) -> torch.Tensor:
    """The contract's per-coordinate bound on ``|y - s|`` (float64, see the module doc)."""
    u = UNIT_ROUNDOFF[torch.float32]
    m = max(world_size - 1, 0)
    gamma = m * u / (1.0 - m * u)
    u_out = (0.0 if dtype == torch.float32 else UNIT_ROUNDOFF[dtype]) + (u if averaged else 0.0)
    reference_rounding = (world_size + 1) * 2.0 ** -53 * a
    return torch.maximum(rtol * s.abs(), gamma * a) + u_out * s.abs() + HALF_SUBNORMAL[dtype] + reference_rounding


def outside_contract(y: torch.Tensor, s: torch.Tensor, a: torch.Tensor, world_size: int, rtol: float,
                     averaged: bool = False) -> torch.Tensor:
    """Boolean mask (flat, CPU) of the coordinates of ``y`` outside the contract for truth ``(s, a)``
    (:func:`truth`; divided by n for an average); a non-finite output or input is always outside (a
    decode of non-finite inputs must not claim to be exact)."""
    yd = y.detach().reshape(-1).to(device="cpu", dtype=torch.float64)
    allowed = allowed_error(s, a, world_size, rtol, y.dtype, averaged)
    bad = ((yd - s).abs() > allowed) | ~torch.isfinite(yd) | ~torch.isfinite(a)
    return bad & ~_overflowed(yd, s, allowed, y.dtype)


def claimed_outside_contract(y: torch.Tensor, report, s: torch.Tensor, a: torch.Tensor, world_size: int,
                             rtol: float, block: int, averaged: bool = False) -> torch.Tensor:
    """Boolean mask (flat, CPU) of the coordinates a decode vouched for that are outside the contract:
    every coordinate when ``report.ok``; under ``INEXACT`` every coordinate but those of
    ``report.inexact_keys`` (the keys the decoder listed as unproven); none for any other status (a
    decode that failed claims nothing). ``s``, ``a``: :func:`truth` (divided by n for an average);
    ``block``: the codec's block size, which maps keys to coordinates."""
    numel = s.numel()
    if report.ok:
        return outside_contract(y, s, a, world_size, rtol, averaged)
    if DecodeStatus(report.status) != DecodeStatus.INEXACT:
        return torch.zeros(numel, dtype=torch.bool)
    bad = outside_contract(y, s, a, world_size, rtol, averaged)
    bad[key_coordinates(report.inexact_keys.to(torch.int64), block, numel)[0]] = False
    return bad


def unproven_coordinates(y: torch.Tensor, report, block: int, rtol: float, verify: bool = False) -> torch.Tensor:
    r"""The flat coordinates (int64, increasing, on ``y``'s device) of an INEXACT decode's
    ``report.inexact_keys`` whose own values its per-key bounds do not prove within ``rtol``: what a
    re-aggregation must send. Coordinate i of key k is proven where ``y_i`` is finite and

    .. math:: E(k)\,(1 + \mathrm{rtol}) + \frac{u (|y_i| + h)}{1 - u} + h \le \frac{\mathrm{rtol}\,(|y_i| - h)}{1 + u}

    evaluated in float64 with a relative margin of :math:`2^{-40}` either side; ``u`` and ``h`` bound the
    output's rounding from the float64 peel's value :math:`v_i`, :math:`|y_i - v_i| \le u |v_i| + h`
    (float32: :math:`u = 2^{-24}`, ``h`` half its smallest subnormal; a half dtype rounds that float32
    once more and adds its own). Then :math:`|y_i - t_i| \le u |v_i| + h + E(k) \le \mathrm{rtol}\,|t_i|`
    for the true sum :math:`t_i` (:math:`|t_i| \ge |v_i| - E(k)`), within the contract. The rule
    implies the decoder's own (``lhc::within_rtol`` at :math:`v_i`), so each inexact key keeps at least
    one coordinate, and it is a function of the decode alone: every rank derives the same coordinates.
    All of the keys' coordinates where ``block`` is 1, where the codec verifies (``verify``: its
    verdicts also use verification bounds the report does not carry) and where
    ``report.error_bounds`` is None (a decode without ``error_bounds=True``)."""
    numel = y.numel()
    keys = report.inexact_keys.to(device=y.device, dtype=torch.int64)
    if block == 1 or verify or report.error_bounds is None:
        return key_coordinates(keys, block, numel)[0]
    support, E = (t.to(y.device) for t in report.error_bounds)
    Ek = E.to(torch.float64)[torch.searchsorted(support, keys)].unsqueeze(1)
    flat = y.detach().reshape(-1)
    if numel % block == 0:   # the listed keys' rows, as one (keys, block) gather
        a = flat.view(-1, block).index_select(0, keys).to(torch.float64).abs()
    else:   # a partial last row: read through its coordinates, a NaN (never proven) past the tensor's end
        coords, _ = key_coordinates(keys, block, numel * block)
        a = torch.full((coords.numel(),), math.nan, dtype=torch.float64, device=y.device)
        inside = coords < numel
        a[inside] = flat[coords[inside]].to(torch.float64).abs()
        a = a.view(-1, block)
    u, h = UNIT_ROUNDOFF[torch.float32], HALF_SUBNORMAL[torch.float32]
    if y.dtype in (torch.float16, torch.bfloat16):
        u, h = u + UNIT_ROUNDOFF[y.dtype] * (1.0 + u), h * (1.0 + UNIT_ROUNDOFF[y.dtype]) + HALF_SUBNORMAL[y.dtype]
    margin = 2.0 ** -40
    lhs = (Ek * (1.0 + rtol) + u * (a + h) / (1.0 - u) + h) * (1.0 + margin)
    proven = torch.isfinite(a) & (lhs <= rtol * (a - h) / (1.0 + u) * (1.0 - margin))
    row, lane = (~proven).nonzero(as_tuple=True)   # row-major: increasing coordinates
    coords = keys[row] * block + lane
    return coords if numel % block == 0 else coords[coords < numel]


def _overflowed(yd: torch.Tensor, s: torch.Tensor, allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Where ``yd`` is the infinity of ``s``'s sign and ``|s| + allowed`` reaches ``dtype``'s largest
    finite value: the dense sum in that dtype can overflow too (module doc)."""
    return torch.isinf(yd) & (torch.sign(yd) == torch.sign(s)) & (s.abs() + allowed >= torch.finfo(dtype).max)


def outside_bounds(y: torch.Tensor, s: torch.Tensor, a: torch.Tensor, world_size: int, error_bounds,
                   block: int) -> torch.Tensor:
    """Boolean mask (flat, CPU) of the coordinates outside the decoder's own per-key bounds
    (``DecodeReport.error_bounds``: keys and E(k), for a payload that is the sum or average of valid
    payloads): ``|y - s| > E(k) + u_out (|s| + E(k))`` at a coordinate of key k, u_out the rounding of
    the float64 peeled value to the output dtype (float32, then float16/bfloat16: ``u + u_dtype``),
    plus half the dtype's smallest subnormal and the float64 truth's own rounding; an output that
    overflowed as the contract allows (a float16 sum beyond 65504) is not flagged either. Coordinates
    of keys without a bound are never flagged (the contract covers them)."""
    keys, E = error_bounds
    yd = y.detach().reshape(-1).to(device="cpu", dtype=torch.float64)
    numel = yd.numel()
    idx, rows = key_coordinates(keys, block, numel)
    Ek = E[rows]
    u = UNIT_ROUNDOFF[torch.float32]
    u_out = u + (0.0 if y.dtype == torch.float32 else UNIT_ROUNDOFF[y.dtype])
    sk = s[idx]
    allowed = Ek + u_out * (sk.abs() + Ek) + HALF_SUBNORMAL[y.dtype] + (world_size + 1) * 2.0 ** -53 * a[idx]
    bad = torch.zeros(numel, dtype=torch.bool)
    bad[idx] = ~((yd[idx] - sk).abs() <= allowed) & ~_overflowed(yd[idx], sk, allowed, y.dtype)
    return bad
