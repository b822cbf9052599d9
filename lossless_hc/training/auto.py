"""``auto``: the planner's configuration and the engine-independent halves of its adapters.

* :class:`AutoSpec` (``Compression.auto``, ``AutoHookState``, ``AutoFSDPState``): validated options;
  builds one :class:`~lossless_hc.training.strategies.AutoAggregator` per parameter on the calibration
  every rank shares (:mod:`lossless_hc.training.calibration`).
* :class:`AutoMessage` / :func:`decode_message`: many tensors in one message (a DDP bucket, an FSDP2
  shard): the first payloads concatenated into one SUM, then at most one more allreduce per payload
  dtype and one allgather for all the tensors whose strategy needs a second collective.
* :class:`AutoCompressorAdapter`: the per-tensor compressor of the Horovod (and BytePS) plugins; a
  second collective is issued as an asynchronous *named* engine operation from ``decompress`` and
  waited for when the step's last tensor has been decompressed (as the dense fallback of
  :class:`~lossless_hc.training.adapter.CompressorAdapter`); the tensor ``decompress`` returned is then
  filled in place, before the optimizer reads it. Where the engine supplies a blocking broadcast
  (Horovod), it runs the step guard (:mod:`lossless_hc.training.guard`) over its tensors' plans.

Deadlock freedom: which tensors make a second collective, and its size, are functions of the summed
first payloads, which every rank holds bit for bit; :func:`decode_message` issues its collectives in
a fixed order (allreduce per dtype, in the order of :data:`~lossless_hc.training.message.PART_DTYPES`,
then the allgather), and the named operations of the adapter are matched by name, so the order in
which ranks reach them is free.
"""
from __future__ import annotations

import hashlib
import time
from typing import Callable, Optional, Sequence

import torch

from lossless_hc.thc.table import check_bits
from lossless_hc.lhc.layout import check_fraction
from lossless_hc.training.adapter import AggregatorSpec, CompressorAdapter, EncodedTensor
from lossless_hc.training.aggregate import TensorAggregator
from lossless_hc.training.calibration import LINK_SIZES, calibrate, link_sizes, topk_numel_for
from lossless_hc.training.guard import StepGuard
from lossless_hc.training.message import PART_DTYPES, check_sums, message_layout, pack_parts
from lossless_hc.training.planner import (HALF_STRATEGIES, LOSSY_MIN_BYTES, LOSSY_STRATEGIES, STRATEGIES, THC_BITS,
                                          TOPK_RATIO, TOPK_STRATEGIES, Calibration, CostModel,
                                          batched_second_collectives)
from lossless_hc.training.plan_tracker import check_max_interval
from lossless_hc.training.strategies import AutoAggregator



def as_strategies(strategies) -> Optional[tuple]:
    """``strategies`` as a tuple, read once (an iterator is spent by a look), a single name as itself
    ("sketch" is not its letters); None stays None. What AutoSpec and the adapters check it as."""
    if strategies is None:
        return None
    return (strategies,) if isinstance(strategies, str) else tuple(strategies)


