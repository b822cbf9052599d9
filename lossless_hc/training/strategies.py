r"""The planner's strategies for one tensor, and :class:`AutoAggregator`, which runs the planned one.

A step of any strategy is, for every rank (the engine supplies the collectives)::

    payload, ctx = agg.encode(grad)          # the first payload: the statistics header + the strategy's body
    summed = SUM (or AVERAGE) of payload     # the engine's allreduce
    outcome = agg.decode(summed, ctx)        # outcome.value, or outcome.request: one more collective
    value = agg.finish(ctx, result)          # only after a request: result = its SUM (allreduce) or
                                             # the ranks' tensors stacked in rank order (allgather)

The first payload (:mod:`lossless_hc.training.planner`, "statistics header") is ``1 + 2n`` words -- a
contributor count and the one-hot slot vector of per-rank non-zero row counts (two exact fields each)
-- and then the body (a dense plan's plain steps, :meth:`AutoAggregator.carries_statistics`: the body
alone)::

    dense      the tensor (float32; float64 tensors keep float64 and are always dense)
    allgather  nothing; request: allgather of K slots (int32 row index bit-cast to float32, then the
               row), K = the largest rank's count (known from the header), unused slots index -1
    two_phase  the counting bitmap: D digits of base n+1 (1 where this rank's row is non-zero),
               packed as exact integers below 2^22 per float32 word (lhc.layout.digit_packing);
               request: allreduce of this rank's rows on the union (rows with a non-zero count)
    sketch     the LHC payload (lhc.LosslessCodec sized from the planner's statistics); request only
               when it fails to decode: allreduce of the dense tensor (exact), and re-plan at once;
               or, when the decode reports inexact keys (DecodeStatus.INEXACT: every other key within
               rtol) covering at most half the rows (aggregate.PARTIAL_MAX_FRACTION), allreduce of
               this rank's values on those keys' rows only, which replace the decoded ones
    fp16/bf16  nothing; request: allreduce of the tensor in half precision (fp16: then divided by n, as
               DDP's fp16_compress_hook divides: it overflows where a rank's value or the average
               passes 65504, not where only the SUM does). Their plain steps (as a dense plan's) are
               the tensor in half precision alone, what the engine's own half-precision hook sends:
               fp16 divided by n first unless the engine averages (then as Horovod's fp16 sends it)
    thc        THC's payload (float64; error feedback kept across steps, flushed when leaving THC)
    topk       the top-k aggregator's payload (error feedback); request only when its decode fails: the
               dense selection, or when it reports inexact keys: those coordinates of the selection
    topk_allgather  nothing; request: allgather of this rank's k = ceil(r d) selected coordinates (the same
               selection and error-feedback memory as topk's) as slots of (int32 index bit-cast to
               float32, value), summed in rank order as allgather's rows of one coordinate

Every strategy starts from the rank's rows: a dense gradient is scanned for its non-zero rows; a sparse
one (``sparse=True``: a COO tensor of rows, as DDP hands over ``nn.Embedding(sparse=True)``'s gradient)
lists them, coalesced, and nothing scans the table. Its result is a coalesced sparse tensor of the rows
some rank listed (as DDP's own sparse allreduce; a listed all-zero row stays listed); dense and sketch,
whose bodies are dense tensors (the rows written into zeros), prepend the two-phase bitmap to learn
those rows. A sparse gradient is planned among the exact strategies only.

Every decision -- whether a request is made, its size, the statistics, the next plan -- is a function
of the summed payload and the broadcast calibration, so every rank makes the same requests in the same
order (per tensor) and payload shapes always match. Integer fields survive an AVERAGE because they
stay below 2^22 (``round(v n)`` recovers them); values come back in the engine's scale (the sum, or
the average when the engine averaged: requests are SUMs, divided by n here).
"""
from __future__ import annotations

import math
import time
from typing import Optional

import torch

from lossless_hc.backends import as_device
from lossless_hc.lhc.codec import LosslessCodec
from lossless_hc.lhc.status import DecodeStatus
from lossless_hc.lhc.layout import check_fraction, check_uint64
from lossless_hc.training.aggregate import (PARTIAL_MAX_FRACTION, AggregationStats, ConfigurationMismatch,
                                            partial_values, reaggregated_coordinates)
