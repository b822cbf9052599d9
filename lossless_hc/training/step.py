"""One step of one tensor under the planner: what :class:`~lossless_hc.training.strategies.AutoAggregator`
keeps between its ``encode``, ``decode`` and ``finish`` (:class:`AutoContext`), what ``decode`` returns
(:class:`AutoOutcome`) and the second collective a strategy may ask for (:class:`Request`)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass
class Request:
    """One more collective a strategy needs: ``kind`` "allreduce" (SUM ``tensor`` across ranks) or
    "allgather" (every rank's ``tensor``, same numel on every rank, stacked in rank order)."""

    kind: str
    tensor: torch.Tensor


@dataclass
class AutoContext:
    """One encoded step of one tensor (what decode/finish need)."""

    strategy: str
    started: float
    payload_bytes: int
    rows: int = 0                           # this rank's row count (the statistics header's k_r)
    present: Optional[torch.Tensor] = None  # a dense gradient's non-zero rows (bool per row)
    index: Optional[torch.Tensor] = None    # this rank's rows, sorted int64 (a dense gradient's: on demand)
    values: Optional[torch.Tensor] = None   # ... their values (a sparse gradient's; a dense one's on demand)
    flat: Optional[torch.Tensor] = None     # the gradient, flat (a sparse one's: written on demand)
    averaged: bool = False
    rank_keys: tuple = ()
    inner: object = None          # a wrapped aggregator's context (thc, topk) or the sketch codec
    union_rows: Optional[torch.Tensor] = None   # the rows some rank holds (two_phase; a sparse result's rows)
    partial: Optional[tuple] = None   # sketch under INEXACT: (decoded flat tensor, inexact rows, union count)
    topk_outcome: object = None
    plain: bool = False           # a dense step without the statistics header (the bare tensor)
    # Whether the step's counts are statistics (False: a THC or top-k step between the interval's
    # statistics steps, whose header carries zero counts and whose rows nothing scans)
    observed: bool = True
    # A dense statistics step whose body is the gradient's values as they are: the dtype the body may
    # travel in (the plain steps'), where narrower than the payload's; the body starts at body_at.
    body_dtype: Optional[torch.dtype] = None
    body_at: int = 0


@dataclass
class AutoOutcome:
    value: Optional[torch.Tensor]
    request: Optional[Request] = None
