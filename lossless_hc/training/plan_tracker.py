"""The planner's statistics of one tensor across steps and its re-planning schedule (:class:`PlanTracker`), and
the plan an ``auto`` tensor makes on them (:class:`PlannedTensor`, a part of
:class:`~lossless_hc.training.strategies.AutoAggregator`; the cost model that decides:
:mod:`lossless_hc.training.planner`)."""
from __future__ import annotations

import math
import time
from typing import Optional

from lossless_hc.lhc.codec import LosslessCodec
from lossless_hc.lhc.layout import check_fraction, check_int
from lossless_hc.training.capacity import append_recent
from lossless_hc.training.planner import PLAIN_STRATEGIES, dense_dominates
from lossless_hc.training.plan_stats import TensorStats, sketch_capacity
from lossless_hc.training.step import AutoContext


MAX_INTERVAL_FACTOR = 16   # the default max_interval: 16 intervals (256 steps at the default interval of 16)


def is_doubled_interval(value, interval: int) -> bool:
    """Whether ``value`` is ``interval`` times a power of two (1 included): an interval doubling reaches."""
    if isinstance(value, bool) or not isinstance(value, int) or value < interval or value % interval:
        return False
    ratio = value // interval
    return not ratio & (ratio - 1)


def check_max_interval(max_interval: Optional[int], interval: int) -> int:
    """``max_interval`` checked against ``interval`` (itself checked first: a positive int; ``int(2.5)`` would
    be 2) and returned (None: ``MAX_INTERVAL_FACTOR * interval``): ``interval`` times a power of two (1
    included: the interval never widens), so that doubling reaches it exactly."""
    if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
        raise ValueError(f"interval must be a positive integer, got {interval!r}")
    if max_interval is None:
        return MAX_INTERVAL_FACTOR * interval
    if not is_doubled_interval(max_interval, interval):
        raise ValueError(f"max_interval must be interval ({interval}) times a power of two, got {max_interval!r}")
    return max_interval


def widened_interval(current: int, interval: int, max_interval: int, step: int) -> int:
    """The interval after a scheduled look at step count ``step`` (a multiple of ``current``) that found
    re-planning cannot pay: doubled, up to ``max_interval``, from step ``interval`` on (the first look, at
    step 1 or 0, never widens); ``current`` off the schedule. The planner's re-plans
    (:meth:`PlanTracker.reschedule`) and FSDP2's sparse reduce-scatter's checks of an all-dense module
    widen by it."""
    if step >= interval and step % current == 0:
        return min(2 * current, max_interval)
    return current


def restored_interval(saved, interval: int, max_interval: int) -> int:
    """A checkpoint's current interval where this schedule can have it (``interval`` times a power of two,
    up to ``max_interval``), else ``interval``: one saved before the interval was kept (None), or under
    another ``interval`` or a larger ``max_interval``, restarts the widening."""
    return saved if is_doubled_interval(saved, interval) and saved <= max_interval else interval


class PlanTracker:
    r"""One tensor's statistics across steps and its re-planning schedule (identical on every rank).

    Each observed step feeds the per-rank counts ``k_r`` and the union ``u`` (from the aggregate) into
    EWMAs :math:`\bar x \leftarrow (1-a)\bar x + a x` (the first step sets them). A decision is due after
    the first observed step and then every ``interval`` steps, or at once after a sketch failed to
    decode (``force``); :meth:`stats` rounds the EWMAs up, taking the per-rank maximum over the steps
    since the last decision so that a spiky tensor keeps room for its spikes. Every step of a sketch or
    top-k plan also feeds the coordinates its inexact keys' request re-aggregated into an EWMA of that
    plan's (:meth:`observe_reaggregated`; kept across plan changes, the cost model's ``R``).

    The interval widens where re-planning cannot pay (:meth:`reschedule`): after each scheduled plan that
    keeps a tensor dense whatever the calibration, ``current_interval`` doubles, up to ``max_interval``; any
    other plan sets it back to ``interval``. Doubling keeps the statistics steps of every tensor on multiples
    of the smaller intervals, so the tensors of a bucket still share theirs.
    """

    def __init__(self, numel: int, row: int, world_size: int, interval: int = 16, alpha: float = 0.25,
                 sparse: bool = False, max_interval: Optional[int] = None):
        max_interval = check_max_interval(max_interval, interval)
        alpha = check_fraction("alpha", alpha)
        # checked, not coerced: a row of 0 would fail only at the first decision, and int() would truncate
        for name, value, least in (("numel", numel, 0), ("row", row, 1), ("world_size", world_size, 1)):
            check_int(value, name, least=least)
        self.numel, self.row, self.world_size = numel, row, world_size
        self.interval, self.alpha = interval, alpha
        self.max_interval = max_interval
        self.current_interval = interval   # steps between the statistics steps now (reschedule)
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
        """Whether a decision is due after step ``step``: the first, every ``current_interval``, or after a
        failure."""
        return self.force or step == 1 or step % self.current_interval == 0

    def reschedule(self, dominated: bool, forced: bool = False) -> None:
        """After the plan on an observation: ``dominated`` (the plan is dense and no calibration could move
        it, :func:`~lossless_hc.training.planner.dense_dominates`) doubles ``current_interval`` (up to
        ``max_interval``) where the observation was a scheduled one, at a step count of ``interval`` or more
        (not the first, nor one a failure ``forced``); otherwise it returns to ``interval``. A gradient non-zero
        in every row, as smooth activations leave them, then carries the statistics header on steps 1, 16,
        32, 64, 128, 256, 512, ... (``interval`` 16, ``max_interval`` 256) instead of one in 16: a rank
        scans its rows, packs the header and plans that much less often, and a change of its sparsity is seen
        up to ``max_interval`` steps later."""
        if not dominated:
            self.current_interval = self.interval
        elif not forced:
            self.current_interval = widened_interval(self.current_interval, self.interval, self.max_interval,
                                                     self.last_step)

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


