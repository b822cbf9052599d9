"""Adaptive capacity: how many keys each rank's codec of one tensor holds, learnt from the aggregates.

:class:`CapacityPolicy` holds the options a compressor (or DDP hook state) shares across its tensors;
each :class:`~lossless_hc.training.aggregate.TensorAggregator` keeps its own :class:`DensityTracker`
and rebuilds its codec when the tracker's proposal leaves the hysteresis band.
"""
from __future__ import annotations

import math
from typing import Optional

from lossless_hc.lhc.layout import check_fraction, check_int, is_real

HISTORY_KEEP = 64   # the decisions a tensor keeps for inspection (and checkpoints); older ones are counted only


def append_recent(history: list, entry) -> None:
    """Append ``entry`` to ``history``, keeping its last :data:`HISTORY_KEEP` entries (a long run that
    re-plans or resizes every few steps would otherwise grow it, its ``stats()`` and its checkpoints
    without bound)."""
    history.append(entry)
    del history[:-HISTORY_KEEP]


class CapacityPolicy:
    r"""Adaptive capacity: size each tensor's codec from the densities its aggregates show.

    Options shared by every tensor of a compressor (or DDP hook state); each
    :class:`TensorAggregator` keeps its own :class:`DensityTracker` from :meth:`tracker`.

    Per decoded step the tracker observes, from the *aggregate* (identical bits on every rank): the
    union support ``U`` (keys non-zero in the sum: the codec's report, or the non-zeros of a dense
    or fallback aggregate) and the mean per-rank key count ``K / n`` (the header's total). It keeps
    exponentially weighted averages :math:`\bar U \leftarrow (1-\alpha)\bar U + \alpha U` (and likewise
    for the per-rank count and its running maximum). Every ``interval`` decoded steps -- a step
    count all ranks share -- it proposes

    * union capacity :math:`\lceil h_U \max(\bar U, U_{\max}) \rceil` and per-rank capacity
      :math:`\lceil h_K s \max(\overline{K/n}, (K/n)_{\max}) \rceil` (``U_max``, ``(K/n)_max``: the largest
      seen in the last interval, so a spiky tensor keeps room for its spikes; ``s``: the skew below);

    The aggregate gives only the mean per-rank count, while a rank overloads when *its* count passes
    the capacity. A rank that holds more keys than the others (its data's share of the rows) would
    overload at each decision's proposal from the mean, fall back densely and grow the capacity, over
    and over. So every overload the aggregate reports with capacity ``C`` at mean ``m = K / n`` raises
    the tracker's skew to :math:`s \leftarrow \max(s, 2 C / (h_K m))` (1 at first): the proposals
    then keep the capacity the overload's growth (to ``2 C``) gave at that mean. The skew never falls
    (a rank's share is a property of its data; the per-rank capacity is only the overload threshold and,
    for the Bloom index, its counters' width: with the union capacity given it does not change the other
    layouts' bytes). Overloads on every rank alike (a density above the guess) leave it at 1.

    and the aggregator rebuilds its codec (index kind and sizes from :mod:`lossless_hc.lhc.cost_model`)
    only if the proposal leaves the hysteresis band: it grows when the proposal exceeds the current
    capacity, and shrinks only below ``(1 - hysteresis)`` of it. Decisions are pure functions of
    aggregated values evaluated in the same order on every rank, so every rank switches at the same
    step to the same layout and payload shapes always match. A failed decode still grows the capacity
    at once (see :class:`TensorAggregator`).

    Args:
        interval: decoded steps between decisions (16).
        alpha: EWMA weight of the newest step (0.25).
        union_headroom: ``h_U`` (1.25): margin of the union capacity over the observed union.
        rank_headroom: ``h_K`` (1.5): margin of the per-rank capacity over the observed mean.
        hysteresis: shrink only when the proposal is below ``(1 - hysteresis)`` of the current
            capacity (0.25).
        warmup: decisions begin after this many decoded steps (``interval`` by default).
    """

    def __init__(self, interval: int = 16, alpha: float = 0.25, union_headroom: float = 1.25,
                 rank_headroom: float = 1.5, hysteresis: float = 0.25, warmup: Optional[int] = None):
        check_int(interval, "interval", least=1)   # 2.5 would be truncated to 2
        check_int(warmup, "warmup", none=True)
        if warmup is not None and warmup < 0:
            raise ValueError(f"warmup must be >= 0 decoded steps (or None: interval), got {warmup}")
        alpha = check_fraction("alpha", alpha)
        for name, h in (("union_headroom", union_headroom), ("rank_headroom", rank_headroom)):
            if not (is_real(h) and 1.0 <= h < math.inf):   # NaN fails too
                raise ValueError(f"{name} must be a finite number >= 1, got {h!r}")
        if not (is_real(hysteresis) and 0.0 <= hysteresis < 1.0):
            raise ValueError(f"hysteresis must be a number in [0, 1), got {hysteresis!r}")
        self.interval = interval
        self.alpha = alpha
        self.union_headroom = float(union_headroom)
        self.rank_headroom = float(rank_headroom)
        self.hysteresis = float(hysteresis)
        self.warmup = self.interval if warmup is None else warmup

    def tracker(self) -> "DensityTracker":
        return DensityTracker(self)

    def __repr__(self) -> str:
        return (f"CapacityPolicy(interval={self.interval}, alpha={self.alpha}, union_headroom={self.union_headroom}, "
                f"rank_headroom={self.rank_headroom}, hysteresis={self.hysteresis}, warmup={self.warmup})")