class AutoSpec(AggregatorSpec):
    """``auto``: per tensor, the cheapest strategy the cost model predicts (exact ones unless ``lossy``;
    exact ones only for a sparse gradient, which :meth:`make` sees from the tensor it is given).

    Args:
        lossy: also consider fp16, bf16, THC and top-k (error feedback).
        interval: steps between re-plans (each tensor is first planned after its first step).
        max_interval: where a tensor's statistics keep it dense whatever the calibration (e.g. non-zero in
            every row), its re-plans, and a dense plan's statistics steps, come half as often after each
            such plan, up to every ``max_interval`` steps (``interval`` times a power of two; None: 16
            ``interval``, 256 steps; ``interval``: never wider); any other plan returns to ``interval``
            (:meth:`~lossless_hc.training.plan_tracker.PlanTracker.reschedule`).
        alpha: EWMA weight of the newest step's statistics.
        first: the first step's strategy (None: "dense" for dense gradients, "allgather" for sparse
            ones; both exact, and they measure the statistics); a tensor that cannot take it (a lossy
            one on a sparse, float64 or small tensor) starts dense, or where ``strategies`` leaves out
            dense, with the first of them it can take in the planner's order (the exact ones first).
            One of ``strategies`` where given; a lossy one needs ``lossy=True`` (ValueError otherwise).
        strategies: restrict the candidates to these among what ``lossy`` allows (None: all of them;
            ValueError when it allows none of them).
        calibration: a :class:`~lossless_hc.training.planner.Calibration` identical on every rank (skips
            the start-up measurement; e.g. ``Calibration.default(bandwidth_bits=1e9)``).
        topk_ratio, thc_bits: the lossy strategies' parameters.
        seed: hash seed of the sketch codecs, identical on every rank.
        partial: a sketch decode with inexact keys re-aggregates only their unproven coordinates (False:
            densely; for engines whose only second collective is the dense fallback, BytePS).
        lossy_min_bytes: with ``lossy``, tensors smaller than this are still planned exactly
            (:data:`~lossless_hc.training.planner.LOSSY_MIN_BYTES`, 64 KiB; 0: every tensor may go lossy); a
            dense verdict of the step guard sends them, as every float32 gradient, in the engine's half
            precision (``AutoAggregator.guard_alternative``).
    """

    kind = "auto"
    # Gradient dtypes whose plain steps (a dense plan's bare tensor) go in the gradient's own dtype, as
    # the engine's own allreduce sends them; the others go in the aggregator's wire dtype (float32). Set
    # by an adapter whose engine carries those dtypes as they are: Horovod (float16; it has no bfloat16
    # allreduce), DDP and FSDP2 (both: their own parts of a message, training/message.py).
    native_plain_dtypes: tuple = ()

    def __init__(self, lossy: bool = False, interval: int = 16, alpha: float = 0.25, first: Optional[str] = None,
                 strategies: Optional[Sequence[str]] = None, calibration: Optional[Calibration] = None,
                 topk_ratio: float = TOPK_RATIO, thc_bits: int = THC_BITS, seed: int = 0, partial: bool = True,
                 lossy_min_bytes: int = LOSSY_MIN_BYTES, max_interval: Optional[int] = None, **extra):
        super().__init__(seed, **extra)
        if not isinstance(lossy, bool):
            raise ValueError(f"lossy must be True or False, got {lossy!r}")
        max_interval = check_max_interval(max_interval, interval)
        alpha = check_fraction("alpha", alpha)
        if first is not None and first not in STRATEGIES:
            raise ValueError(f"first must be one of {', '.join(STRATEGIES)}; got {first!r}")
        strategies = as_strategies(strategies)
        if strategies is not None:
            bad = [s for s in strategies if s not in STRATEGIES]
            if bad or not strategies:
                raise ValueError(f"strategies must be a non-empty subset of {', '.join(STRATEGIES)}; "
                                 f"got {strategies!r}")
        # Contradictions are refused here rather than planned around: each would leave every tensor
        # on another strategy than the one named, without a word.
        if lossy is not True and first in LOSSY_STRATEGIES:
            raise ValueError(f"first={first!r}: lossy strategies need lossy=True")
        if lossy is not True and strategies is not None and all(s in LOSSY_STRATEGIES for s in strategies):
            raise ValueError(f"strategies={strategies!r}: lossy strategies need lossy=True")
        if first is not None and strategies is not None and first not in strategies:
            raise ValueError(f"first={first!r} is not among strategies {strategies!r}")
        if calibration is not None and not isinstance(calibration, Calibration):
            raise TypeError(f"calibration must be a planner.Calibration, got {type(calibration).__name__}")
        topk_ratio = check_fraction("topk_ratio", topk_ratio)
        # Checked here, not when a THC plan is first built mid-run (2.5 was truncated to 2).
        check_bits(thc_bits, "thc_bits")
        self.lossy, self.interval, self.alpha, self.first = lossy, interval, alpha, first
        self.max_interval = max_interval
        self.strategies = strategies
        self.topk_ratio, self.thc_bits = topk_ratio, thc_bits
        if not isinstance(partial, bool):
            raise ValueError(f"partial must be True or False, got {partial!r}")
        self.partial = partial
        if isinstance(lossy_min_bytes, bool) or not isinstance(lossy_min_bytes, int) or lossy_min_bytes < 0:
            raise ValueError(f"lossy_min_bytes must be a non-negative integer, got {lossy_min_bytes!r}")
        self.lossy_min_bytes = lossy_min_bytes
        self.given_calibration = calibration is not None
        self.calibration: Optional[Calibration] = calibration
        self._cost_model: Optional[CostModel] = None
        self.calibration_cost: dict = {}   # what the start-up measurement cost (calibration_stats)

    def options(self) -> dict:
        # A given calibration by a digest of its numbers: the configuration checks hash this repr, and
        # ranks given different ones would plan different collectives (DDP hung; FSDP2, Horovod: Gloo's
        # or Horovod's own errors)
        calibration = "measured"
        if self.given_calibration:
            numbers = repr([float(v) for v in self.calibration.as_list()])   # repr: every bit of each float
            calibration = f"given {hashlib.sha256(numbers.encode()).hexdigest()[:12]}"
        return {"lossy": self.lossy, "interval": self.interval, "max_interval": self.max_interval,
                "alpha": self.alpha, "first": self.first,
                "strategies": self.strategies, "calibration": calibration,
                "topk_ratio": self.topk_ratio, "thc_bits": self.thc_bits, "seed": self.seed, "partial": self.partial,
                "lossy_min_bytes": self.lossy_min_bytes}

    def set_calibration(self, calibration: Calibration) -> None:
        """The broadcast calibration (identical on every rank); aggregators built later plan with it."""
        self.calibration = calibration
        self._cost_model = None

    def measure(self, allreduce: Callable, allgather: Callable, broadcast: Callable, rank: int, world_size: int,
                device="cpu", largest_bytes: Optional[int] = None) -> None:
        """Calibrate on the engine's collectives (:func:`~lossless_hc.training.calibration.calibrate`: a
        collective, every rank at the same point) unless a calibration was given, timing the link at
        :func:`~lossless_hc.training.calibration.link_sizes` of ``largest_bytes`` (the largest tensor's
        float32 bytes, when the adapter knows the model; else of the largest of ``LINK_SIZES``) and top-k's
        step on :func:`~lossless_hc.training.calibration.topk_numel_for` of it, and record what it cost
        (:meth:`calibration_stats`)."""
        if self.calibration is not None:
            return
        sizes = link_sizes(LINK_SIZES[-1] if largest_bytes is None else largest_bytes)
        # the half allreduce's own price only where a plan may send half precision
        half = self.lossy and bool(set(self.strategies or HALF_STRATEGIES) & set(HALF_STRATEGIES))
        # the top-k strategies' steps timed where one is a candidate
        topk = self.lossy and bool(set(self.strategies or LOSSY_STRATEGIES) & set(TOPK_STRATEGIES))
        t0 = time.perf_counter()
        samples: list = []
        numel = topk_numel_for(largest_bytes)
        self.set_calibration(calibrate(allreduce, allgather, broadcast, rank, world_size, device, sizes=sizes,
                                       samples_out=samples, half=half, topk_ratio=self.topk_ratio if topk else None,
                                       topk_numel=numel))
        self.calibration_cost = {"seconds": time.perf_counter() - t0, "link_sizes": list(sizes),
                                 "link_samples": samples, "topk_numel": numel if topk else None}

    def calibration_due(self, aggregators) -> bool:
        """Whether the calibration is to be measured now: none is known and some aggregator has a plan due
        that needs it (:meth:`AutoAggregator.needs_cost_model
        <lossless_hc.training.strategies.AutoAggregator.needs_cost_model>`; a plan that keeps dense by its bytes
        needs none). A function of the plans and statistics: identical on every rank."""
        return self.calibration is None and any(a.needs_cost_model() for a in aggregators)

    def calibration_stats(self, deferred: bool = False) -> dict:
        """``{"source": "given" | "measured" | "pending" | "not needed", "seconds": on this rank, "link_sizes":
        bytes per rank timed, "link_samples": [(kind, bytes per rank, seconds)] this rank timed, "topk_numel": the
        coordinates top-k's steps were timed on (None: not timed), "alpha_s",
        "seconds_per_byte", "allgather_seconds_per_byte", "half_seconds_per_byte": the link every rank plans
        with, "codec_seconds": {strategy: [per coordinate, per touched coordinate]} the local costs it plans
        with}``
        (``stats()["calibration"]`` of the auto adapters). ``deferred``: the adapter measures it only once a plan
        needs it (:meth:`calibration_due`) and its first plans are made: not measured then is "not needed"."""
        source = "given" if self.given_calibration else ("measured" if self.calibration is not None else
                                                         "not needed" if deferred else "pending")
        link = {} if self.calibration is None else {
            "alpha_s": self.calibration.link.alpha_s, "seconds_per_byte": self.calibration.link.seconds_per_byte,
            "allgather_seconds_per_byte": self.calibration.link.allgather_seconds_per_byte,
            "half_seconds_per_byte": self.calibration.link.half_seconds_per_byte,
            "codec_seconds": {s: list(v) for s, v in self.calibration.codec_seconds.items()}}
        return {"source": source, **self.calibration_cost, **link}

    @property
    def cost_model(self) -> CostModel:
        if self.calibration is None:
            raise RuntimeError("auto: not calibrated yet (the adapter calibrates before the first step)")
        if self._cost_model is None:
            self._cost_model = CostModel(self.calibration, self.topk_ratio, self.thc_bits)
        return self._cost_model

    def make(self, name, tensor, world_size, rank, stats, device):
        """The tensor's aggregator; built before the calibration (DDP's first step), it has no cost model
        until the adapter sets ``cost_model`` (a plan due meanwhile waits for it). An integer tensor gets
        a pass-through :class:`~lossless_hc.training.aggregate.TensorAggregator` instead (never
        compressed: the engine sums or averages the tensor itself, as under ``lossless``)."""
        if not tensor.is_floating_point():
            return TensorAggregator(name, tensor.shape, tensor.dtype, world_size, 1.0, seed=self.seed, stats=stats,
                                    device=device)
        model = self.cost_model if self.calibration is not None else None
        agg = AutoAggregator(name, tensor.shape, tensor.dtype, world_size, rank, model, lossy=self.lossy,
                             interval=self.interval, alpha=self.alpha, first=self.first, allowed=self.strategies,
                             seed=self.seed, topk_ratio=self.topk_ratio, thc_bits=self.thc_bits, stats=stats,
                             device=device, partial=self.partial, sparse=tensor.is_sparse,
                             lossy_min_bytes=self.lossy_min_bytes, max_interval=self.max_interval, **self.extra)
        if tensor.dtype in self.native_plain_dtypes:
            agg.plain_dtype = tensor.dtype
        return agg


