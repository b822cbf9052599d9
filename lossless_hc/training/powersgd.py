r"""PowerSGD as the planner's strategy for a whole DDP bucket (``AutoHookState(lossy=True)``).

PowerSGD (Vogels et al., 2019) sends a rank-``r`` approximation of each gradient matrix ``M``
(``m x n``): with ``Q`` from the previous step (warm start), ``P = sum_ranks M Q`` (allreduce),
orthogonalise ``P``, ``Q = sum_ranks M^T P / N`` (allreduce), and every rank uses ``P Q^T``. Error feedback
keeps ``M - P Q^T`` on each rank and adds it to the next step's gradient. Its state (the error and
``P, Q`` memories) belongs to the bucket's layout, and torch's ``powerSGD_hook`` takes a whole bucket, so
the planner offers it per bucket, beside the per-parameter plans of :mod:`lossless_hc.training.strategies`.
We run torch's own implementation (``PowerSGDState`` + ``powerSGD_hook``), one state per bucket, its
collectives on the bucket's own Gloo group: the hook issues the P and Q allreduces from future
callbacks, which may run while the main thread issues the next bucket's collectives, so on one shared
group the ranks could pair mismatched collectives (lossless_hc/bench/workloads/baselines.py found it:
Gloo aborts with "Received data size doesn't match expected size"); one group per bucket keeps each
bucket's sequence in order.

Defaults (the bench's PowerSGD baseline, torch's recommendations): rank :data:`POWERSGD_RANK` (4),
``min_compression_rate`` :data:`MIN_COMPRESSION_RATE` (2: torch's default; smaller tensors, biases
included, are sent uncompressed in the hook's first allreduce), error feedback and warm start on (torch
recommends both; without error feedback PowerSGD is biased), no PowerSGD before step index
:data:`POWERSGD_START` (2: torch's ``start_powerSGD_iter`` minimum with error feedback, after DDP's bucket
rebuild at the second step), Q's random start seeded by the spec's ``seed`` on every rank, and
``orthogonalization_epsilon`` :data:`ORTHOGONALIZATION_EPSILON` (1e-8; torch's default 0 divides by a
zero column's norm in the Gram-Schmidt it uses at ranks 1 and 2, so a matrix whose gradient is zero on
every rank, which the planner does not rule out, would turn NaN; at ranks above 2 torch uses QR, which
ignores it).

The decision (:meth:`PowerSGDPlanner.bucket`). After every re-plan of a bucket's parameters (and from
step index ``start`` on) the bucket compares PowerSGD's predicted step,
:meth:`~lossless_hc.training.planner.CostModel.predict_powersgd` of
:func:`powersgd_layout`, with its per-parameter plans in one message,
:meth:`~lossless_hc.training.planner.CostModel.predict_message`, and takes PowerSGD when it compresses some
tensor and is predicted more than :data:`~lossless_hc.training.planner.SWITCH_MARGIN` faster beyond the first
allreduce's latency (the rule of :meth:`~lossless_hc.training.planner.CostModel.choose`). Inputs: the
broadcast calibration, the bucket's shapes and the parameters' plans and statistics, which come from
aggregated payloads: identical on every rank, so every rank decides alike at the same step.

A part of a bucket. DDP fills buckets in reverse registration order, so an embedding table often shares its
bucket with dense layers (BERT's input table with the first encoder layers). torch's hook would compress the
table too, at the cost of the products of a dense matrix of its size (and with its error), where an
allgather plan sends its few rows exactly. So the bucket also prices PowerSGD on a part of it: the matrices
whose share of PowerSGD's step (``c_p d + f_p F`` and their P and Q bytes) is below their own plan's
predicted step beyond the first allreduce's latency; the bucket's other gradients keep their plans, in a
message of their own (predicted ``predict_powersgd(part) + predict_message(rest)``). The cheaper of the
whole bucket and the part is compared with the per-parameter plans as above. A part runs torch's hook on a
flat copy of its gradients (:class:`_PartBucket`, which has what the hook reads of a ``GradBucket``) on a
group of its own, beside the message of the others on the bucket's group; the averages are copied back into
the bucket.

Switching. PowerSGD is sticky for the planner: once a bucket takes it, the cost model is not asked
again. Its cost depends on the shapes only, and under it the per-parameter statistics are no longer
observed (its aggregate is a dense low-rank matrix), so nothing new could reverse the prediction. What
can reverse it is a measurement: the DDP step guard (:mod:`lossless_hc.training.guard`) times PowerSGD
buckets with the per-parameter plans, and a dense verdict makes the bucket leave PowerSGD for good
(:meth:`PowerSGDPlanner.leave`): its error memory, taken from torch's state, is added to the bucket of
that first dense step, so it is sent rather than dropped. The guard's third window runs PowerSGD on every
bucket it may take (:meth:`PowerSGDPlanner.window_bucket`, a trial state per bucket not already on it
whole); a verdict for it makes those states the buckets' for good, and any other verdict hands their
memories back (:meth:`PowerSGDPlanner.end_trial`). On the switch, each parameter's lossy error feedback (THC's
memory, top-k's residual: :meth:`~lossless_hc.training.strategies.AutoAggregator.take_lossy_memory`) is
added to its gradient in the bucket before PowerSGD's own error feedback, so what those strategies had
not sent yet is sent (or kept in PowerSGD's memory): over the steps, ``N`` times the sum of the averaged
outputs plus every rank's remaining memories equals the sum of every rank's gradients, up to float
rounding (tests/test_planner_powersgd.py checks it across a top-k -> PowerSGD switch).

Engines without a bucket hook (Horovod, BytePS: one tensor per call) or with another collective (FSDP2's
reduce-scatter) are not offered PowerSGD.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from lossless_hc.lhc.layout import check_int, check_uint64
from lossless_hc.lhc.layout import is_real as _is_real
from lossless_hc.training.aggregate import AggregationStats
from lossless_hc.training.planner import SWITCH_MARGIN, CostModel

POWERSGD_RANK = 4          # matrix_approximation_rank (the bench's baseline)
POWERSGD_START = 2         # the first step index (0-based) PowerSGD may run at (torch's start_powerSGD_iter)
MIN_COMPRESSION_RATE = 2   # torch's min_compression_rate: a matrix is compressed iff (m+n) r 2 < m n
ORTHOGONALIZATION_EPSILON = 1e-8   # a zero gradient matrix stays finite at ranks 1 and 2 (module doc)


@dataclass(frozen=True)
class PowerSGDLayout:
    """What torch's ``powerSGD_hook`` sends for a bucket (module doc): ``numel`` coordinates, of which
    ``uncompressed`` are sent as they are; ``p_numel`` and ``q_numel`` words of the P and Q allreduces;
    ``flops`` of its matrix products and orthogonalisations; ``compressed``: which tensors (bucket order)
    it compresses."""

    numel: int
    uncompressed: int
    p_numel: int
    q_numel: int
    flops: int
    compressed: tuple


def check_min_compression_rate(value) -> float:
    """``value`` as a float if it is a real number > 0 (NaN, a bool or a string is a ValueError)."""
    if not (_is_real(value) and value > 0):   # NaN fails too
        raise ValueError(f"min_compression_rate must be a number > 0, got {value!r}")
    return float(value)


def powersgd_layout(shapes, rank: int, min_compression_rate: float) -> PowerSGDLayout:
    """:class:`PowerSGDLayout` of a bucket of gradients of ``shapes`` (bucket order), as
    ``powerSGD_hook`` with ``matrix_approximation_rank=rank`` splits it: each gradient viewed as
    ``shape[0] x rest``, compressed at rank ``r' = min(rows, cols, rank)`` iff
    ``(rows + cols) r' min_compression_rate < rows cols`` (torch's ``_should_compress``). ``rank`` an int
    >= 1 and ``min_compression_rate`` a number > 0, else TypeError / ValueError (rank 0 "compressed" every
    matrix into no bytes and no flops, a PowerSGD step predicted free; a fractional rank is not truncated)."""
    check_int(rank, "PowerSGD rank", least=1)
    check_min_compression_rate(min_compression_rate)
    numel = uncompressed = p = q = flops = 0
    compressed = []
    for i, shape in enumerate(shapes):
        shape = tuple(int(x) for x in shape)
        size = math.prod(shape)
        if not shape or size == 0:
            raise ValueError(f"PowerSGD views each gradient as a matrix; got shape {shape}")
        rows, cols = shape[0], size // shape[0]
        r = min(rows, cols, rank)
        numel += size
        if (rows + cols) * r * min_compression_rate < rows * cols:
            compressed.append(i)
            p += rows * r
            q += cols * r
            flops += 6 * rows * cols * r + 2 * (rows + cols) * r * r
        else:
            uncompressed += size
    return PowerSGDLayout(numel, uncompressed, p, q, flops, tuple(compressed))


def powersgd_seed(seed: int) -> int:
    """torch's ``random_seed`` for the spec's 64-bit ``seed``: its two 32-bit halves XORed (numpy's
    ``RandomState``, which ``PowerSGDState`` seeds with it, takes only [0, 2**32): a larger seed, valid for the
    spec and the codecs, would fail only when a bucket first goes to PowerSGD, mid-run). Seeds below 2**32 are
    kept as they are; the same on every rank."""
    seed = check_uint64(seed, "seed")
    return (seed ^ (seed >> 32)) & 0xFFFFFFFF


class _PartBucket:
    """What ``powerSGD_hook`` reads of a ``GradBucket`` (``buffer()``, ``gradients()``, ``index()``,
    ``is_last()``) for some of a bucket's gradients: a flat copy of them, and views of it as the
    gradients (the hook writes its result through the views and returns the buffer)."""

    def __init__(self, index: int, grads: Sequence[torch.Tensor]):
        self._index = int(index)
        self._buffer = torch.cat([g.detach().reshape(-1) for g in grads])
        sizes = [g.numel() for g in grads]
        self._grads = [v.view(g.shape) for v, g in zip(torch.split(self._buffer, sizes), grads)]

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def gradients(self) -> list:
        return self._grads

    def index(self) -> int:
        return self._index

    def is_last(self) -> bool:   # torch's state counts iterations at the last bucket; run() sets them
        return False


class PowerSGDBucket:
    """torch's PowerSGD on one bucket: its own ``PowerSGDState`` (error feedback and warm start on),
    run by :meth:`run` on the bucket's own process group. ``members``: the positions (bucket order) of
    the gradients it takes, None for all of them (the bucket's other gradients keep their per-parameter
    plans, module doc); ``names``: those gradients' parameters, ``bucket_names``: the whole bucket's."""

    def __init__(self, names: Sequence[str], layout: PowerSGDLayout, rank: int, start: int,
                 min_compression_rate: float, seed: int, since_step: int, predicted: dict,
                 members: Optional[Sequence[int]] = None, bucket_names: Optional[Sequence[str]] = None):
        from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState

        self.bucket_names = list(bucket_names if bucket_names is not None else names)
        self.members = None if members is None else tuple(int(i) for i in members)
        self.names = list(names) if self.members is None else [self.bucket_names[i] for i in self.members]
        self.layout = layout
        self.since_step, self.predicted = int(since_step), dict(predicted)
        self.steps = 0
        self.left_step: Optional[int] = None   # the step index it left PowerSGD at (the step guard), if it did
        self.state = PowerSGDState(process_group=None, matrix_approximation_rank=rank, start_powerSGD_iter=start,
                                   min_compression_rate=min_compression_rate, use_error_feedback=True,
                                   warm_start=True, random_seed=powersgd_seed(seed),
                                   orthogonalization_epsilon=ORTHOGONALIZATION_EPSILON)

    def __setstate__(self, state):
        # A state pickled before PowerSGD could take part of a bucket (torch.save(ddp_model)) took all of it.
        state.setdefault("members", None)
        state.setdefault("bucket_names", list(state["names"]))
        self.__dict__.update(state)

    def run(self, bucket, group) -> torch.futures.Future:
        """``powerSGD_hook`` on ``bucket`` over ``group``: the future of the averaged bucket (a whole
        bucket: DDP's ``GradBucket``; a part: :meth:`part`)."""
        from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import powerSGD_hook

        st = self.state
        st.process_group = group
        st.iter = st.start_powerSGD_iter   # the planner decides when PowerSGD starts: the hook compresses
        self.steps += 1
        return powerSGD_hook(st, bucket)

    def part(self, index: int, grads: Sequence[torch.Tensor]) -> _PartBucket:
        """The bucket (index ``index``, gradients ``grads`` in bucket order) reduced to its members, for
        :meth:`run`: a copy of them, so the hook leaves the bucket's other gradients as they are."""
        return _PartBucket(index, self.of_members(grads))

    def of_members(self, items: Sequence) -> list:
        """The entries of ``items`` (one per gradient of the bucket, bucket order) PowerSGD takes."""
        return list(items) if self.members is None else [items[i] for i in self.members]

    def of_others(self, items: Sequence) -> list:
        """The entries of ``items`` (bucket order) of the gradients PowerSGD leaves to their plans."""
        return [] if self.members is None else [x for i, x in enumerate(items) if i not in self.members]

    def add_to(self, flat: torch.Tensor, buffer: torch.Tensor, grads: Sequence[torch.Tensor]) -> None:
        """Add ``flat`` (over the gradients PowerSGD takes, bucket order: its error memory) to them, in the
        bucket ``buffer`` whose gradients are ``grads`` (views into it)."""
        if self.members is None:
            buffer.add_(flat)
            return
        taken = self.of_members(grads)
        for g, e in zip(taken, torch.split(flat, [g.numel() for g in taken])):
            g.add_(e.view(g.shape))

    def error(self, bucket_index: int) -> Optional[torch.Tensor]:
        """This rank's error-feedback memory of the bucket (flat: its gradients', bucket order), None before
        a step."""
        return self.state.error_dict.get(bucket_index)

    def wire_bytes(self, element_bytes: int = 4) -> int:
        """Bytes this rank contributes per step over the three allreduces."""
        return int(sum(b for _, b in CostModel.powersgd_collectives(self.layout, element_bytes)))


class PowerSGDPlanner:
    """The buckets' PowerSGD decisions and states (module doc) of one DDP hook state.

    Args:
        rank: ``matrix_approximation_rank``; start: the first step index (0-based) PowerSGD may run at
        (>= 2); min_compression_rate: torch's; seed: Q's random start (identical on every rank);
        stats: the hook state's counters (PowerSGD steps are added to them).
    """

    def __init__(self, rank: int = POWERSGD_RANK, start: int = POWERSGD_START,
                 min_compression_rate: float = MIN_COMPRESSION_RATE, seed: int = 0,
                 stats: Optional[AggregationStats] = None):
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
            raise ValueError(f"powersgd_rank must be a positive integer, got {rank!r}")
        if isinstance(start, bool) or not isinstance(start, int) or start < 2:
            raise ValueError(f"powersgd_start must be an integer >= 2 (torch's start_powerSGD_iter with error "
                             f"feedback), got {start!r}")
        self.rank, self.start = rank, start
        self.min_compression_rate = check_min_compression_rate(min_compression_rate)
        self.seed = check_uint64(seed, "seed")   # int(1.5) would be 1 (every rank must agree)
        self.agg_stats = stats if stats is not None else AggregationStats()
        self.buckets: dict = {}      # bucket index -> PowerSGDBucket (sticky)
        self.decisions: dict = {}    # bucket index -> the last comparison (stats())
        self._compared: dict = {}    # bucket index -> the parameters' plan count at the last comparison
        self.trials: dict = {}       # bucket index -> the step guard's whole-bucket PowerSGD (window_bucket)

    def __setstate__(self, state):
        state.setdefault("trials", {})   # pickled before the step guard's PowerSGD window
        self.__dict__.update(state)

    def describe(self) -> str:
        return f"powersgd(rank={self.rank}, start={self.start}, min_compression_rate={self.min_compression_rate})"

    @staticmethod
    def offered(buffer: torch.Tensor, grads: Sequence[torch.Tensor], world_size: int) -> bool:
        """Whether a bucket can go to PowerSGD: more than one rank, a dense float32 bucket, every
        gradient at least 1-D and non-empty (torch's hook views each as a matrix)."""
        return (world_size > 1 and not buffer.is_sparse and buffer.dtype == torch.float32 and len(grads) > 0
                and all(g.dim() >= 1 and g.numel() > 0 for g in grads))

    def bucket(self, index: int, step: int, aggregators, grads: Sequence[torch.Tensor], buffer: torch.Tensor,
               cost_model: CostModel, world_size: int) -> Optional[PowerSGDBucket]:
        """The bucket's PowerSGD state if it runs PowerSGD this step, else None (its per-parameter plans
        run). ``step``: the 0-based step index, identical on every rank; ``aggregators``: the bucket's
        parameters' (:class:`~lossless_hc.training.strategies.AutoAggregator`), in bucket order, with
        ``grads`` their gradients (views into ``buffer``). A bucket taking PowerSGD now gets its
        parameters' lossy error feedback added to ``grads`` (module doc)."""
        chosen = self.buckets.get(index)
        if chosen is not None:
            if chosen.bucket_names != [a.name for a in aggregators]:
                raise RuntimeError(f"DDP bucket {index} changed its parameters after going to PowerSGD "
                                   f"({chosen.bucket_names} -> {[a.name for a in aggregators]}); its error feedback "
                                   "would no longer match")
            return chosen
        if step < self.start or not self.offered(buffer, grads, world_size):
            return None
        plans = [a.current_plan() for a in aggregators]
        stamp = sum(a.plans for a in aggregators)
        if any(s is None for _, s in plans) or self._compared.get(index) == stamp:
            return None   # not planned yet, or nothing new since the last comparison
        self._compared[index] = stamp
        shapes = [tuple(g.shape) for g in grads]
        layout = powersgd_layout(shapes, self.rank, self.min_compression_rate)
        t_psgd = cost_model.predict_powersgd(layout, world_size)
        t_plans = cost_model.predict_message(plans)
        predicted = {"powersgd": t_psgd, "per_parameter": t_plans}
        members = self._members(layout, shapes, plans, cost_model, world_size)
        if members is not None:
            part = powersgd_layout([shapes[i] for i in members], self.rank, self.min_compression_rate)
            rest = [plan for i, plan in enumerate(plans) if i not in members]
            predicted["powersgd_part"] = (cost_model.predict_powersgd(part, world_size)
                                          + cost_model.predict_message(rest))
        common = cost_model.calibration.link.latency(world_size)
        best = "powersgd"
        if members is not None and predicted["powersgd_part"] < t_psgd:
            best, layout = "powersgd_part", part
        take = bool(layout.compressed) and predicted[best] - common < (1.0 - SWITCH_MARGIN) * (t_plans - common)
        self.decisions[index] = {"strategy": best if take else "per_parameter", "step": step,
                                 "predicted_seconds": predicted, "parameters": [a.name for a in aggregators],
                                 "compressed": len(layout.compressed)}
        if not take:
            return None
        names = [a.name for a in aggregators]
        chosen = self.buckets[index] = PowerSGDBucket(
            names, layout, self.rank, self.start, self.min_compression_rate, self.seed, step, predicted,
            members=members if best == "powersgd_part" else None)
        for agg, g in zip(chosen.of_members(aggregators), chosen.of_members(grads)):
            agg.add_lossy_memory_to(g)
        return chosen

    def _members(self, layout: PowerSGDLayout, shapes, plans, cost_model: CostModel,
                 world_size: int) -> Optional[tuple]:
        """The gradients (bucket positions) PowerSGD would take of a bucket it need not take whole: the
        matrices it compresses whose share of its step, ``c_p d + f_p F`` and the P and Q bytes, is
        predicted below their own plan's step beyond the first allreduce's latency (an embedding table on
        an allgather plan stays on it). None when that is every gradient of the bucket, or none."""
        common = cost_model.calibration.link.latency(int(world_size))
        members = []
        for i in layout.compressed:
            # the matrix alone on PowerSGD, less the three allreduces' latencies (the bucket pays them once)
            one = powersgd_layout([shapes[i]], self.rank, self.min_compression_rate)
            share = cost_model.predict_powersgd(one, world_size) - 3 * common
            if share < cost_model.predict_message([plans[i]]) - common:
                members.append(i)
        return tuple(members) if members and len(members) < len(shapes) else None

    def leave(self, index: int, step: int) -> Optional[torch.Tensor]:
        """Bucket ``index`` stops running PowerSGD (the step guard's dense verdict, from 0-based step
        ``step``): returns this rank's error memory of it (flat over the gradients it takes, bucket order,
        as :meth:`PowerSGDBucket.add_to` adds it; None if it never ran or
        already left), removed from torch's state, for the caller to add to the bucket it sends instead
        (module doc). Its warm-start memories are dropped with it."""
        chosen = self.buckets.get(index)
        if chosen is None or chosen.left_step is not None:
            return None
        chosen.left_step = int(step)
        err = chosen.state.error_dict.pop(index, None)
        chosen.state.p_memory_dict.clear()
        chosen.state.q_memory_dict.clear()
        return err

    def window_bucket(self, index: int, step: int, aggregators, grads: Sequence[torch.Tensor],
                      buffer: torch.Tensor, world_size: int, verdict: bool) -> Optional[PowerSGDBucket]:
        """The state bucket ``index`` runs in the step guard's PowerSGD window (:mod:`lossless_hc.training.guard`:
        torch's hook on every bucket it may take), None where it may not (:meth:`offered`): its own
        whole-bucket PowerSGD where the plans gave it one, else the trial's (error feedback and warm start
        on, created at its first window and kept until :meth:`end_trial`). ``verdict``: the guard's verdict
        is PowerSGD; the trial's state becomes the bucket's for good (sticky, as the planner's own), and
        what the per-parameter plans had not sent yet (each aggregator's lossy error feedback, a PowerSGD
        part's memory) is added to ``grads`` first, so PowerSGD sends it or keeps it in its memory."""
        chosen = self.buckets.get(index)
        names = [a.name for a in aggregators]
        if chosen is not None and chosen.members is None and chosen.left_step is None:
            if chosen.bucket_names != names:
                raise RuntimeError(f"DDP bucket {index} changed its parameters after going to PowerSGD "
                                   f"({chosen.bucket_names} -> {names}); its error feedback would no longer match")
            return chosen
        if not self.offered(buffer, grads, world_size):
            return None
        trial = self.trials.get(index)
        if trial is None:
            layout = powersgd_layout([tuple(g.shape) for g in grads], self.rank, self.min_compression_rate)
            trial = self.trials[index] = PowerSGDBucket(names, layout, self.rank, self.start,
                                                        self.min_compression_rate, self.seed, step, {})
        elif trial.bucket_names != names:
            raise RuntimeError(f"DDP bucket {index} changed its parameters during the step guard's trial "
                               f"({trial.bucket_names} -> {names}); its PowerSGD memory would no longer match")
        if not verdict:
            return trial
        if chosen is not None:   # a part of the bucket on PowerSGD: its memory goes into the whole bucket's
            error = self.leave(index, step)
            if error is not None:
                chosen.add_to(error, buffer, grads)
        for agg, g in zip(aggregators, grads):
            agg.add_lossy_memory_to(g)
        del self.trials[index]
        trial.since_step = int(step)
        self.buckets[index] = trial
        self.decisions[index] = {"strategy": "powersgd", "step": int(step), "predicted_seconds": {},
                                 "parameters": names, "compressed": len(trial.layout.compressed),
                                 "step_guard": True}
        return trial

    def end_trial(self, index: int) -> Optional[torch.Tensor]:
        """Bucket ``index`` leaves the step guard's trial state (a verdict for the plans or dense): this rank's
        error memory of it, flat over the whole bucket (for the caller to add to the bucket it sends), or
        None without one. The state, warm start included, is dropped."""
        trial = self.trials.pop(index, None)
        return None if trial is None else trial.state.error_dict.pop(index, None)

    def parameter_names(self) -> frozenset:
        """The names of the parameters whose buckets went to PowerSGD (no longer planned per parameter)."""
        return frozenset(name for chosen in self.buckets.values() for name in chosen.names)

    def count_step(self, chosen: PowerSGDBucket, grads: Sequence[torch.Tensor]) -> None:
        """Account one PowerSGD step of a bucket (its gradients ``grads``, bucket order) in the hook state's
        counters: the gradients PowerSGD takes (the others are counted by their plans)."""
        st = self.agg_stats
        grads = chosen.of_members(grads)
        st.tensors += len(grads)
        st.compressed += len(chosen.layout.compressed)
        st.sent_dense += len(grads) - len(chosen.layout.compressed)
        st.dense_bytes += sum(g.numel() * g.element_size() for g in grads)
        st.payload_bytes += chosen.wire_bytes()

    def plan_stats(self, plan: dict) -> dict:
        """``plan`` (``{name: AutoAggregator.plan_stats()}``) with the PowerSGD buckets' parameters marked
        ``"strategy": "powersgd"``, their bucket index, the switch in their ``changes`` and PowerSGD's
        steps (the bucket's bytes: :meth:`stats`)."""
        for index, chosen in self.buckets.items():
            for name in chosen.names:
                p = plan.get(name)
                if p is not None:
                    p.update(strategy="powersgd", bucket=index, powersgd_steps=chosen.steps,
                             changes=list(p["changes"]) + [(chosen.since_step, "powersgd")])
        return plan

    def stats(self) -> dict:
        """Per bucket index: the last comparison (strategy: ``powersgd``, ``powersgd_part`` or
        ``per_parameter``; step; predicted seconds of PowerSGD on the whole bucket, on the part of it
        where there is one, with the other gradients' plans, and of the per-parameter plans; parameters;
        tensors PowerSGD compresses) and, for PowerSGD buckets, its steps, wire bytes per step and the
        parameters it takes (``powersgd_parameters``)."""
        out = {}
        for index, d in self.decisions.items():
            out[index] = dict(d)
            chosen = self.buckets.get(index)
            if chosen is not None:
                out[index].update(strategy="powersgd" if chosen.members is None else "powersgd_part",
                                  powersgd_parameters=list(chosen.names), since_step=chosen.since_step,
                                  steps=chosen.steps, left_step=chosen.left_step,
                                  wire_bytes_per_step=chosen.wire_bytes(),
                                  predicted_seconds=dict(chosen.predicted))
        return out
