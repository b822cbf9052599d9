"""Gradients built so that the lossless codec reports inexact keys (DecodeStatus.INEXACT), shared by
the DDP and Horovod workers' ``inexact`` scenario.

Every rank's gradient has many small integer keys (|v| <= 8) and a few huge ones (2**30 in every
coordinate of the key, the same keys on every rank). In float32, 2**30 times a sketch weight (up to
2) absorbs any small sum sharing its cell (ulp(2**31) = 256 > the small keys' total there), so a
small key read from such a cell after the huge one was peeled decodes as 0: the decoder's error
bound flags it inexact, and only the plugins' re-aggregation of those keys makes the result right.
Every value and every dense sum of them is an exact float32 (integers, powers of two), so the
dense sum is exact in any order and the test can ask for bit-for-bit equality with it at every
coordinate (:func:`dense_reference`; DDP's own allreduce divides before it sums, which rounds for
3 ranks); the huge keys themselves decode exactly (the small values in their cells round away).
"""
import torch
from torch import nn

ROWS, COLS, VEC = 2000, 4, 8000
SMALL_ROWS, BIG_ROWS, SMALL_COORDS, BIG_COORDS = 40, 3, 200, 3
HUGE = 2.0 ** 30
STEPS = 8


class InexactModel(nn.Module):
    """A row-blocked table (keys: rows of 4) and a vector (keys: coordinates); ``model(gt, gv)`` is a
    loss whose gradients are exactly ``gt`` and ``gv`` (d/dp of sum(p * g) is g)."""

    def __init__(self):
        super().__init__()
        self.table = nn.Parameter(torch.zeros(ROWS, COLS))
        self.vec = nn.Parameter(torch.zeros(VEC))

    def forward(self, gt, gv):
        return (self.table * gt).sum() + (self.vec * gv).sum()


def gradients(step: int, rank: int):
    """``(table, vec)`` gradients of ``rank`` at ``step``: small integers on rank-specific keys, 2**30 on
    keys shared by every rank (drawn from the step alone)."""
    shared = torch.Generator().manual_seed(7919 * step + 1)
    mine = torch.Generator().manual_seed(7919 * step + 1000 + rank)
    table, vec = torch.zeros(ROWS, COLS), torch.zeros(VEC)
    big_rows = torch.randperm(ROWS, generator=shared)[:BIG_ROWS]
    big_coords = torch.randperm(VEC, generator=shared)[:BIG_COORDS]
    rows = torch.randperm(ROWS, generator=mine)[:SMALL_ROWS]
    coords = torch.randperm(VEC, generator=mine)[:SMALL_COORDS]
    table[rows] = _small((SMALL_ROWS, COLS), mine)
    vec[coords] = _small((SMALL_COORDS,), mine)
    table[big_rows] = HUGE
    vec[big_coords] = HUGE
    return table, vec


def _small(shape, gen):
    v = torch.randint(1, 9, shape, generator=gen).to(torch.float32)
    return v * (torch.randint(0, 2, shape, generator=gen) * 2 - 1)


def dense_reference(step: int, world_size: int, average: bool):
    """The dense aggregate of every rank's :func:`gradients` (each rank regenerates them): their float32
    SUM, exact here, divided by world_size when ``average`` (one rounding, as the codec's average)."""
    grads = [gradients(step, r) for r in range(world_size)]
    sums = [sum(g[i] for g in grads[1:]) + grads[0][i] for i in range(2)]
    return [s / world_size for s in sums] if average else sums


def digest(tensors) -> str:
    import hashlib

    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def compare(ref, got) -> dict:
    """How far gradients ``got`` are from ``ref``: coordinates that differ in any bit, largest difference."""
    return {"differing": sum(int((a != b).sum()) for a, b in zip(ref, got)),
            "max_diff": max(float((a - b).abs().max()) for a, b in zip(ref, got))}