def plan_stats(aggregators) -> dict:
    """``{tensor name: AutoAggregator.plan_stats()}`` (chosen strategy, predicted and measured seconds,
    bytes sent)."""
    return {a.name: a.plan_stats() for a in aggregators if isinstance(a, AutoAggregator)}


def guard_half(aggregators, dtype: torch.dtype) -> Optional[str]:
    """The half strategy the step guard's dense window sends a DDP bucket or an FSDP2 shard of ``dtype``
    holding these aggregators' tensors in, whole, as the engine's own half-precision hook casts it (their
    :meth:`AutoAggregator.guard_alternative`); None: as it is (not float32, or no tensor of it goes half)."""
    halves = {a.guard_alternative() for a in aggregators} - {"dense"} if dtype == torch.float32 else set()
    return halves.pop() if len(halves) == 1 else None


def guard_stats(guard: Optional[StepGuard], aggregators) -> Optional[dict]:
    """``guard.stats()`` (None without a guard) and, under ``"alternative"``, how many dense tensors its dense
    window sends as each plain step (:meth:`AutoAggregator.guard_alternative`: ``{"dense": 3, "bf16": 2}``)."""
    if guard is None:
        return None
    d = guard.stats()
    kinds = [a.guard_alternative() for a in aggregators if isinstance(a, AutoAggregator) and not a.sparse]
    d["alternative"] = {k: kinds.count(k) for k in sorted(set(kinds))}
    return d