from lossless_hc.training.topk_aggregate import TopKAggregator
from lossless_hc.training.lossy_memory import LossyMemories
from lossless_hc.training.plan_tracker import PlannedTensor, PlanTracker
from lossless_hc.training.planner import (EXACT_STRATEGIES, HALF_DTYPES, LOSSY_MIN_BYTES, LOSSY_STRATEGIES,
                                          PLAIN_STRATEGIES, TOPK_STRATEGIES, CostModel, unbuildable)
from lossless_hc.training.plan_stats import TensorStats, bitmap_words, stats_header_words
from lossless_hc.training.rows import TensorRows, gather_slots, sum_slots, sum_slots_dense
from lossless_hc.training.step import AutoContext, AutoOutcome, Request  # noqa: F401  (Request: part of the API)
from lossless_hc.training.thc_aggregate import THCAggregator
from lossless_hc.thc.table import check_bits

FIRST_SKETCH_DENSITY = 0.01   # a sketch planned before any statistics (first="sketch") is sized for this


def half_payload(flat: torch.Tensor, strategy: str, divisor: Optional[int]) -> torch.Tensor:
    """``flat`` in the half strategy's dtype (``"fp16"``: float16, ``"bf16"``: bfloat16), a new tensor; fp16
    divided by ``divisor`` (None: not), as DDP's fp16_compress_hook divides (a SUM of the quotients then
    passes 65504 only where the average does); bfloat16 has float32's range and is not divided."""
    payload = flat.to(HALF_DTYPES[strategy], copy=True)
    return payload.div_(divisor) if strategy == "fp16" and divisor is not None else payload


