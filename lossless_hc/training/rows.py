"""The row-form bodies of the planner's strategies (:mod:`lossless_hc.training.strategies`): the
two-phase counting bitmap and the allgather's slots. Pure functions of their arguments, so every rank
that holds the same summed or gathered tensor reads the same rows from it."""
from __future__ import annotations

from typing import Optional

import torch

from lossless_hc.lhc.layout import digit_packing


def pack_bitmap(keys: int, world_size: int, device, present: Optional[torch.Tensor] = None,
                index: Optional[torch.Tensor] = None) -> torch.Tensor:
    """A rank's rows as ``keys`` digits of base n+1 (1 at a row it holds: ``present``, a bool per row,
    or ``index``, the rows), packed exactly into float32 words (``lhc.layout.digit_packing``)."""
    pk = digit_packing(world_size, keys)
    digits = torch.zeros(pk.words * pk.per_word, dtype=torch.int64, device=device)
    if present is not None:
        digits[:keys] = present.to(torch.int64)
    else:
        digits[index] = 1
    weights = torch.tensor([pk.base ** j for j in range(pk.per_word)], dtype=torch.int64, device=device)
    return (digits.reshape(pk.words, pk.per_word) * weights).sum(dim=1).to(torch.float32)


def bitmap_counts(words: torch.Tensor, keys: int, world_size: int) -> torch.Tensor:
    """Per-row counts (ranks holding the row) from the summed bitmap's words as exact integers (int64;
    ``pk.words`` of them, which the caller checks)."""
    pk = digit_packing(world_size, keys)
    cols = [(words // pk.base ** j) % pk.base for j in range(pk.per_word)]
    return torch.stack(cols, dim=1).reshape(-1)[:keys]


def gather_slots(index: torch.Tensor, values: torch.Tensor, k: int, row: int) -> torch.Tensor:
    """A rank's ``k`` allgather slots, flat: int32 row index (bits in a float32 word; -1: unused) and the
    row's ``row`` values, for its sorted rows ``index`` with ``values`` ``(len(index), row)``."""
    slots = torch.zeros(k, 1 + row, dtype=torch.float32, device=index.device)
    slots[:, 0] = torch.full((k,), -1, dtype=torch.int32, device=index.device).view(torch.float32)
    m = index.numel()
    slots[:m, 0] = index.to(torch.int32).view(torch.float32)
    slots[:m, 1:] = values.to(torch.float32)
    return slots.reshape(-1)


def sum_slots(slots: torch.Tensor, row: int) -> tuple:
    """``(union, rows)`` from the gathered ``(n, K, 1 + row)`` slots: the sorted rows some rank sent and
    their sums, ``rows[i] = ((0 + v_0) + v_1) + ...`` over the ranks that sent row ``union[i]`` in rank
    order, on every device (so every rank adds the same floats in the same order: the same bits).
    A rank's slots name distinct rows (``gather_slots``: its sorted rows)."""
    index = slots[:, :, 0].contiguous().view(torch.int32).to(torch.int64)
    valid = index >= 0
    union = torch.unique(index[valid], sorted=True)
    rows = torch.zeros(union.numel(), row, dtype=torch.float32, device=slots.device)
    # One rank at a time: within a rank no two slots meet in a row, so even an atomic index_add_ (CUDA)
    # has one order; a single index_add_ over every rank's slots would add them in any order there.
    for r in range(slots.shape[0]):
        take = valid[r]
        rows.index_add_(0, torch.searchsorted(union, index[r][take]), slots[r, :, 1:][take])
    return union, rows