class DensityTracker:
    """One tensor's observed densities under a :class:`CapacityPolicy` (see there)."""

    def __init__(self, policy: CapacityPolicy):
        self.policy = policy
        self.steps = 0                  # decoded steps observed
        self.union = None               # EWMA of the aggregate's non-zero keys
        self.per_rank = None            # EWMA of the mean per-rank non-zero keys
        self.peak_union = 0             # maxima since the last decision
        self.peak_rank = 0.0
        self.skew = 1.0                 # the per-rank proposal's factor over the mean, raised by overloads
        self.history: list = []         # (step, capacity keys, union keys, index kind): the last rebuilds
        self.rebuilds = 0               # every rebuild

    def observe(self, union_keys: int, per_rank_keys: float) -> bool:
        """Record one decoded step; True when a decision is due (every ``interval`` steps)."""
        a = self.policy.alpha
        self.union = float(union_keys) if self.union is None else (1 - a) * self.union + a * union_keys
        self.per_rank = float(per_rank_keys) if self.per_rank is None else (1 - a) * self.per_rank + a * per_rank_keys
        self.peak_union = max(self.peak_union, int(union_keys))
        self.peak_rank = max(self.peak_rank, float(per_rank_keys))
        self.steps += 1
        return self.steps >= self.policy.warmup and self.steps % self.policy.interval == 0

    def observe_overload(self, capacity_keys: int, mean_keys: float) -> None:
        r"""Record a decode that some rank overloaded with a per-rank capacity of ``capacity_keys`` keys
        while the ranks held ``mean_keys`` keys on average (the header's total over n): the skew
        :math:`s \leftarrow \max(s, 2 C / (h_K m))` (the class doc)."""
        if mean_keys > 0:
            self.skew = max(self.skew, 2.0 * capacity_keys / (self.policy.rank_headroom * mean_keys))

    def propose(self) -> tuple:
        """``(per-rank capacity keys, union keys)`` for the next interval; resets the peaks."""
        p = self.policy
        rank = math.ceil(p.rank_headroom * self.skew * max(self.per_rank, self.peak_rank))
        union = math.ceil(p.union_headroom * max(self.union, self.peak_union))
        self.peak_union, self.peak_rank = 0, 0.0
        return max(1, rank), max(1, union)

    @property
    def changes(self) -> int:
        """Decisions that rebuilt the codec with a different layout."""
        return self.rebuilds

    def record_rebuild(self, capacity: int, union_capacity: Optional[int], index_kind: str) -> None:
        """A decision that rebuilt the codec with a different layout (``history`` keeps the last
        :data:`HISTORY_KEEP`)."""
        self.rebuilds += 1
        append_recent(self.history, (self.steps, capacity, union_capacity, index_kind))

    def accept(self, current: int, proposed: int) -> bool:
        """Whether ``proposed`` leaves the hysteresis band around ``current``."""
        return proposed > current or proposed < (1.0 - self.policy.hysteresis) * current