class AutoAggregator(PlannedTensor, TensorRows, LossyMemories):
    r"""One tensor under the planner (``auto``): runs the planned strategy, observes the statistics,
    re-plans every ``interval`` steps (:class:`~lossless_hc.training.plan_tracker.PlanTracker`; the plan:
    :class:`~lossless_hc.training.plan_tracker.PlannedTensor`).

    Args:
        name: identical on every rank (messages and ``stats()``).
        shape, dtype: of the gradient.
        world_size, rank: of the group the engine reduces over.
        cost_model: a :class:`~lossless_hc.training.planner.CostModel` built on the broadcast calibration,
            or None until it is known (set it before a plan that needs it is applied, :meth:`needs_cost_model`:
            such a plan waits for the next :meth:`encode`; DDP calibrates after the first step that needs it).
        lossy: allow the lossy strategies (for a tensor of at least ``lossy_min_bytes`` bytes).
        lossy_min_bytes: smaller tensors are planned exactly even when ``lossy``
            (:data:`~lossless_hc.training.planner.LOSSY_MIN_BYTES`: the saving is at most twice their bytes
            of wire per step, while a lossy error can cost steps the cost model does not price); the step
            guard's alternative rounds them all the same (:meth:`guard_alternative`).
        interval, alpha: re-planning period and EWMA weight.
        max_interval: the longest period between a dense plan's statistics steps (None: 16 ``interval``),
            reached by doubling where no calibration could move the tensor off dense
            (:meth:`~lossless_hc.training.plan_tracker.PlanTracker.reschedule`); ``interval`` keeps it fixed.
        first: the strategy of the first step (None: "dense" for a dense gradient, "allgather" for a
            sparse one; either is exact and measures the statistics).
        allowed: restrict the candidates (e.g. an engine that cannot issue a second collective).
        seed: hash seed of the sketch and top-k codecs (identical on every rank).
        topk_ratio, thc_bits: the lossy strategies' parameters.
        partial: re-aggregate only the rows of a sketch decode's inexact keys (False: densely, for an
            engine whose only second collective is the dense one: BytePS).
        sparse: the gradient arrives as a sparse COO tensor of rows (``sparse_dim`` 1, e.g.
            ``nn.Embedding(sparse=True)``): its listed rows are used as they are (no scan), the result
            is a coalesced sparse tensor of the rows some rank listed, and only the exact strategies
            are candidates (module doc).
    """

    def __init__(self, name: str, shape, dtype: torch.dtype, world_size: int, rank: int,
                 cost_model: Optional[CostModel],
                 lossy: bool = False, interval: int = 16, alpha: float = 0.25, first: Optional[str] = None,
                 allowed: Optional[tuple] = None, seed: int = 0, topk_ratio: Optional[float] = None,
                 thc_bits: Optional[int] = None, stats: Optional[AggregationStats] = None, device="cpu",
                 partial: bool = True, sparse: bool = False, lossy_min_bytes: int = LOSSY_MIN_BYTES,
                 max_interval: Optional[int] = None):
        super().__init__(name, shape, dtype, world_size, rank, sparse)   # the row form (training.rows)
        self.cost_model, self.lossy, self.seed = cost_model, bool(lossy), check_uint64(seed, "seed")
        self.partial = bool(partial)
        self.device = as_device(device)
        if cost_model is None and (topk_ratio is None or thc_bits is None):
            raise ValueError(f"{name}: without a cost model, give topk_ratio and thc_bits")
        # checked here, not when a top-k or THC plan first builds its aggregator mid-run
        self.topk_ratio = cost_model.topk_ratio if topk_ratio is None else check_fraction("topk_ratio", topk_ratio)
        if thc_bits is not None:
            check_bits(thc_bits, "thc_bits")
        self.thc_bits = cost_model.thc_bits if thc_bits is None else thc_bits
        lossy_here = lossy and not self.sparse and self.numel * dtype.itemsize >= lossy_min_bytes
        names = EXACT_STRATEGIES + (LOSSY_STRATEGIES if lossy_here else ())
        # the LHC codec takes at most 1024 ranks and 2^32 - 2^12 keys, the allgathers' int32 index 2^31 - 1
        # rows or coordinates, THC at most its exact range (planner.unbuildable)
        names = tuple(s for s in names if s not in unbuildable(self.world_size, self.keys, self.numel))
        if dtype in (torch.float16, torch.bfloat16):
            # fp16 would round a float16 gradient again (x / n, then n times the sum) for nothing its plain
            # steps do not save, and would take a bfloat16 one out of its range (above 65504: inf; below
            # 6e-8: 0)
            names = tuple(s for s in names if s != "fp16")
        if dtype == torch.float64 or self.numel == 0 or self.world_size == 1:
            names = ("dense",)   # float64 would be rounded by float32 payloads; nothing to save otherwise
        if allowed is not None:
            names = tuple(s for s in names if s in allowed) or ("dense",)
        self.allowed = names
        # The step guard's alternative with lossy (guard_alternative): the engine's own half-precision hook,
        # which casts every float32 gradient of a bucket, whatever its size (lossy_min_bytes guards the plans)
        halves = [h for h in ("bf16", "fp16") if allowed is None or h in allowed]
        if lossy and halves and dtype == torch.float32 and not self.sparse and self.numel and world_size > 1:
            self.engine_half = halves[0]
        if first is None:
            first = "allgather" if self.sparse else "dense"
        if first not in self.allowed:
            first = "dense" if "dense" in self.allowed else self.allowed[0]
        self.wire_dtype = torch.float64 if dtype == torch.float64 else torch.float32
        # A plain step's payload (the bare tensor) is in wire_dtype, as every other payload (a BytePS
        # slot holds one dtype). An adapter whose engine carries the gradient's dtype as it is sets that
        # dtype here (AutoSpec.native_plain_dtypes: Horovod, DDP, FSDP2), so that a half-precision
        # gradient's plain steps send what the engine's own allreduce sends (and are priced so).
        self.plain_dtype = self.wire_dtype
        self.tracker = PlanTracker(self.numel, self.row, self.world_size, interval, alpha, sparse=self.sparse,
                                   max_interval=max_interval)
        self.stats = stats if stats is not None else AggregationStats()
        self.strategy = first
        self.predicted: dict = {}
        self.plan_input: Optional[TensorStats] = None   # the statistics of the last plan
        self.plans = 0                                   # plans made (each counts, kept or changed)
        self.history: list = []                 # (step, strategy) at the last HISTORY_KEEP changes
        self._changed_from = first              # the strategy before the last change
        self.measured: dict = {}                # strategy -> EWMA of encode-to-result seconds on this rank
        self.bytes_sent = 0
        self.steps = 0                          # steps aggregated (every rank counts alike)
        self.plain_steps = 0                    # ... of them dense without the statistics header
        self.fallbacks = 0
        # Set by an engine adapter that can SUM this sparse gradient itself (DDP over Gloo: its sparse
        # allreduce, what DDP does without a hook): an allgather plan then sends the bare gradient that way
        # between its statistics steps, as a dense plan sends the bare dense tensor (carries_statistics).
        self.native_sparse = False
        # Set by an adapter whose message batches its tensors' second collectives (a DDP bucket, FSDP2's
        # replica all-reduce): the kinds the message's other tensors issue under their current plans, which
        # this tensor's plans then share (auto.settle_message_plans; identical on every rank)
        self.batched: frozenset = frozenset()
        self._plan_due = False                  # a plan is due but no cost model was known yet
        self._codec: Optional[LosslessCodec] = None   # the sketch's, sized at the last plan
        self._sketch_stats: Optional[TensorStats] = None   # ... from these statistics
        self._thc: Optional[THCAggregator] = None
        self._topk: Optional[TopKAggregator] = None
        if first == "sketch":   # no statistics yet: sized for FIRST_SKETCH_DENSITY of the rows per rank
            guess = min(self.keys, max(1, math.ceil(FIRST_SKETCH_DENSITY * self.keys)))
            self._size_sketch(TensorStats(self.numel, self.row, self.world_size, (guess,) * self.world_size,
                                          min(self.keys, guess * self.world_size)))

    def record_plain_step(self, started: float, sparse_rows: Optional[int] = None, half: Optional[str] = None,
                          ended: Optional[float] = None) -> None:
        """Account a step the engine aggregated as the bare tensor (``carries_statistics()`` False, or the
        DDP step guard's dense window): the DDP hook's in-place allreduce of a bucket whose every tensor is
        on such a step. ``started``: ``time.perf_counter()`` when the step's aggregation began.
        ``sparse_rows``: a sparse gradient summed by the engine's own sparse allreduce (``native_sparse``),
        with at most this many rows listed (its uncoalesced count): it allgathers an int64 index and the
        values of each, counted as the allgather strategy. ``half``: ``"fp16"`` or ``"bf16"``, the plan's plain
        step run as the engine's half-precision hook runs it (the bucket cast, summed, copied back). ``ended``:
        ``time.perf_counter()`` when its sum arrived (None: now)."""
        self._carried_memory = False   # a plain step's counts are not statistics anyway
        if half is not None:
            self._count_sent(self.numel * 2, dense=False, plain=True)
            self._measure(half, started, ended)
        elif sparse_rows is None:   # the engine's own allreduce, in the gradient's dtype (a bucket of it)
            self._count_sent(self.numel * self.dtype.itemsize, plain=True)
            self._measure("dense", started, ended)
        else:
            self._count_sent(int(sparse_rows) * (8 + self.row * self.dtype.itemsize), dense=False, plain=True)
            self._measure("allgather", started, ended)

    # -- this rank's rows (the row form every strategy starts from: training.rows) -----------------------
    def _local_rows(self, x: torch.Tensor, ctx: AutoContext, scan: bool = True) -> None:
        """This rank's rows: a dense gradient is scanned for its non-zero rows (``ctx.present``, and their
        sorted ``ctx.index``, listed as the scan counts them: the backend's ``nonzero_row_index``), ``ctx.flat``
        keeps it; a sparse one lists them (coalesced: duplicates summed) in ``ctx.index``, with their
        values in ``ctx.values``. ``scan`` False: a dense gradient is not scanned (the caller sets
        ``ctx.rows``: the sketch's encoder counts them)."""
        if self.sparse:
            return self._listed_rows(x, ctx)
        ctx.flat = self._flush_lossy_memory(x.detach().reshape(-1))
        if scan:
            self._scan(ctx)

    # -- a step --------------------------------------------------------------------------------------
    def encode(self, x: torch.Tensor):
        """``(payload, ctx)``: the first payload (statistics header + body) every rank sums."""
        self._check_input(x)
        t0 = time.perf_counter()
        carried, self._carried_memory = self._carried_memory, False
        carries = self.carries_statistics()
        if self.sparse and not carries:
            raise RuntimeError(f"{self.name}: this step sends the bare sparse gradient, which the engine sums with "
                               "its own sparse allreduce (native_sparse), not through encode()")
        if not carries:   # a plain step: the bare tensor (in half precision for fp16, bf16), no scan
            return self._plain(x, t0, self.strategy)
        s = self.strategy
        ctx = AutoContext(s, t0, 0)
        # a dense gradient's sketch counts its rows as it encodes them (the codec's blocks are the rows)
        counted = s == "sketch" and not self.sparse and self._codec.layout.index_kind != "dense"
        # THC and top-k carry the header on every step (their payload follows it) but count the rows on
        # the statistics steps only, one in an interval as a dense plan (carries_statistics)
        ctx.observed = s not in ("thc",) + TOPK_STRATEGIES or self.sparse or self._statistics_step()
        self._local_rows(x, ctx, scan=not counted and ctx.observed)
        ctx.carried_memory, self._carried_memory = carried or self._carried_memory, False   # (a flush sets it)
        if s in ("dense", "sketch"):
            flat = self._dense(ctx)
            if s == "dense":
                body = flat.to(self.wire_dtype)
            else:
                ctx.inner = self._codec
                body = self._codec.encode(flat.to(torch.float32) if flat.dtype == torch.float64 else flat)
                if counted:
                    ctx.rows = self._codec.encoded_keys(body)
            if self.sparse:   # the union's rows, which a sparse result lists (module doc)
                body = torch.cat([self._bitmap(ctx).to(body.dtype), body])
        elif s == "two_phase":
            body = self._bitmap(ctx)
        elif s == "thc":
            body, ctx.inner = self.thc_aggregator().encode(ctx.flat.to(torch.float32))
        elif s == "topk":
            body, ctx.inner = self.topk_aggregator().encode(ctx.flat.to(torch.float32))
        else:   # allgather, fp16, bf16, topk_allgather: the header only
            if s == "topk_allgather":   # (indices, values): the selection, made now (the residual updated)
                ctx.inner = self.topk_aggregator().select_indices(ctx.flat)
            body = torch.zeros(0, dtype=torch.float32, device=self._device(ctx))
        header = self._stats_header(ctx.rows, body.dtype if body.numel() else self.wire_dtype, body.device)
        if s == "dense" and not self.sparse and ctx.flat.dtype == self.plain_dtype and self.plain_dtype != body.dtype:
            # the body is the gradient as it is (no lossy memory flushed into it): a message may carry
            # it in the plain steps' dtype, exactly (AutoMessage)
            ctx.body_dtype, ctx.body_at = self.plain_dtype, header.numel()
        payload = torch.cat([header, body.to(header.dtype)])
        ctx.payload_bytes = payload.numel() * payload.element_size()
        self._count_sent(ctx.payload_bytes, dense=s == "dense")
        self.stats.encode_seconds += time.perf_counter() - t0
        return payload, ctx

    engine_half: Optional[str] = None   # guard_alternative's half strategy (set in __init__ with lossy)

    def guard_alternative(self) -> str:
        """The plain step the step guard's dense window (and a dense verdict) sends this tensor as
        (:mod:`lossless_hc.training.guard`): with ``lossy``, a float32 gradient of any size in ``"bf16"``, else
        ``"fp16"``, the first the strategies allow (the engine's own half-precision hook: DDP's
        bf16_compress_hook casts a whole bucket, Horovod's ``Compression.fp16`` every tensor); otherwise
        ``"dense"``. A lossy plan slower than what the engine ships buys nothing. Identical on every rank."""
        return self.engine_half or "dense"

    def encode_plain(self, x: torch.Tensor, strategy: str = "dense"):
        """``(payload, ctx)`` of a plain step of ``strategy`` (``"dense"``: the bare tensor in ``plain_dtype``;
        ``"fp16"``, ``"bf16"``: in half precision, :meth:`_plain`), no scan, whatever the plan (the step
        guard's dense window, :meth:`guard_alternative`, where the plan's state, error feedback included,
        waits). :meth:`decode` returns the engine's sum or average of it, shaped."""
        self._check_input(x)
        if self.sparse:
            raise TypeError(f"{self.name}: a plain step sends a dense tensor; this gradient is sparse")
        if strategy not in PLAIN_STRATEGIES:
            raise ValueError(f"{self.name}: a plain step is one of {', '.join(PLAIN_STRATEGIES)}, not {strategy!r}")
        return self._plain(x, time.perf_counter(), strategy)

    def _plain(self, x: torch.Tensor, t0: float, strategy: str):
        """A plain step of ``strategy``: dense sends the tensor in ``plain_dtype``; bf16 in bfloat16; fp16
        ``x / n`` in float16 (DDP's fp16_compress_hook: a SUM then passes 65504 only where the average
        does), or ``x`` where the engine is known to average (Horovod's fp16 compression: no second
        division in float16)."""
        flat = x.detach().reshape(-1)
        if strategy in HALF_DTYPES:
            payload = half_payload(flat, strategy, None if self.engine_averages is True else self.world_size)
        else:
            strategy, payload = "dense", flat.to(self.plain_dtype)
        ctx = AutoContext(strategy, t0, payload.numel() * payload.element_size(), plain=True)
        ctx.averaged = strategy == "fp16" and self.engine_averages is True
        self._count_sent(ctx.payload_bytes, dense=strategy == "dense", plain=True)
        self.stats.encode_seconds += time.perf_counter() - t0
        return payload, ctx

    def count_as_sent(self, counted: int, sent: int) -> None:
        """A message carried this step's payload (``counted`` bytes at encode) in ``sent`` bytes: a body
        narrowed to its gradient's dtype, or a payload widened into a wider part."""
        self.bytes_sent += sent - counted
        self.stats.payload_bytes += sent - counted

    def _count_sent(self, payload_bytes: int, dense: bool = True, plain: bool = False) -> None:
        self.bytes_sent += payload_bytes
        self.plain_steps += plain
        st = self.stats
        st.tensors += 1
        st.dense_bytes += self.numel * self.dtype.itemsize
        st.payload_bytes += payload_bytes
        st.compressed += not dense
        st.sent_dense += dense

    def decode(self, summed: torch.Tensor, ctx: AutoContext) -> AutoOutcome:
        """Read the header, decode the body; the value, or the request of the strategy's next collective.
        A plain step's (``ctx.plain``) summed payload is the value, in the engine's scale."""
        t0 = time.perf_counter()
        if ctx.plain:   # the engine's SUM or average of the bare tensor (fp16: of x / n, unless averaged)
            value = summed.to(self.wire_dtype)
            if ctx.strategy == "fp16" and not ctx.averaged:
                value = value.mul_(self.world_size) if value is not summed else value * self.world_size
            self._measure(ctx.strategy, ctx.started)
            self.stats.decode_seconds += time.perf_counter() - t0
            return AutoOutcome(self._shaped(value))
        n = self.world_size
        H = stats_header_words(n)
        averaged, ctx.rank_keys = self._read_stats_header(summed, ctx.strategy)
        ctx.averaged = averaged
        body = summed[H:]
        s = ctx.strategy
        if self.sparse and s in ("dense", "sketch"):
            words = bitmap_words(self.keys, n)
            ctx.union_rows = self._union_rows(body[:words], averaged)
            body = body[words:]
        try:
            if s == "dense":
                value = body.to(self.wire_dtype)
                self._observe(ctx, ctx.union_rows.numel() if self.sparse else self._union_of(value))
                return AutoOutcome(self._from_flat(value, ctx.union_rows))
            if s == "allgather":
                k = max(ctx.rank_keys)
                if k == 0:
                    self._observe(ctx, 0)
                    return AutoOutcome(self._no_rows(ctx))
                return AutoOutcome(None, Request("allgather", self._slots(ctx, k)))
            if s == "two_phase":
                ctx.union_rows = self._union_rows(body, averaged)
                if ctx.union_rows.numel() == 0:
                    self._observe(ctx, 0)
                    return AutoOutcome(self._no_rows(ctx))
                return AutoOutcome(None, Request("allreduce", self._on_rows(ctx, ctx.union_rows).reshape(-1)))
            if s == "sketch":
                codec = ctx.inner
                y, report = codec.decode(body.to(torch.float32).contiguous(), averaged=averaged,
                                         shape=(self.numel,), dtype=torch.float32,
                                         error_bounds=self.partial and self.row > 1)   # unproven_coordinates
                union_count = ctx.union_rows.numel() if self.sparse else report.support
                if report.ok:
                    self.tracker.observe_reaggregated(s, 0)
                    self._observe(ctx, union_count)
                    return AutoOutcome(self._from_flat(y, ctx.union_rows))
                if report.status == DecodeStatus.INEXACT:
                    coords = reaggregated_coordinates(y, report, self.row, codec, self.partial,
                                                      PARTIAL_MAX_FRACTION * self.numel, self.stats)
                    if coords is not None:   # else: dense
                        self.tracker.observe_reaggregated(s, coords.numel())
                        ctx.partial = (y, coords, union_count)
                        return AutoOutcome(None, Request("allreduce", self._at_coordinates(ctx, coords)))
                    self.tracker.observe_reaggregated(s, self.numel)
                if report.status == DecodeStatus.CONFIGURATION_MISMATCH:
                    raise ConfigurationMismatch(f"{self.name}: {report.reason}")
                self.fallbacks += 1
                self.stats.fallbacks += 1
                self.stats.last_failure = f"{self.name}: {report.reason}"
                self.tracker.force = True   # every rank saw the same failure: re-plan after this step
                return AutoOutcome(None, Request("allreduce", self._dense(ctx).to(torch.float32).clone()))
            if s == "topk_allgather":
                index, values = ctx.inner
                return AutoOutcome(None, Request("allgather", gather_slots(index, values.reshape(-1, 1),
                                                                           self._topk.k, 1)))
            if s in HALF_DTYPES:   # requests are SUMs: fp16 divided by n first
                return AutoOutcome(None, Request("allreduce", half_payload(ctx.flat, s, n)))
            if s == "thc":
                out = self._thc.decode(body.contiguous(), ctx.inner)
                value = out.value.reshape(-1).to(torch.float32)
                self._observe(ctx, self._union_of(value) if ctx.observed else 0)
                return AutoOutcome(self._shaped(value))
            if s == "topk":
                out = self._topk.decode(body.to(torch.float32).contiguous(), ctx.inner, partial=self.partial)
                inexact = out.report is not None and out.report.status == DecodeStatus.INEXACT
                if not (out.needs_fallback and not inexact):   # a failed decode's fallback: not priced
                    self.tracker.observe_reaggregated(s, out.partial.numel() if out.needs_partial else
                                                      self.numel if out.needs_fallback else 0)
                if out.needs_partial:   # the selections' inexact keys: their coordinates summed exactly
                    ctx.topk_outcome = out
                    self.stats.inexact_decodes += 1
                    self.stats.partial_fallbacks += 1
                    self.stats.inexact_keys += out.partial.numel()
                    values = partial_values(ctx.inner, out.partial).to(torch.float32).contiguous()
                    return AutoOutcome(None, Request("allreduce", values))
                if out.needs_fallback:
                    ctx.topk_outcome = out
                    self.fallbacks += 1
                    self.stats.fallbacks += 1
                    return AutoOutcome(None, Request("allreduce",
                                                     ctx.inner.dense_value.reshape(-1).to(torch.float32).clone()))
                value = out.value.reshape(-1).to(torch.float32)
                self._observe(ctx, self._union_of(value) if ctx.observed else 0)
                return AutoOutcome(self._shaped(value))
            raise AssertionError(s)
        finally:
            self.stats.decode_seconds += time.perf_counter() - t0

    def finish(self, ctx: AutoContext, result: torch.Tensor, out: Optional[torch.Tensor] = None,
               divisor: Optional[int] = None) -> torch.Tensor:
        """The value from the request's result (allreduce: the SUM; allgather: the n tensors).

        ``out``: where a dense gradient's ``allgather`` sum may be written instead of a new tensor (the
        value is then ``out`` in the gradient's shape): a contiguous float32 tensor of ``numel`` elements,
        e.g. the engine's buffer that held this gradient, which this finish overwrites (its gradient was
        read at encode). Where ``out`` is the very memory that was encoded, unchanged since, only this
        rank's non-zero rows are cleared before the sums are added (the others hold +-0.0 already).
        ``divisor``: a value written into ``out`` is divided by it (the caller's average: only the rows
        some rank sent, the same bits as the whole tensor). The other strategies ignore both."""
        t0 = time.perf_counter()
        s = ctx.strategy
        n = self.world_size
        if s == "allgather":
            slots = result.reshape(n, max(ctx.rank_keys), 1 + self.row)
            if self.sparse:
                union, rows = sum_slots(slots, self.row, self.keys)
                value = self._from_rows(union, self._scaled(rows, ctx.averaged))
                count = union.numel()
            else:
                into = out if out is not None and self.dtype == torch.float32 else None
                # out that is the scanned gradient itself (no lossy memory was added into a copy; the same
                # memory, not a strided view that starts there) is zero outside this rank's rows
                scanned = (into is not None and ctx.flat is not None and ctx.flat.is_contiguous()
                           and into.data_ptr() == ctx.flat.data_ptr())
                rows, count = sum_slots_dense(slots, self.row, self.keys, out=into,
                                              stale_rows=ctx.index if scanned else None,
                                              divisor=divisor if into is not None else None)
                value = self._shaped(self._scaled(rows, ctx.averaged).reshape(-1))
        elif s == "topk_allgather":   # every coordinate written: out is cleared whole
            slots = result.reshape(n, self._topk.k, 2)
            into = out if out is not None and self.dtype == torch.float32 else None
            coords, _ = sum_slots_dense(slots, 1, self.numel, out=into, divisor=divisor if into is not None else None,
                                        count=False)
            if not bool(torch.isfinite(slots[:, :, 1]).all()):
                # some rank's g + e held NaN/Inf (the selection takes them first: an AMP scaler's overflow step,
                # which it then skips): every rank drops its memory, as TopKAggregator.after_failure does
                self._topk.residual = None
            value = self._shaped(self._scaled(coords, ctx.averaged).reshape(-1))
            count = self._union_of(value) if ctx.observed else 0
        elif s == "two_phase":
            rows = self._scaled(result.reshape(-1, self.row).to(torch.float32), ctx.averaged)
            value = self._from_rows(ctx.union_rows, rows)
            count = ctx.union_rows.numel()
        elif s == "fp16":   # the SUM of x_r / n: the average, times n where the engine's scale is the sum
            average = result.to(torch.float32)
            value = self._shaped(average if ctx.averaged else average.mul_(n))
            count = self._union_of(value)
        elif s == "bf16":
            value = self._shaped(self._scaled(result.to(torch.float32), ctx.averaged))
            count = self._union_of(value)
        elif s == "sketch" and ctx.partial is not None:   # the inexact keys' unproven coordinates, summed exactly
            flat, coords, count = ctx.partial
            flat.index_copy_(0, coords, self._scaled(result.to(torch.float32), ctx.averaged))
            self.stats.payload_bytes += result.numel() * 4
            value = self._from_flat(flat, ctx.union_rows)
        elif s == "sketch":
            flat = self._scaled(result.to(torch.float32), ctx.averaged)
            self.stats.payload_bytes += result.numel() * 4
            value = self._from_flat(flat, ctx.union_rows)
            count = ctx.union_rows.numel() if self.sparse else self._union_of(flat)
        elif s == "topk":
            outcome = ctx.topk_outcome
            done = self._topk.finish_partial if outcome.needs_partial else self._topk.finish_fallback
            value = self._shaped(done(result.to(torch.float32), outcome).reshape(-1).to(torch.float32))
            count = self._union_of(value) if ctx.observed else 0
        else:
            raise AssertionError(f"{s} makes no request")
        # an allgather's result holds every rank's tensor: this rank sent one of them
        sent = result.numel() * result.element_size() // (n if s in ("allgather", "topk_allgather") else 1)
        if s != "sketch":
            self.stats.payload_bytes += sent
        self.bytes_sent += sent
        self.stats.decode_seconds += time.perf_counter() - t0
        self._observe(ctx, count)
        return value

    def payload_numel(self) -> int:
        """Elements of the first payload the next :meth:`encode` returns (header + body; a plain step's:
        the tensor)."""
        if not self.carries_statistics():
            return self.numel
        s, H = self.strategy, stats_header_words(self.world_size)
        rows = bitmap_words(self.keys, self.world_size) if self.sparse else 0   # a sparse result's union
        if s == "dense":
            return H + rows + self.numel
        if s == "two_phase":
            return H + bitmap_words(self.keys, self.world_size)
        if s == "sketch":
            return H + rows + self._codec.payload_numel
        if s in ("thc", "topk"):
            agg = self._thc if s == "thc" else self._topk
            if agg is None:
                raise RuntimeError(f"{self.name}: the {s} payload's size is known after its first encode")
            if s == "topk":   # built by a topk_allgather plan: its codec now
                agg = self.topk_aggregator()
            return H + (agg.codec.payload_numel if agg.codec is not None else self.numel)
        return H