# -- many tensors in one message (DDP bucket, FSDP2 shard) -------------------------------------------------

class AutoMessage:
    """One message's first payloads, in the parts :func:`~lossless_hc.training.message.message_layout`
    gives them (one per payload dtype, or fewer; float64 words stay exact): the engine SUMs each of
    ``parts``, in order. A dense statistics step of a half-precision gradient travels as two pieces,
    its header in float32 and its body in the gradient's dtype (``AutoContext.body_dtype``), as its plain
    steps do; ``places[i]``: tensor i's pieces, ``(part index, offset, numel)`` each."""

    def __init__(self, aggregators: Sequence[AutoAggregator], tensors: Sequence[torch.Tensor]):
        self.aggregators = list(aggregators)
        self.encoded = [agg.encode(t) for agg, t in zip(self.aggregators, tensors)]
        pieces, owners = [], []
        for i, (payload, ctx) in enumerate(self.encoded):
            split = [payload] if ctx.body_dtype is None else \
                [payload[:ctx.body_at], payload[ctx.body_at:].to(ctx.body_dtype)]   # exact: the gradient's values
            pieces += split
            owners += [i] * len(split)
        # an fp16 or bf16 plan's plain step keeps its half part however small (its plan halves the bytes)
        keep = {payload.dtype for payload, ctx in self.encoded if ctx.plain and ctx.strategy in HALF_STRATEGIES}
        # the calibrated link prices the part rule where every aggregator knows it (every rank alike)
        models = [agg.cost_model for agg in self.aggregators]
        link = models[0].calibration.link if models and all(m is not None for m in models) else None
        n = self.aggregators[0].world_size if self.aggregators else 1
        dtypes, sizes, places = message_layout([(p.numel(), p.dtype) for p in pieces], keep, link, n)
        self.places = [[] for _ in self.aggregators]
        sent = [0] * len(self.aggregators)
        for i, piece, (part, offset) in zip(owners, pieces, places):
            self.places[i].append((part, offset, piece.numel()))
            sent[i] += piece.numel() * dtypes[part].itemsize
        for agg, (payload, _), nbytes in zip(self.aggregators, self.encoded, sent):
            agg.count_as_sent(payload.numel() * payload.element_size(), nbytes)
        self.parts = pack_parts(pieces, dtypes, sizes, places)


