r"""The planner's strategies for one tensor, and :class:`AutoAggregator`, which runs the planned one.

A step of any strategy is, for every rank (the engine supplies the collectives)::

    payload, ctx = agg.encode(grad)          # the first payload: the statistics header + the strategy's body
    summed = SUM (or AVERAGE) of payload     # the engine's allreduce
    outcome = agg.decode(summed, ctx)        # outcome.value, or outcome.request: one more collective
    value = agg.finish(ctx, result)          # only after a request: result = its SUM (allreduce) or
                                             # the ranks' tensors stacked in rank order (allgather)

The first payload (:mod:`lossless_hc.training.planner`, "statistics header") is ``1 + 2n`` words -- a
contributor count and the one-hot slot vector of per-rank non-zero row counts (two exact fields each)
-- and then the body::

    dense      the tensor (float32; float64 tensors keep float64 and are always dense)
    allgather  nothing; request: allgather of K slots (int32 row index bit-cast to float32, then the
               row), K = the largest rank's count (known from the header), unused slots index -1
    two_phase  the counting bitmap: D digits of base n+1 (1 where this rank's row is non-zero),
               packed as exact integers below 2^22 per float32 word (lhc.layout.digit_packing);
               request: allreduce of this rank's rows on the union (rows with a non-zero count)
    sketch     the LHC payload (lhc.LosslessCodec sized from the planner's statistics); request only
               when it fails to decode: allreduce of the dense tensor (exact), and re-plan at once
    fp16/bf16  nothing; request: allreduce of the tensor in half precision
    thc        THC's payload (float64; error feedback kept across steps, flushed when leaving THC)
    topk       the top-k aggregator's payload (error feedback; its fallback: the dense selection)

Every decision -- whether a request is made, its size, the statistics, the next plan -- is a function
of the summed payload and the broadcast calibration, so every rank makes the same requests in the same
order (per tensor) and payload shapes always match. Integer fields survive an AVERAGE because they
stay below 2^22 (``round(v n)`` recovers them); values come back in the engine's scale (the sum, or
the average when the engine averaged: requests are SUMs, divided by n here).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Optional

import torch

from lossless_hc.lhc.codec import LosslessCodec
from lossless_hc.lhc.layout import digit_packing
from lossless_hc.lhc.status import DecodeStatus
from lossless_hc.training.aggregate import (AggregationStats, ConfigurationMismatch, THCAggregator, TopKAggregator,
                                            default_block_size)
from lossless_hc.training.planner import (COUNT_FIELD_BITS, EXACT_STRATEGIES, LOSSY_STRATEGIES, CostModel,
                                          PlanTracker, TensorStats,
                                          sketch_capacity, stats_header_words)

FIRST_SKETCH_DENSITY = 0.01   # a sketch planned before any statistics (first="sketch") is sized for this
_HALF = {"fp16": torch.float16, "bf16": torch.bfloat16}


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
    flat: torch.Tensor            # the gradient, flat (the values a request sends)
    started: float
    payload_bytes: int
    averaged: bool = False
    rank_keys: tuple = ()
    inner: object = None          # a wrapped aggregator's context (thc, topk) or the sketch codec
    union_rows: Optional[torch.Tensor] = None
    topk_outcome: object = None


@dataclass
class AutoOutcome:
    value: Optional[torch.Tensor]
    request: Optional[Request] = None


class AutoAggregator:
    r"""One tensor under the planner (``auto``): runs the planned strategy, observes the statistics,
    re-plans every ``interval`` steps (:class:`~lossless_hc.training.planner.PlanTracker`).

    Args:
        name: identical on every rank (messages and ``stats()``).
        shape, dtype: of the gradient.
        world_size, rank: of the group the engine reduces over.
        cost_model: a :class:`~lossless_hc.training.planner.CostModel` built on the broadcast calibration.
        lossy: allow the lossy strategies.
        interval, alpha: re-planning period and EWMA weight.
        first: the strategy of the first step ("dense": its aggregate also measures the statistics).
        allowed: restrict the candidates (e.g. an engine that cannot issue a second collective).
        seed: hash seed of the sketch and top-k codecs (identical on every rank).
        topk_ratio, thc_bits: the lossy strategies' parameters.
    """

    def __init__(self, name: str, shape, dtype: torch.dtype, world_size: int, rank: int, cost_model: CostModel,
                 lossy: bool = False, interval: int = 16, alpha: float = 0.25, first: str = "dense",
                 allowed: Optional[tuple] = None, seed: int = 0, topk_ratio: Optional[float] = None,
                 thc_bits: Optional[int] = None, stats: Optional[AggregationStats] = None, device="cpu"):
        self.name, self.shape, self.dtype = name, tuple(shape), dtype
        self.numel = math.prod(self.shape)
        self.world_size, self.rank = int(world_size), int(rank)
        self.row = default_block_size(self.shape)
        self.keys = self.numel // self.row if self.numel else 0
        self.cost_model, self.lossy, self.seed = cost_model, bool(lossy), int(seed)
        self.device = torch.device(device)
        self.topk_ratio = cost_model.topk_ratio if topk_ratio is None else float(topk_ratio)
        self.thc_bits = cost_model.thc_bits if thc_bits is None else int(thc_bits)
        names = EXACT_STRATEGIES + (LOSSY_STRATEGIES if lossy else ())
        if dtype == torch.float64 or self.numel == 0 or self.world_size == 1:
            names = ("dense",)   # float64 would be rounded by float32 payloads; nothing to save otherwise
        if allowed is not None:
            names = tuple(s for s in names if s in allowed) or ("dense",)
        self.allowed = names
        if first not in self.allowed:
            first = "dense" if "dense" in self.allowed else self.allowed[0]
        self.wire_dtype = torch.float64 if dtype == torch.float64 else torch.float32
        self.tracker = PlanTracker(self.numel, self.row, self.world_size, interval, alpha)
        self.agg_stats = stats if stats is not None else AggregationStats()
        self.strategy = first
        self.predicted: dict = {}
        self.history: list = []                 # (step, strategy) at every change
        self.measured: dict = {}                # strategy -> EWMA of encode-to-result seconds on this rank
        self.bytes_sent = 0
        self.steps = 0
        self.fallbacks = 0
        self._codec: Optional[LosslessCodec] = None   # the sketch's, sized at the last plan
        self._sketch_stats: Optional[TensorStats] = None   # ... from these statistics
        self._thc: Optional[THCAggregator] = None
        self._topk: Optional[TopKAggregator] = None
        if first == "sketch":   # no statistics yet: sized for FIRST_SKETCH_DENSITY of the rows per rank
            guess = min(self.keys, max(1, math.ceil(FIRST_SKETCH_DENSITY * self.keys)))
            self._size_sketch(TensorStats(self.numel, self.row, self.world_size, (guess,) * self.world_size,
                                          min(self.keys, guess * self.world_size)))

    # -- the plan ----------------------------------------------------------------------------------
    def _plan(self) -> None:
        s = self.tracker.stats(element_bytes=4)
        best, predicted = self.cost_model.choose(s, lossy=self.lossy, allowed=self.allowed)
        self.predicted = predicted
        if best == "sketch":
            self._size_sketch(s)
        if best != self.strategy:
            self.history.append((self.tracker.steps, best))
            self.strategy = best

    def _size_sketch(self, s: TensorStats) -> None:
        self._sketch_stats = s
        cap, union = sketch_capacity(s)
        self._codec = LosslessCodec(self.numel, self.world_size, cap, self.row, self.seed, device=self.device,
                                    union_nnz=union)

    def _observe(self, ctx: AutoContext, union_keys: int) -> None:
        self.steps += 1
        seconds = time.perf_counter() - ctx.started
        old = self.measured.get(ctx.strategy)
        self.measured[ctx.strategy] = seconds if old is None else 0.75 * old + 0.25 * seconds
        if self.tracker.observe(ctx.rank_keys, union_keys):
            self._plan()

    # -- helpers -----------------------------------------------------------------------------------
    def _rows(self, flat: torch.Tensor) -> torch.Tensor:
        return flat.reshape(self.keys, self.row)

    def _present(self, flat: torch.Tensor) -> torch.Tensor:
        """Which rows of ``flat`` are non-zero (bool, one per key)."""
        return (self._rows(flat) != 0).any(dim=1)

    def _union_of(self, value: torch.Tensor) -> int:
        return int(self._present(value.reshape(-1)).sum()) if self.numel else 0

    def _integers(self, words: torch.Tensor, averaged: bool) -> torch.Tensor:
        w = words.to(torch.float64)
        return torch.round(w * self.world_size if averaged else w).to(torch.int64)

    def _scaled(self, summed: torch.Tensor, averaged: bool) -> torch.Tensor:
        return summed.div_(self.world_size) if averaged else summed

    def _shaped(self, flat: torch.Tensor) -> torch.Tensor:
        return flat.reshape(self.shape).to(self.dtype)

    def _flush_lossy_memory(self, flat: torch.Tensor) -> torch.Tensor:
        """Leaving THC or top-k: what their error feedback still holds goes out with this gradient."""
        if self.strategy != "thc" and self._thc is not None:
            err = self._thc.codec.error if self._thc.codec is not None else None
            if err is not None:
                flat = flat.to(torch.float32) + err.to(flat.device)
            self._thc = None   # a later THC plan starts afresh (its first step agrees on a norm)
        if self.strategy != "topk" and self._topk is not None:
            if self._topk.residual is not None:
                flat = flat.to(torch.float32) + self._topk.residual
            self._topk = None
        return flat

    # -- a step --------------------------------------------------------------------------------------
    def encode(self, x: torch.Tensor):
        """``(payload, ctx)``: the first payload (statistics header + body) every rank sums."""
        if x.is_sparse:
            raise TypeError(f"{self.name}: sparse gradient; aggregate it dense")
        if tuple(x.shape) != self.shape or x.dtype != self.dtype:
            raise ValueError(f"{self.name}: got a {x.dtype} tensor of shape {tuple(x.shape)}, expected "
                             f"{self.dtype} {self.shape}")
        t0 = time.perf_counter()
        flat = self._flush_lossy_memory(x.detach().reshape(-1))
        s = self.strategy
        n = self.world_size
        rank_key_count = int(self._present(flat).sum()) if self.numel else 0
        ctx = AutoContext(s, flat, t0, 0)
        if s == "dense":
            body = flat.to(self.wire_dtype)
        elif s == "two_phase":
            body = self._bitmap(self._present(flat))
        elif s == "sketch":
            ctx.inner = self._codec
            body = self._codec.encode(flat.to(torch.float32) if flat.dtype == torch.float64 else flat)
        elif s == "thc":
            if self._thc is None:
                self._thc = THCAggregator(self.name, (self.numel,), torch.float32, n, self.rank,
                                          bits=self.thc_bits, seed=self.seed, stats=AggregationStats())
            body, ctx.inner = self._thc.encode(flat.to(torch.float32))
        elif s == "topk":
            if self._topk is None:
                self._topk = TopKAggregator(self.name, (self.numel,), torch.float32, n, self.topk_ratio,
                                            seed=self.seed, stats=AggregationStats(), device=self.device)
            body, ctx.inner = self._topk.encode(flat.to(torch.float32))
        else:   # allgather, fp16, bf16: the header only
            body = flat.new_zeros(0, dtype=torch.float32)
        header = torch.zeros(stats_header_words(n), dtype=body.dtype if body.numel() else self.wire_dtype,
                             device=flat.device)
        header[0] = 1.0
        header[1 + 2 * self.rank] = float(rank_key_count % (1 << COUNT_FIELD_BITS))
        header[2 + 2 * self.rank] = float(rank_key_count >> COUNT_FIELD_BITS)
        payload = torch.cat([header, body.to(header.dtype)])
        ctx.payload_bytes = payload.numel() * payload.element_size()
        self.bytes_sent += ctx.payload_bytes
        st = self.agg_stats
        st.tensors += 1
        st.dense_bytes += self.numel * self.dtype.itemsize
        st.payload_bytes += ctx.payload_bytes
        st.compressed += s != "dense"
        st.sent_dense += s == "dense"
        st.encode_seconds += time.perf_counter() - t0
        return payload, ctx

    def decode(self, summed: torch.Tensor, ctx: AutoContext) -> AutoOutcome:
        """Read the header, decode the body; the value, or the request of the strategy's next collective."""
        t0 = time.perf_counter()
        n = self.world_size
        H = stats_header_words(n)
        averaged = n > 1 and abs(float(summed[0]) - 1.0) < 0.5
        contributors = round(float(summed[0]) * (n if averaged else 1))
        if contributors != n:
            raise ConfigurationMismatch(f"{self.name}: the first payload has {contributors} contributors, "
                                        f"expected {n} (ranks built different plans?)")
        ctx.averaged = averaged
        fields = self._integers(summed[1:H], averaged).reshape(n, 2)
        ctx.rank_keys = tuple((fields[:, 0] + (fields[:, 1] << COUNT_FIELD_BITS)).tolist())
        body = summed[H:]
        s = ctx.strategy
        try:
            if s == "dense":
                value = body.to(self.wire_dtype)
                self._observe(ctx, self._union_of(value))
                return AutoOutcome(self._shaped(value))
            if s == "allgather":
                k = max(ctx.rank_keys)
                if k == 0:
                    self._observe(ctx, 0)
                    return AutoOutcome(self._shaped(ctx.flat.new_zeros(self.numel, dtype=torch.float32)))
                return AutoOutcome(None, Request("allgather", self._gather_slots(ctx.flat, k)))
            if s == "two_phase":
                present = self._unpack(body, averaged) > 0
                ctx.union_rows = torch.nonzero(present).reshape(-1)
                if ctx.union_rows.numel() == 0:
                    self._observe(ctx, 0)
                    return AutoOutcome(self._shaped(ctx.flat.new_zeros(self.numel, dtype=torch.float32)))
                rows = self._rows(ctx.flat.to(torch.float32)).index_select(0, ctx.union_rows)
                return AutoOutcome(None, Request("allreduce", rows.reshape(-1)))
            if s == "sketch":
                codec = ctx.inner
                y, report = codec.decode(body.to(torch.float32).contiguous(), averaged=averaged,
                                         shape=(self.numel,), dtype=torch.float32)
                if report.ok:
                    self._observe(ctx, report.support)
                    return AutoOutcome(self._shaped(y))
                if report.status == DecodeStatus.CONFIGURATION_MISMATCH:
                    raise ConfigurationMismatch(f"{self.name}: {report.reason}")
                self.fallbacks += 1
                self.agg_stats.fallbacks += 1
                self.agg_stats.last_failure = f"{self.name}: {report.reason}"
                self.tracker.force = True   # every rank saw the same failure: re-plan after this step
                return AutoOutcome(None, Request("allreduce", ctx.flat.to(torch.float32).clone()))
            if s in _HALF:
                return AutoOutcome(None, Request("allreduce", ctx.flat.to(_HALF[s])))
            if s == "thc":
                out = self._thc.decode(body.contiguous(), ctx.inner)
                value = out.value.reshape(-1).to(torch.float32)
                self._observe(ctx, self._union_of(value))
                return AutoOutcome(self._shaped(value))
            if s == "topk":
                out = self._topk.decode(body.to(torch.float32).contiguous(), ctx.inner)
                if out.needs_fallback:
                    ctx.topk_outcome = out
                    self.fallbacks += 1
                    self.agg_stats.fallbacks += 1
                    return AutoOutcome(None, Request("allreduce",
                                                     ctx.inner.dense_value.reshape(-1).to(torch.float32).clone()))
                value = out.value.reshape(-1).to(torch.float32)
                self._observe(ctx, self._union_of(value))
                return AutoOutcome(self._shaped(value))
            raise AssertionError(s)
        finally:
            self.agg_stats.decode_seconds += time.perf_counter() - t0

    def finish(self, ctx: AutoContext, result: torch.Tensor) -> torch.Tensor:
        """The value from the request's result (allreduce: the SUM; allgather: the n tensors)."""
        t0 = time.perf_counter()
        s = ctx.strategy
        n = self.world_size
        if s == "allgather":
            k = max(ctx.rank_keys)
            slots = result.reshape(n, k, 1 + self.row)
            out = torch.zeros(self.keys, self.row, dtype=torch.float32, device=ctx.flat.device)
            seen = []
            for r in range(n):   # rank order: the same additions, in the same order, on every rank
                idx = slots[r, :, 0].contiguous().view(torch.int32).to(torch.int64)
                valid = idx >= 0
                if bool(valid.any()):
                    idx = idx[valid]
                    out.index_add_(0, idx, slots[r, valid, 1:])
                    seen.append(idx)
            union = int(torch.unique(torch.cat(seen)).numel()) if seen else 0
            value = self._scaled(out.reshape(-1), ctx.averaged)
        elif s == "two_phase":
            out = torch.zeros(self.keys, self.row, dtype=torch.float32, device=ctx.flat.device)
            out.index_copy_(0, ctx.union_rows, result.reshape(-1, self.row).to(torch.float32))
            union = int(ctx.union_rows.numel())
            value = self._scaled(out.reshape(-1), ctx.averaged)
        elif s in _HALF:
            value = self._scaled(result.to(torch.float32), ctx.averaged)
            union = self._union_of(value)
        elif s == "sketch":
            value = self._scaled(result.to(torch.float32), ctx.averaged)
            self.agg_stats.payload_bytes += result.numel() * 4
            union = self._union_of(value)
        elif s == "topk":
            value = self._topk.finish_fallback(result.to(torch.float32), ctx.topk_outcome).reshape(-1)
            union = self._union_of(value)
        else:
            raise AssertionError(f"{s} makes no request")
        if s != "sketch":
            self.agg_stats.payload_bytes += result.numel() * result.element_size() // (n if s == "allgather" else 1)
        self.bytes_sent += result.numel() * result.element_size() // (n if s == "allgather" else 1)
        self.agg_stats.decode_seconds += time.perf_counter() - t0
        self._observe(ctx, union)
        return self._shaped(value)

    # -- bodies ---------------------------------------------------------------------------------------
    def _bitmap(self, present: torch.Tensor) -> torch.Tensor:
        """``present`` (one bool per row) as digits of base n+1, packed exactly into float32 words."""
        pk = digit_packing(self.world_size, self.keys)
        digits = torch.zeros(pk.words * pk.per_word, dtype=torch.int64, device=present.device)
        digits[:self.keys] = present.to(torch.int64)
        weights = torch.tensor([pk.base ** j for j in range(pk.per_word)], dtype=torch.int64, device=present.device)
        return (digits.reshape(pk.words, pk.per_word) * weights).sum(dim=1).to(torch.float32)

    def _unpack(self, words: torch.Tensor, averaged: bool) -> torch.Tensor:
        """Per-row counts (ranks holding the row) from the summed bitmap."""
        pk = digit_packing(self.world_size, self.keys)
        w = self._integers(words, averaged)
        if w.numel() != pk.words:
            raise ConfigurationMismatch(f"{self.name}: two-phase bitmap of {w.numel()} words, expected {pk.words}")
        cols = [(w // pk.base ** j) % pk.base for j in range(pk.per_word)]
        return torch.stack(cols, dim=1).reshape(-1)[:self.keys]

    def _gather_slots(self, flat: torch.Tensor, k: int) -> torch.Tensor:
        """This rank's K slots: int32 row index (bits in a float32 word; -1: unused) and the row."""
        rows = self._rows(flat.to(torch.float32))
        idx = torch.nonzero((rows != 0).any(dim=1)).reshape(-1)
        slots = torch.zeros(k, 1 + self.row, dtype=torch.float32, device=flat.device)
        slots[:, 0] = torch.full((k,), -1, dtype=torch.int32, device=flat.device).view(torch.float32)
        m = idx.numel()
        slots[:m, 0] = idx.to(torch.int32).view(torch.float32)
        slots[:m, 1:] = rows.index_select(0, idx)
        return slots.reshape(-1)

    def payload_numel(self) -> int:
        """Elements of the first payload the next :meth:`encode` returns (header + body)."""
        s, H = self.strategy, stats_header_words(self.world_size)
        if s == "dense":
            return H + self.numel
        if s == "two_phase":
            return H + digit_packing(self.world_size, self.keys).words
        if s == "sketch":
            return H + self._codec.payload_numel
        if s in ("thc", "topk"):
            agg = self._thc if s == "thc" else self._topk
            if agg is None:
                raise RuntimeError(f"{self.name}: the {s} payload's size is known after its first encode")
            return H + (agg.codec.payload_numel if agg.codec is not None else self.numel)
        return H

    # -- checkpointing --------------------------------------------------------------------------------
    _TRACKER_FIELDS = ("steps", "rank_keys", "union", "peak_rank", "force")

    def state_dict(self) -> dict:
        """What this aggregator carries between steps: the plan (strategy, statistics, the sketch's
        sizing) and the lossy strategies' error feedback; Python numbers and CPU tensors."""
        sk = self._sketch_stats
        thc = self._thc.codec if self._thc is not None else None
        return {"kind": "auto", "shape": list(self.shape), "dtype": str(self.dtype), "strategy": self.strategy,
                "history": [list(h) for h in self.history], "steps": self.steps,
                "tracker": {f: getattr(self.tracker, f) for f in self._TRACKER_FIELDS},
                "sketch_stats": None if sk is None else [sk.numel, sk.row, sk.world_size, list(sk.rank_keys),
                                                         sk.union_keys, sk.element_bytes],
                "topk_residual": None if self._topk is None or self._topk.residual is None
                else self._topk.residual.detach().cpu().clone(),
                "thc": None if thc is None else {k: (v.detach().cpu().clone() if isinstance(v, torch.Tensor) else v)
                                                 for k, v in thc.state_dict().items()}}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` into an aggregator built with the same configuration."""
        got = (state.get("kind"), list(state.get("shape", [])), state.get("dtype"))
        if got != ("auto", list(self.shape), str(self.dtype)):
            raise ValueError(f"{self.name}: the saved state is for a {got[0]} aggregator of {got[2]} {got[1]}, "
                             f"this one is an auto aggregator of {self.dtype} {list(self.shape)}")
        if state["strategy"] not in self.allowed:
            raise ValueError(f"{self.name}: the saved strategy {state['strategy']!r} is not allowed here "
                             f"({self.allowed})")
        self.strategy, self.steps = state["strategy"], int(state["steps"])
        self.history = [tuple(h) for h in state["history"]]
        for f in self._TRACKER_FIELDS:
            setattr(self.tracker, f, state["tracker"][f])
        if state["sketch_stats"] is not None:
            numel, row, n, ranks, union, eb = state["sketch_stats"]
            self._size_sketch(TensorStats(numel, row, n, tuple(ranks), union, eb))
        if state["topk_residual"] is not None:
            self._topk = self._topk or TopKAggregator(self.name, (self.numel,), torch.float32, self.world_size,
                                                      self.topk_ratio, seed=self.seed, stats=AggregationStats(),
                                                      device=self.device)
            self._topk.residual = state["topk_residual"].to(self.device, torch.float32).clone()
        if state["thc"] is not None:
            self._thc = self._thc or THCAggregator(self.name, (self.numel,), torch.float32, self.world_size, self.rank,
                                                   bits=self.thc_bits, seed=self.seed, stats=AggregationStats())
            self._thc.codec.load_state_dict(state["thc"])

    # -- inspection -----------------------------------------------------------------------------------
    def plan_stats(self) -> dict:
        """The chosen strategy, the predicted seconds of every candidate at the last plan, the measured
        seconds (EWMA per strategy used, encode to result on this rank) and the bytes this rank sent."""
        return {"strategy": self.strategy, "predicted_seconds": dict(self.predicted),
                "measured_seconds": dict(self.measured), "bytes_sent": self.bytes_sent, "steps": self.steps,
                "changes": list(self.history), "fallbacks": self.fallbacks}
