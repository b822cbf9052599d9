"""Pure-torch oracle for the THC tests (float64, dense matrices): not a user path.

It recomputes what the kernels must compute -- the randomized Hadamard transform with the shared
signs, and the rounding variance the table predicts -- from the definitions, so tests can compare.
"""
import functools
import math

import numpy as np

import torch

from lossless_hc import _C


@functools.lru_cache(maxsize=16)
def hadamard(n: int) -> torch.Tensor:
    """Sylvester-order Walsh-Hadamard matrix H_n (entries +-1, float64)."""
    H = torch.ones(1, 1, dtype=torch.float64)
    while H.shape[0] < n:
        H = torch.cat([torch.cat([H, H], 1), torch.cat([H, -H], 1)], 0)
    return H


@functools.lru_cache(maxsize=256)
def signs(sign_stream: int, count: int) -> torch.Tensor:
    """+-1 (float64) of coordinates [0, count): bit j of thc_sign_bits(stream, k) negates 64 k + j."""
    words = np.array([_C.thc_sign_bits(sign_stream, k) for k in range(-(-count // 64))], dtype="<u8")
    bits = np.unpackbits(words.view(np.uint8), bitorder="little")[:count]
    return torch.from_numpy(1.0 - 2.0 * bits.astype(np.float64))


def rht(x: torch.Tensor, layout, sign_stream: int) -> torch.Tensor:
    """RHT(x) over layout.padded coordinates: per block, H (s * x) / sqrt(block)."""
    v = torch.zeros(layout.padded, dtype=torch.float64)
    v[:layout.numel] = x.double().reshape(-1)
    v *= signs(sign_stream, layout.padded)
    H = hadamard(layout.block) / math.sqrt(layout.block)
    return (v.view(-1, layout.block) @ H.T).reshape(-1)


def rounding_variance(u: torch.Tensor, levels) -> torch.Tensor:
    """(u - a)(b - u) for the neighbouring levels a <= u <= b of each u (level units)."""
    lv = torch.tensor(levels, dtype=torch.float64)
    idx = torch.searchsorted(lv, u, right=True).clamp(1, len(levels) - 1)
    a, b = lv[idx - 1], lv[idx]
    return ((u - a) * (b - u)).clamp_min(0.0)


def predicted_sq_error(xs, codecs, norm: float) -> float:
    """E || decoded sum - clipped sum ||^2 over the rounding draws of one step, every coordinate kept
    (the rotation is orthonormal, so it is the sum of the per-coordinate rounding variances)."""
    c0 = codecs[0]
    L, T, g = c0.layout, c0.threshold, L_g(c0)
    unit = norm / math.sqrt(L.padded)
    total = 0.0
    for x, c in zip(xs, codecs):
        y = rht(x, L, _C.thc_sign_stream(c.seed, c.step))
        z = (y / unit).clamp(-T, T)
        u = (z + T) * g / (2 * T)
        total += float(rounding_variance(u, c.table.levels).sum()) * (2 * T / g * unit) ** 2
    return total


def L_g(codec) -> int:
    return codec.layout.granularity


def inverse_rht(y: torch.Tensor, layout, sign_stream: int) -> torch.Tensor:
    """RHT^{-1}(y) on the numel coordinates: per block, s * (H y) / sqrt(block) (H is symmetric)."""
    H = hadamard(layout.block) / math.sqrt(layout.block)
    r = (y.double().view(-1, layout.block) @ H.T).reshape(-1) * signs(sign_stream, layout.padded)
    return r[:layout.numel]


def checksum(codec, words: torch.Tensor, step: int) -> int:
    """The payload checksum of ``words`` (level words, float64 or int64) at ``step``, from its
    definition in lossless_hc/thc/layout.py (THCLayout): sum_w c_w (S_w mod P) mod P with
    c_w = 1 + ((c0 + w k) mod (P - 1))."""
    P, c0, k = codec._check(step)
    vals = [int(v) for v in (words.tolist() if words.dtype == torch.int64 else words.double().tolist())]
    return sum((v % P) * (1 + (c0 + w * k) % (P - 1)) for w, v in enumerate(vals)) % P
