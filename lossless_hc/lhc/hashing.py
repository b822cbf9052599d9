"""The hash family of ``csrc/lhc_layout.h`` on int64 tensors: which cells and weights a key (or a
multilevel node) has in a :class:`~lossless_hc.lhc.layout.SegmentedTable`.

The multiplications wrap modulo 2**64 exactly like ``uint64_t``; right shifts are made logical by
masking off the sign-extended bits; 64-bit constants above 2**63 are converted to their
two's-complement int64 value. The planner uses it to check a table's hashes before choosing it
(:func:`lossless_hc.lhc.sizing.with_solvable_streams`); the reference codec (the test oracle) hashes
with it; the tests check it against the C++ one.
"""
from __future__ import annotations

import torch

from lossless_hc.lhc.layout import SegmentedTable

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_MIX_C1 = 0xBF58476D1CE4E5B9
_MIX_C2 = 0x94D049BB133111EB


def s64(v: int) -> int:
    """The int64 with the same 64 bits as the unsigned value ``v`` (mod 2**64)."""
    v &= _MASK64
    return v - (1 << 64) if v >= (1 << 63) else v


def lsr(z: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of the 64-bit pattern held in an int64 tensor (``>>`` is arithmetic)."""
    return (z >> s) & ((1 << (64 - s)) - 1)


def mix64(z: torch.Tensor) -> torch.Tensor:
    """``lhc::mix64`` (splitmix64 finalizer) on int64 tensors holding uint64 bit patterns."""
    z = z ^ lsr(z, 30)
    z = z * s64(_MIX_C1)
    z = z ^ lsr(z, 27)
    z = z * s64(_MIX_C2)
    z = z ^ lsr(z, 31)
    return z


def reduce32(h: torch.Tensor, n: int) -> torch.Tensor:
    """``lhc::reduce32``: ``((h & 0xffffffff) * n) >> 32`` for ``0 <= n < 2**32``.

    The product is below 2**64, so its int64 wrap-around keeps the exact bit pattern and a logical
    shift recovers the unsigned quotient.
    """
    if not 0 <= n < (1 << 32):
        raise ValueError(f"reduce32 needs 0 <= n < 2**32, got {n}")
    return lsr((h & 0xFFFFFFFF) * n, 32)


def key_cells(table: SegmentedTable, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The three cells and weights of every key: ``(cells [N, 3] int64, weights [N, 3] int64 in
    {+1, +2, -1, -2})``.

    Mirrors ``lhc::key_cells``: ``h = mix64(key ^ stream)``; the key's group
    ``g = reduce32(h >> 32, seg_count // 3)``; for j = 0, 1, 2 ``hj = mix64(h + golden * (j + 1))``,
    cell ``(3 g + j) * seg_len + reduce32(hj, seg_len)`` and weight ``+-(1 + bit 62 of hj)`` in a
    weighted table (``+-1`` otherwise), negative iff the top bit of hj is set.
    """
    keys = torch.as_tensor(keys, dtype=torch.int64).reshape(-1)
    if table.seg_count < 3 or table.seg_count % 3:
        raise ValueError(f"seg_count must be a positive multiple of 3, got {table.seg_count}")
    h = mix64(keys ^ s64(table.stream))
    start = 3 * reduce32(lsr(h, 32), table.seg_count // 3)
    cells, weights = [], []
    for j in range(3):
        hj = mix64(h + s64(_GOLDEN * (j + 1)))
        cells.append((start + j) * table.seg_len + reduce32(hj, table.seg_len))
        magnitude = 1 + lsr(hj, 62) % 2 if table.weighted else torch.ones_like(hj)
        weights.append(torch.where(hj < 0, -magnitude, magnitude).to(torch.int64))
    return torch.stack(cells, dim=1), torch.stack(weights, dim=1)
