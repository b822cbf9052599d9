"""The planner's statistics of one tensor across steps, and its re-planning schedule
(:class:`PlanTracker`; the cost model that decides on them: :mod:`lossless_hc.training.planner`)."""
from __future__ import annotations

import math
from typing import Optional

from lossless_hc.lhc.layout import check_fraction, check_int
from lossless_hc.training.plan_stats import TensorStats


class PlanTracker:
    r"""One tensor's statistics across steps and its re-planning schedule (identical on every rank).

    Each observed step feeds the per-rank counts ``k_r`` and the union ``u`` (from the aggregate) into
    EWMAs :math:`\bar x \leftarrow (1-a)\bar x + a x` (the first step sets them). A decision is due after
    the first observed step and then every ``interval`` steps, or at once after a sketch failed to
    decode (``force``); :meth:`stats` rounds the EWMAs up, taking the per-rank maximum over the steps
    since the last decision so that a spiky tensor keeps room for its spikes. Every step of a sketch or
    top-k plan also feeds the coordinates its inexact keys' request re-aggregated into an EWMA of that
    plan's (:meth:`observe_reaggregated`; kept across plan changes, the cost model's ``R``).
    """

    def __init__(self, numel: int, row: int, world_size: int, interval: int = 16, alpha: float = 0.25,
                 sparse: bool = False):
        if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:   # int(2.5) would be 2
            raise ValueError(f"interval must be a positive integer, got {interval!r}")
        alpha = check_fraction("alpha", alpha)
        # checked, not coerced: a row of 0 would fail only at the first decision, and int() would truncate
        for name, value, least in (("numel", numel, 0), ("row", row, 1), ("world_size", world_size, 1)):
            check_int(value, name, least=least)
        self.numel, self.row, self.world_size = numel, row, world_size
        self.interval, self.alpha = interval, alpha
        self.sparse = bool(sparse)
        self.steps = 0
        self.rank_keys: Optional[list] = None
        self.union: Optional[float] = None
        self.peak_rank = 0
        self.force = False
        self.last_step = 0   # the step count of the last observation
        self.reaggregated: dict = {}   # strategy -> EWMA of the coordinates re-aggregated per step

    def observe(self, rank_keys, union_keys: int, step: Optional[int] = None) -> bool:
        """Record one step; True when a decision is due. ``step``: the tensor's step count after this one
        (default: the observations so far), which the schedule follows: a dense plan observes only one
        step in ``interval`` (:meth:`AutoAggregator.carries_statistics
        <lossless_hc.training.strategies.AutoAggregator.carries_statistics>`), each of them due. An
        observation after ``m`` unobserved steps stands for them too: its weight is ``1 - (1 - a)^(m+1)``,
        what ``m + 1`` observations of the same counts would have had."""
        ks = [float(k) for k in rank_keys]
        # Checked here, not only by stats(): zip would silently drop a missing rank's EWMA, and a NaN or
        # negative count would stay in the averages for good.
        if len(ks) != self.world_size:
            raise ValueError(f"rank_keys has {len(ks)} entries for world_size {self.world_size}")
        if not all(0.0 <= k < math.inf for k in ks + [float(union_keys)]):
            raise ValueError(f"counts must be finite and >= 0, got rank_keys={tuple(rank_keys)!r}, "
                             f"union_keys={union_keys!r}")
        step = self.steps + 1 if step is None else int(step)
        a = 1.0 - (1.0 - self.alpha) ** max(1, step - self.last_step)
        self.last_step = step
        if self.rank_keys is None:
            self.rank_keys, self.union = ks, float(union_keys)
        else:
            self.rank_keys = [(1 - a) * m + a * k for m, k in zip(self.rank_keys, ks)]
            self.union = (1 - a) * self.union + a * union_keys
        self.peak_rank = max(self.peak_rank, int(max(ks)) if ks else 0)
        self.steps += 1
        return self._due(step)

    def _due(self, step: int) -> bool:
        """Whether a decision is due after step ``step``: the first, every ``interval``, or after a failure."""
        return self.force or step == 1 or step % self.interval == 0

    def skip(self, step: int) -> bool:
        """A step whose counts are not the tensor's own (its gradient carried error memory sent late:
        :meth:`AutoAggregator.carry_memory <lossless_hc.training.strategies.AutoAggregator.carry_memory>`):
        nothing is recorded, so the next observation stands for it too (:meth:`observe`); True when a
        decision is due at ``step``, as :meth:`observe` would have said. A flushed memory holds the rows of
        many steps: observed, it would read as a spike, which the per-rank peak keeps until the next decision
        (on NCF's tables it moved the plan to top-k allgathered and back: docs/BENCHMARKS.md)."""
        return self._due(int(step))

    def observe_reaggregated(self, strategy: str, coordinates: int) -> None:
        """One decode of a ``strategy`` plan (``"sketch"``, ``"topk"``): it re-aggregated ``coordinates``
        (0: it proved every key; a failed decode's dense fallback is not observed, the model neglects it)."""
        count = float(coordinates)
        if not 0.0 <= count <= self.numel:
            raise ValueError(f"{strategy} re-aggregated {coordinates!r} coordinates of {self.numel}")
        old = self.reaggregated.get(strategy)
        # a new dict, not an update: a state_dict() taken earlier holds the old one
        self.reaggregated = {**self.reaggregated,
                             strategy: count if old is None else (1 - self.alpha) * old + self.alpha * count}

    def stats(self, element_bytes: int = 4, reset: bool = True) -> TensorStats:
        """The statistics a decision uses (and, with ``reset``, resets the per-interval peak and ``force``:
        a look that decides nothing passes False)."""
        keys = -(-self.numel // self.row) if self.numel else 0
        ranks = [min(keys, math.ceil(k)) for k in self.rank_keys]
        top = max(ranks) if ranks else 0
        if self.peak_rank > top:   # the largest rank keeps its recent peak
            ranks[ranks.index(top)] = min(keys, self.peak_rank)
        union = min(keys, max(math.ceil(self.union), max(ranks) if ranks else 0))
        if reset:
            self.peak_rank, self.force = 0, False
        reaggregated = {f"{s}_reaggregated": round(c) for s, c in self.reaggregated.items()}
        return TensorStats(self.numel, self.row, self.world_size, tuple(ranks), union, element_bytes, self.sparse,
                           **reaggregated)