def decode_message(message: AutoMessage, summed: Sequence[torch.Tensor],
                   allreduce: Callable[[torch.Tensor], None],
                   allgather: Callable[[torch.Tensor], torch.Tensor],
                   outs: Optional[Sequence[Optional[torch.Tensor]]] = None, divisor: Optional[int] = None) -> list:
    """Every tensor's aggregate (in the engine's scale: the SUM here) from ``summed``, the SUMs of every
    rank's ``message.parts``, in order. ``allreduce(t)`` must SUM ``t`` in place across the same ranks;
    ``allgather(t)`` must return the ranks' ``t`` stacked in rank order (``(n, t.numel())``). Both are
    blocking and called in the same order on every rank (module doc), at most once per dtype.
    ``outs[i]``, where given, is passed to tensor i's :meth:`AutoAggregator.finish` as ``out`` (a dense
    allgather's sum is written there); it is written only after every tensor's decode and second
    collective's input were computed, and only by tensor i. ``divisor``: a result written into its
    ``outs[i]`` is divided by it there (the others are returned as SUMs)."""
    check_sums(message.parts, summed)
    outcomes = []
    for agg, (payload, ctx), places in zip(message.aggregators, message.encoded, message.places):
        pieces = [summed[part][offset:offset + m].to(payload.dtype) for part, offset, m in places]
        outcomes.append(agg.decode(pieces[0] if len(pieces) == 1 else torch.cat(pieces), ctx))
    results = [o.value for o in outcomes]
    pending = [i for i, o in enumerate(outcomes) if o.request is not None]
    for dtype in PART_DTYPES:
        group = [i for i in pending
                 if outcomes[i].request.kind == "allreduce" and outcomes[i].request.tensor.dtype == dtype]
        if group:
            flat = torch.cat([outcomes[i].request.tensor.reshape(-1) for i in group])
            allreduce(flat)
            for i, part in zip(group, _split(flat, [outcomes[i].request.tensor.numel() for i in group])):
                results[i] = message.aggregators[i].finish(message.encoded[i][1], part)
    group = [i for i in pending if outcomes[i].request.kind == "allgather"]
    if group:
        sizes = [outcomes[i].request.tensor.numel() for i in group]
        gathered = allgather(torch.cat([outcomes[i].request.tensor.reshape(-1) for i in group]))
        offset = 0
        for i, m in zip(group, sizes):
            out = outs[i] if outs is not None else None
            results[i] = message.aggregators[i].finish(message.encoded[i][1], gathered[:, offset:offset + m], out=out,
                                                       divisor=divisor)
            offset += m
    return results