class PlannedTensor:
    """The plan of one ``auto`` tensor (a part of :class:`~lossless_hc.training.strategies.AutoAggregator`,
    whose constructor sets what these methods read: ``tracker``, ``cost_model``, ``strategy``, ``allowed``, the
    plan's record): when a plan is due (:class:`PlanTracker`), which steps carry the statistics, the cost
    model's choice applied, and what it reports. Every decision is a function of the summed statistics and the
    broadcast calibration: identical on every rank."""

    # -- the plan ----------------------------------------------------------------------------------
    def _plan(self, without_model: bool = False) -> None:
        """Make the plan due (``without_model``: the caller found :meth:`dense_without_model` true)."""
        if self.cost_model is None and not (without_model or self.dense_without_model()):
            raise RuntimeError(f"{self.name}: a plan is due and no cost model is set (auto: not calibrated yet)")
        self._plan_due = False
        s = self.tracker.stats(element_bytes=self.plain_dtype.itemsize)
        if self.cost_model is None:   # no calibration could plan otherwise (dense_without_model)
            best, predicted = "dense", {}
        else:
            best, predicted = self.cost_model.choose(s, lossy=self.lossy, allowed=self.allowed, current=self.strategy,
                                                     batched=self.batched)
        self.predicted, self.plan_input = predicted, s
        self.plans += 1
        if best == "sketch":
            self._size_sketch(s)
        if best != self.strategy:
            append_recent(self.history, (self.steps, best))
            self._changed_from, self.strategy = self.strategy, best
        if best != "dense":   # (a re-plan off dense: every interval again)
            self.tracker.current_interval = self.tracker.interval

    def replan(self) -> None:
        """Plan again on the current statistics (its ``batched`` changed after this step's plan:
        :func:`~lossless_hc.training.auto.settle_message_plans`); a change of this step's that it revises
        stays one entry of ``history``, and none where it revises it back."""
        prior = self.history[-1] if self.history and self.history[-1][0] == self.steps else None
        before = self._changed_from
        self._plan()
        if prior is not None and self.history[-1] is not prior:
            self.history.remove(prior)
            if self.strategy == before:
                self.history.pop()

    def _size_sketch(self, s: TensorStats) -> None:
        self._sketch_stats = s
        cap, union = sketch_capacity(s)
        self._codec = LosslessCodec(self.numel, self.world_size, cap, self.row, self.seed, device=self.device,
                                    union_nnz=union)

    def _measure(self, strategy: str, started: float, ended: Optional[float] = None) -> None:
        self.steps += 1
        seconds = (time.perf_counter() if ended is None else ended) - started
        old = self.measured.get(strategy)
        self.measured[strategy] = seconds if old is None else 0.75 * old + 0.25 * seconds

    def _observe(self, ctx: AutoContext, union_keys: int) -> None:
        """The step's time, and (a statistics step, ``ctx.observed``) its counts, unless its gradient carried
        error memory (``ctx.carried_memory``: not the tensor's own counts; a plan due is still made)."""
        self._measure(ctx.strategy, ctx.started)
        if not ctx.observed:
            return
        forced = self.tracker.force
        if ctx.carried_memory:
            due = self.tracker.skip(step=self.steps)
        else:
            due = self.tracker.observe(ctx.rank_keys, union_keys, step=self.steps)
        if due:
            self._plan_due = True
            if self.cost_model is not None:
                self._plan()
            elif self.dense_without_model():
                self._plan(without_model=True)
            if not ctx.carried_memory:   # (a skipped step's plan stands on an older observation)
                self.tracker.reschedule(not self._plan_due and self.strategy == "dense"
                                        and dense_dominates(self.plan_input, self.allowed), forced)

    def dense_without_model(self) -> bool:
        """Whether a plan due now keeps dense without a cost model: an exact plan (not ``lossy``) on dense
        whose statistics no calibration could move off it (:func:`~lossless_hc.training.planner.dense_dominates`:
        e.g. a gradient non-zero in every row)."""
        return (not self.lossy and self.strategy == "dense" and self.tracker.rank_keys is not None
                and dense_dominates(self.tracker.stats(self.plain_dtype.itemsize, reset=False), self.allowed))

    def needs_cost_model(self) -> bool:
        """Whether a plan is due that only a cost model can make (the DDP adapter then calibrates before the
        next step); identical on every rank."""
        return self._plan_due and self.cost_model is None

    def carries_statistics(self) -> bool:
        """Whether the next step's first payload carries the statistics header (else it is a plain step:
        the bare tensor, :meth:`encode`, or :meth:`record_plain_step` where the engine reduced it in place;
        a half-precision plan's tensor in half precision, :meth:`plain_step`): always but for a dense,
        fp16 or bf16 plan (and a sparse gradient's allgather plan when the engine sums sparse tensors
        itself, ``native_sparse``: then the engine's own sparse allreduce is the bare step), which carries
        them on its first step, on step counts that are multiples of
        ``interval`` (each followed by a plan), after a failure (``force``) and when leaving THC or top-k
        (their error feedback is flushed by :meth:`encode`); a tensor that can only be dense, on its first
        step only. A function of the plan and the step count: identical on every rank (docs/DESIGN.md,
        "What is exchanged when")."""
        self._apply_due_plan()
        plain = (("allgather",) if self.native_sparse else ()) if self.sparse else PLAIN_STRATEGIES
        if self.strategy not in plain or self._thc is not None or self._topk is not None:
            return True
        if self.allowed == ("dense",):
            return self.steps == 0 or self.tracker.force
        return self._statistics_step()

    def _statistics_step(self) -> bool:
        """Whether the next step's counts are statistics: the first step, one in ``current_interval``
        (those after which a plan is due) and after a failure (``force``)."""
        return self.steps == 0 or self.tracker.force or (self.steps + 1) % self.tracker.current_interval == 0

    def plain_step(self) -> Optional[str]:
        """The plan whose plain step the next step is (None: it carries the statistics,
        :meth:`carries_statistics`): ``"dense"`` (or ``"allgather"``, ``native_sparse``) sends the gradient
        as it is, in ``plain_dtype``, what the engine's own allreduce sends; ``"fp16"`` or ``"bf16"`` the
        tensor in half precision, what the engine's own half-precision hook sends (:meth:`_plain`). An
        adapter may run such a step as the engine does, in place (:meth:`record_plain_step`)."""
        return None if self.carries_statistics() else self.strategy

    def _apply_due_plan(self) -> None:
        if self._plan_due:
            self._plan()

    def current_plan(self) -> tuple:
        """``(strategy, statistics it was planned on)`` after applying a plan that is due (the statistics
        are None before the first plan); identical on every rank."""
        self._apply_due_plan()
        return self.strategy, self.plan_input

    # -- inspection -----------------------------------------------------------------------------------
    def plan_stats(self) -> dict:
        """The chosen strategy, the predicted seconds of every candidate at the last plan (the sketch's: a
        lower bound where that already lost, :meth:`CostModel.choose`), the measured seconds (EWMA per
        strategy used, encode to result on this rank), the bytes this rank sent, the steps and how many
        of them were plain (dense without the statistics header, :meth:`carries_statistics`), the
        steps between re-plans now (``interval``: :meth:`PlanTracker.reschedule`), the
        last changes of strategy (``(step, strategy)``, at most ``capacity.HISTORY_KEEP``), whether the
        gradient is sparse, and the second collectives its message batches with it (``batched``, sorted)."""
        return {"strategy": self.strategy, "predicted_seconds": dict(self.predicted),
                "measured_seconds": dict(self.measured), "bytes_sent": self.bytes_sent, "steps": self.steps,
                "plain_steps": self.plain_steps, "interval": self.tracker.current_interval,
                "batched": sorted(self.batched),
                "changes": list(self.history), "fallbacks": self.fallbacks, "sparse": self.sparse}
