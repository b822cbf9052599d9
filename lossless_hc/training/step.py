"""One step of one tensor under the planner: what :class:`~lossless_hc.training.strategies.AutoAggregator`
keeps between its ``encode``, ``decode`` and ``finish`` (:class:`AutoContext`), what ``decode`` returns
(:class:`AutoOutcome`) and the second collective a strategy may ask for (:class:`Request`); and
:func:`run_in_process`, every rank's step in one process (the benchmarks' and the tests' engine)."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional, Sequence

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
    index: Optional[torch.Tensor] = None    # this rank's rows, sorted int64 (a dense gradient's: where scanned)
    values: Optional[torch.Tensor] = None   # ... their values (a sparse gradient's; a dense one's stay in flat)
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
    # The gradient carried error memory sent late (AutoAggregator.carry_memory): its counts are not the
    # tensor's own, so they are not statistics (PlanTracker.skip), though the header carries them
    carried_memory: bool = False
    # A dense statistics step whose body is the gradient's values as they are: the dtype the body may
    # travel in (the plain steps'), where narrower than the payload's; the body starts at body_at.
    body_dtype: Optional[torch.dtype] = None
    body_at: int = 0


@dataclass
class AutoOutcome:
    value: Optional[torch.Tensor]
    request: Optional[Request] = None


def run_in_process(aggregators: Sequence, inputs: Sequence[torch.Tensor], average: bool = False) -> tuple:
    """One step of every rank's :class:`~lossless_hc.training.strategies.AutoAggregator` (rank ``r``:
    ``aggregators[r]`` on ``inputs[r]``) in one process, torch standing in for the engine: the first
    payloads' SUM (in float64, then the payloads' dtype; ``average``: divided by n, as an averaging engine),
    every rank's ``decode``, and where they request one more collective, its SUM (float64, then the
    request's dtype) or gather (stacked in rank order) and every rank's ``finish`` (of a copy each).
    Returns ``(values, seconds)``: each rank's value, and the seconds of the aggregators' own calls summed
    over the ranks (the collectives left out). A RuntimeError where the ranks' requests differ in kind or
    size, which no engine could carry out."""
    n, seconds = len(aggregators), 0.0

    def timed(fn, *args):
        nonlocal seconds
        t0 = time.perf_counter()
        out = fn(*args)
        seconds += time.perf_counter() - t0
        return out

    encoded = [timed(a.encode, x) for a, x in zip(aggregators, inputs)]
    summed = torch.stack([p.to(torch.float64) for p, _ in encoded]).sum(0)
    summed = (summed / n if average else summed).to(encoded[0][0].dtype)
    outcomes = [timed(a.decode, summed, ctx) for a, (_, ctx) in zip(aggregators, encoded)]
    requests = [o.request for o in outcomes]
    if all(r is None for r in requests):
        return [o.value for o in outcomes], seconds
    if any(r is None for r in requests) or len({(r.kind, r.tensor.numel()) for r in requests}) != 1:
        raise RuntimeError("the ranks asked for different collectives: "
                           f"{[(r.kind, r.tensor.numel()) if r else None for r in requests]}")
    if requests[0].kind == "allgather":
        result = torch.stack([r.tensor.reshape(-1) for r in requests])
    else:
        result = torch.stack([r.tensor.to(torch.float64) for r in requests]).sum(0).to(requests[0].tensor.dtype)
    values = [timed(a.finish, ctx, result.clone()) for a, (_, ctx) in zip(aggregators, encoded)]
    return values, seconds