def settle_message_plans(aggregators, plans_before: Optional[Sequence[int]] = None) -> None:
    """Price each tensor's second collective as its message batches it (a DDP bucket: one allgather, one
    allreduce per dtype; :func:`~lossless_hc.training.planner.batched_second_collectives`): set every
    aggregator's ``batched`` from the others' current plans, and plan again, with it, each one that planned
    since ``plans_before`` (their ``plans`` counts then; None: the plans due now are applied first, and
    those count), until no plan changes (at most one pass per tensor). So a tensor's plan sees its
    bucket-mates' plans of the same step, not of the last. A function of the plans: every rank alike."""
    if plans_before is None:
        plans_before = [a.plans for a in aggregators]
        for a in aggregators:
            if a.cost_model is not None:
                a.current_plan()
    replanned = [a.plans > p for a, p in zip(aggregators, plans_before)]
    for _ in range(len(aggregators) + 1):
        changed = False
        for a, again, batched in zip(aggregators, replanned,
                                     batched_second_collectives([a.strategy for a in aggregators])):
            if batched != a.batched:
                a.batched = batched
                if again:
                    before = a.strategy
                    a.replan()
                    changed |= a.strategy != before
        if not changed:
            return


def _split(flat: torch.Tensor, sizes: Sequence[int]) -> list:
    out, offset = [], 0
    for m in sizes:
        out.append(flat[offset:offset + m])
        offset += m
    return out


# -- one tensor per engine call (Horovod, BytePS) ------------------------------------------------------------

class AutoCompressorAdapter(CompressorAdapter):
    """:class:`CompressorAdapter` for ``auto``: a second collective is an asynchronous named operation
    (:meth:`_start_request`), waited for when the step's last tensor is decompressed (module doc).

    An engine plugin supplies :meth:`_start_request` / :meth:`_wait_request` and calibrates the spec
    (:meth:`AutoSpec.set_calibration`) before the first step; with :meth:`_broadcast_verdict` too, it
    may run the step guard (:meth:`use_guard`).

    The step guard here (:mod:`lossless_hc.training.guard`): a step ends when its last tensor has been
    decompressed (every second collective done), and a step's time is the interval between the ends
    of consecutive steps (a whole iteration: the optimizer's step, the next forward and backward, every
    wait). In the dense window every dense gradient is sent as the engine's own plain step sends it
    (:meth:`AutoAggregator.encode_plain` of its :meth:`~AutoAggregator.guard_alternative`: the tensor as it
    is, or with ``lossy`` in half precision where that is allowed; the plan's state and error feedback
    wait); the verdict is
    rank 0's, broadcast when the step that ends the trial ends, which every rank reaches at the same
    step count. After a dense verdict, each tensor's THC or top-k memory goes out with its next
    (plain) step. The plans compared are the dense tensors' strategies ordered by name: identical on
    every rank whatever order the engine calls the compressor in."""

    def __init__(self, spec: AutoSpec, **engine_options):
        super().__init__(spec, **engine_options)
        self._requests: list = []   # (handle, out, ctx, aggregator) issued this step
        self._guard: Optional[StepGuard] = None
        self._guard_phase = "plan"   # what the current step runs (StepGuard.phase)
        self._guard_steps = 0        # steps ended so far

    def use_guard(self, guard: Optional[StepGuard]) -> None:
        """Run ``guard`` from the next step on (None: no guard). Needs :meth:`_broadcast_verdict`."""
        self._guard = guard

    def encode(self, agg, tensor: torch.Tensor):
        if self._guard_phase == "dense" and isinstance(agg, AutoAggregator) and not agg.sparse:
            tensor = tensor.resolve_neg()   # as CompressorAdapter.encode: the engine reads memory, not the negative bit
            if self._guard.verdict == "dense":   # for good: the lossy memory goes out with this step
                # (into the gradient the engine then reduces in place, as its own allreduce does)
                agg.add_lossy_memory_to(tensor)
            payload, ctx = agg.encode_plain(tensor, agg.guard_alternative())
            self._pending += 1
            return payload, EncodedTensor(agg, ctx)
        return super().encode(agg, tensor)

    def _result(self, enc: EncodedTensor, outcome, aggregated: torch.Tensor) -> torch.Tensor:
        if not isinstance(enc.aggregator, AutoAggregator):   # an integer tensor's pass-through (AutoSpec.make)
            return super()._result(enc, outcome, aggregated)
        if outcome.request is None:
            return outcome.value
        agg = enc.aggregator
        out = torch.zeros(agg.shape, dtype=agg.dtype, device=aggregated.device)
        handle = self._start_request(agg, outcome.request)
        self._requests.append((handle, out, enc.ctx, agg))
        return out   # filled in place in _finish_step, before the optimizer reads it

    def drop_step(self) -> None:
        super().drop_step()
        self._requests = []

    def _finish_step(self) -> None:
        requests, self._requests = self._requests, []
        for handle, out, ctx, agg in requests:
            # an allgather of a dense gradient sums into out itself (its finish's out): no second tensor of
            # the table's size, and no copy of it
            value = agg.finish(ctx, self._wait_request(handle), out=out)
            if value.is_sparse or value.data_ptr() != out.data_ptr():
                out.copy_(value)
        if self._guard is not None:
            self._guard_step_ended(time.perf_counter())
        self._after_step()

    def _guard_step_ended(self, now: float) -> None:
        """Time the step that just ended and set what the next one runs (class doc): the next step begins
        when this one ends."""
        self._guard_steps += 1
        self._guard_phase = self._guard.begin_step(self._guard_steps, now, self._dense_plans, self._broadcast_verdict)

    def _dense_plans(self) -> tuple:
        """The dense tensors' strategies in name order (identical on every rank whatever order the engine
        calls the compressor in)."""
        dense = sorted((a for a in self._aggregators.values() if isinstance(a, AutoAggregator) and not a.sparse),
                       key=lambda a: a.name)
        return tuple(a.strategy for a in dense)

    def _broadcast_verdict(self, verdict: tuple) -> tuple:
        """The group's first rank's ``verdict`` (the five values of ``StepGuard.decide``) on every rank: a blocking
        broadcast, called by every rank at the same step (the step guard's)."""
        raise NotImplementedError

    def _start_request(self, agg: AutoAggregator, request) -> object:
        """Start ``request`` (a :class:`~lossless_hc.training.step.Request`) as an asynchronous
        operation named after ``agg`` (allreduce: SUM; allgather: every rank's tensor, in rank order)."""
        raise NotImplementedError

    def _wait_request(self, handle) -> torch.Tensor:
        """The request's result: the summed tensor, or the gathered ``(n, numel)`` tensor."""
        raise NotImplementedError

    def stats(self) -> dict:
        """The counters of :meth:`CompressorAdapter.stats` and, under ``"plan"``, per tensor: the
        chosen strategy, the predicted seconds of every candidate, measured seconds and bytes sent;
        under ``"calibration"``, :meth:`AutoSpec.calibration_stats`."""
        d = super().stats()
        d["plan"] = plan_stats(self._aggregators.values())
        d["calibration"] = self.spec.calibration_stats()
        d["guard"] = guard_stats(self._guard, self._aggregators.values())
        return d
