"""The framework-independent half of the compressor plugins (Horovod, BytePS).

A plugin's compressor is called by its engine's optimizer as ``compress(grad) -> (payload, ctx)``,
the engine SUMs or AVERAGEs the payload across ranks, and ``decompress(aggregated, ctx)`` returns
the aggregated gradient. Everything in that loop that does not depend on the engine lives here:

* :class:`AggregatorSpec` and its kinds (:class:`LosslessSpec`, :class:`TopKSpec`,
  :class:`THCSpec`): the validated configuration of ``Compression.lossless/topk/thc``, which builds
  one aggregator (:mod:`lossless_hc.training.aggregate`) per parameter. A spec passes the few
  aggregator options it names (``passthrough``: ``policy``, ``partial_max_fraction``) to the
  aggregator's constructor unchanged and refuses any other keyword.
* :class:`CompressorAdapter`: the per-parameter aggregator map, encode/decode, the bookkeeping of
  dense fallbacks within a step, and the statistics. Every aggregator kind runs on the gradient's
  device (CPU or CUDA kernels), so payloads never leave it.
* :func:`find_optimizer_frame`: which parameter a gradient belongs to. Neither Horovod's nor
  BytePS's compressor interface passes the parameter, but both optimizers call ``compress`` from a
  method whose frame holds the optimizer (``self``, with ``_parameter_names``) and the parameter
  (``p``).

An engine plugin subclasses :class:`CompressorAdapter`, implements ``compress``/``decompress`` in
terms of :meth:`~CompressorAdapter.aggregator`, :meth:`~CompressorAdapter.encode` and
:meth:`~CompressorAdapter.decode`, and supplies the one collective this module needs: an exact
dense SUM of a tensor that failed to decode (:meth:`~CompressorAdapter._start_fallback` and
:meth:`~CompressorAdapter._wait_fallback`), and the same SUM of a few coordinates of a tensor whose
decode reported inexact keys (:meth:`~CompressorAdapter._start_partial`).

Fallbacks without deadlock: a payload that fails to decode is re-aggregated densely with an
*asynchronous* engine operation issued from ``decompress``; the adapter waits for all of them when
the last outstanding tensor of the step has been decoded. Every rank decodes the same aggregate, so
every rank issues the same fallbacks; the engines match asynchronous operations by name. The
re-aggregations of inexact keys (the same key set on every rank, for the same reason) are issued
when the step's last tensor has been decoded, in the order of the aggregators' names, so an engine
that numbers names as it first sees them (BytePS) sees them in the same order on every rank.
"""
from __future__ import annotations

import inspect
import math
import sys
from typing import Optional

import torch

from lossless_hc.lhc.layout import INDEX_KINDS, check_fraction, check_uint64
from lossless_hc.thc.codec import check_non_finite
from lossless_hc.thc.table import check_table_args, clip_threshold
from lossless_hc.training.aggregate import (AggregationStats, TensorAggregator, check_block_size, check_partial_fraction,
                                            check_policy, partial_values)
from lossless_hc.training.topk_aggregate import TopKAggregator
from lossless_hc.training.thc_aggregate import THCAggregator

INDEX_CHOICES = ("auto",) + INDEX_KINDS


def find_optimizer_frame(depth_limit: int = 4, _skip: int = 0):
    """``(parameter, optimizer)`` from the engine optimizer's frame that called ``compress``, or None.

    To be called directly from ``compress``: the search starts at ``compress``'s caller and looks
    ``depth_limit`` frames up for locals ``self`` (an object with ``_parameter_names``: Horovod's and
    BytePS's optimizers both have one) and ``p`` (a tensor). ``_skip``: frames between ``compress``
    and this call (:func:`require_optimizer_frame`)."""
    frame = sys._getframe(2 + _skip)
    for _ in range(depth_limit):
        if frame is None:
            break
        loc = frame.f_locals
        opt = loc.get("self")
        p = loc.get("p")
        if opt is not None and hasattr(opt, "_parameter_names") and isinstance(p, torch.Tensor):
            return p, opt
        frame = frame.f_back
    return None


def require_optimizer_frame(compressor, usage: str):
    """:func:`find_optimizer_frame` for ``compressor.compress`` (call it directly from there), or a
    RuntimeError saying the compressor must be used as ``usage`` (the engine's optimizer call)."""
    found = find_optimizer_frame(_skip=1)
    if found is None:
        raise RuntimeError(f"{type(compressor).__name__} must be used as {usage}: it keeps per-parameter state "
                           "and finds the parameter from the optimizer's call")
    return found


# -- configuration: one spec per Compression factory ------------------------------------------------

def _check_index(index) -> str:
    if index not in INDEX_CHOICES:
        raise ValueError(f"index must be one of {', '.join(INDEX_CHOICES)}; got {index!r}")
    return index


class AggregatorSpec:
    """Validated configuration of one compression kind; :meth:`make` builds a parameter's aggregator.

    ``extra``: keyword arguments passed to the aggregator's constructor as they are, among those
    ``passthrough`` names (any other is a TypeError here: a misspelt option fails when the compressor
    is configured, not at the first backward pass).
    """

    kind = ""
    passthrough: tuple = ()

    def __init__(self, seed: int = 0, **extra):
        unknown = sorted(set(extra) - set(self.passthrough))
        if unknown:
            own = [p for p in inspect.signature(type(self).__init__).parameters if p not in ("self", "extra")]
            raise TypeError(f"unknown option(s) for {self.kind} compression: {', '.join(unknown)} (its options: "
                            f"{', '.join(own + list(self.passthrough))})")
        check_policy(extra.get("policy"))   # here, not at the first backward pass that builds an aggregator
        check_partial_fraction(extra.get("partial_max_fraction"))
        self.seed = check_uint64(seed, "seed")
        self.extra = dict(extra)

    def make(self, name: str, tensor: torch.Tensor, world_size: int, rank: int, stats: AggregationStats,
             device: torch.device):
        raise NotImplementedError

    def options(self) -> dict:
        """The configuration as keyword arguments of the ``Compression`` factory."""
        raise NotImplementedError

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in {**self.options(), **self.extra}.items())
        return f"{self.kind}({args})"


class LosslessSpec(AggregatorSpec):
    """``Compression.lossless``: see :class:`lossless_hc.training.aggregate.TensorAggregator`."""

    kind = "lossless"
    passthrough = ("policy", "partial_max_fraction")

    def __init__(self, max_density: float = 0.01, block_size: Optional[int] = None, seed: int = 0,
                 index: str = "auto", **extra):
        super().__init__(seed, **extra)
        self.max_density = check_fraction("max_density", max_density)
        self.block_size = check_block_size(block_size)
        self.index = _check_index(index)

    def options(self) -> dict:
        return {"max_density": self.max_density, "block_size": self.block_size, "seed": self.seed,
                "index": self.index}

    def make(self, name, tensor, world_size, rank, stats, device):
        return TensorAggregator(name, tensor.shape, tensor.dtype, world_size, self.max_density,
                                block_size=self.block_size, seed=self.seed, index=self.index, stats=stats,
                                device=device, **self.extra)


class TopKSpec(AggregatorSpec):
    """``Compression.topk``: see :class:`lossless_hc.training.topk_aggregate.TopKAggregator`."""

    kind = "topk"
    passthrough = ("policy",)

    def __init__(self, ratio: float = 0.01, seed: int = 0, index: str = "auto", **extra):
        super().__init__(seed, **extra)
        self.ratio = check_fraction("ratio", ratio)
        self.index = _check_index(index)

    def options(self) -> dict:
        return {"ratio": self.ratio, "seed": self.seed, "index": self.index}

    def make(self, name, tensor, world_size, rank, stats, device, sketch: bool = True):
        """``sketch``: :class:`~lossless_hc.training.topk_aggregate.TopKAggregator`'s (False: the caller sends
        the selections as pairs, FSDP2's reduce-scatter)."""
        return TopKAggregator(name, tensor.shape, tensor.dtype, world_size, self.ratio, seed=self.seed,
                              index=self.index, stats=stats, device=device, sketch=sketch, **self.extra)


class THCSpec(AggregatorSpec):
    """``Compression.thc``: see :class:`lossless_hc.training.thc_aggregate.THCAggregator` (the aggregator moves its
    codec to the gradient's device, CUDA kernels included)."""

    kind = "thc"

    def __init__(self, bits: int = 4, granularity: int = 30, overflow_freq: float = 32, seed: int = 0,
                 non_finite: str = "raise", **extra):
        super().__init__(seed, **extra)
        check_table_args(bits, granularity)
        clip_threshold(overflow_freq)
        self.bits, self.granularity, self.overflow_freq = bits, granularity, overflow_freq
        self.non_finite = check_non_finite(non_finite)

    def options(self) -> dict:
        return {"bits": self.bits, "granularity": self.granularity, "overflow_freq": self.overflow_freq,
                "seed": self.seed, "non_finite": self.non_finite}

    def make(self, name, tensor, world_size, rank, stats, device, exact: bool = False):
        return THCAggregator(name, tensor.shape, tensor.dtype, world_size, rank, self.bits, self.granularity,
                             self.overflow_freq, seed=self.seed, non_finite=self.non_finite, stats=stats,
                             exact=exact, **self.extra)


# -- the engine-independent compressor -----------------------------------------------------------------

class EncodedTensor:
    """What ``decompress`` needs about one compressed gradient (the adapter's half of ``ctx``)."""

    __slots__ = ("aggregator", "ctx")

    def __init__(self, aggregator, ctx):
        self.aggregator = aggregator
        self.ctx = ctx


class CompressorAdapter:
    """Per-parameter aggregators, dense-fallback bookkeeping and statistics for one compressor.

    The attributes of the spec (``max_density``, ``ratio``, ``bits``, ``seed``, ...) read as the
    compressor's own."""

    def __init__(self, spec: AggregatorSpec):
        self.spec = spec
        self._aggregators: dict = {}   # key (the parameter) -> aggregator
        self._stats = AggregationStats()
        self._pending = 0              # compressed tensors of this step not yet decoded
        self._fallbacks: list = []     # (handle, dense, outcome, aggregator) issued this step
        self._partials: list = []      # (aggregator, values, outcome) to re-aggregate at the step's end

    def __getattr__(self, name):
        spec = self.__dict__.get("spec")
        if spec is not None and not name.startswith("_"):
            if name in spec.__dict__:
                return spec.__dict__[name]
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.spec!r})"

    # -- what an engine plugin calls -------------------------------------------------------------
    def aggregator(self, key, name: str, tensor: torch.Tensor, world_size: int, rank: int):
        """The aggregator of parameter ``key`` (built from ``tensor`` on first use)."""
        agg = self._aggregators.get(key)
        if agg is None:
            agg = self.spec.make(name, tensor, world_size, rank, self._stats, tensor.device)
            self._aggregators[key] = agg
        return agg

    def encode(self, agg, tensor: torch.Tensor):
        """``(payload, EncodedTensor)``: the payload (on ``tensor``'s device) for the engine."""
        # a tensor sent as it is reaches the engine's kernels, which read its memory, not its negative bit
        payload, ctx = agg.encode(tensor.resolve_neg())
        self._pending += 1
        return payload, EncodedTensor(agg, ctx)

    def decode(self, aggregated: torch.Tensor, enc: EncodedTensor) -> torch.Tensor:
        """The aggregated gradient from the engine's SUM or AVERAGE of every rank's payload.

        A payload that failed to decode starts an exact dense fallback and returns the tensor that
        fallback fills in place; a decode with inexact keys returns its output, whose inexact
        coordinates are re-aggregated in place at the step's end. All of the step's fallbacks are
        waited for (and scaled) when its last outstanding tensor has been decoded. Raises
        :class:`~lossless_hc.training.aggregate.ConfigurationMismatch` when ranks are configured differently.
        """
        self._pending -= 1
        try:
            outcome = enc.aggregator.decode(aggregated, enc.ctx)
        except Exception:
            self._pending = max(self._pending, 0)
            raise
        result = self._result(enc, outcome, aggregated)
        if self._pending <= 0:
            self._pending = 0
            self._finish_step()
        return result

    def _result(self, enc: EncodedTensor, outcome, aggregated: torch.Tensor) -> torch.Tensor:
        """What :meth:`decode` returns for one decoded tensor, starting whatever completes it at the
        step's end (a dense fallback, the inexact keys' SUM)."""
        agg = enc.aggregator
        if outcome.needs_fallback:
            # contiguous: what the engine sends (a gradient stored transposed keeps its strides in a clone)
            dense = enc.ctx.dense_value.detach().clone(memory_format=torch.contiguous_format)
            handle = self._start_fallback(agg, dense)
            self._fallbacks.append((handle, dense, outcome, agg))
            return dense   # filled in place by the engine; waited for in _finish_step
        if outcome.needs_partial:   # completed in place in _finish_step
            self._partials.append((agg, partial_values(enc.ctx, outcome.partial).contiguous(), outcome))
        return outcome.value

    def drop_step(self) -> None:
        """Forget the step in flight: its engine operations were dropped (an engine's optimizer reloaded,
        an elastic restore), so its tensors will never be decoded and its fallbacks never waited for."""
        self._pending, self._fallbacks, self._partials = 0, [], []

    def _finish_step(self) -> None:
        fallbacks, self._fallbacks = self._fallbacks, []
        partials, self._partials = sorted(self._partials, key=lambda p: p[0].name), []
        handles = [self._start_partial(agg, values) for agg, values, _ in partials]
        for handle, dense, outcome, agg in fallbacks:
            self._wait_fallback(handle)
            agg.finish_fallback(dense, outcome)
        for handle, (agg, values, outcome) in zip(handles, partials):
            self._wait_fallback(handle)
            agg.finish_partial(values, outcome)
        self._after_step()

    # -- what an engine plugin supplies ------------------------------------------------------------
    def _start_fallback(self, agg, dense: torch.Tensor):
        """Start an exact dense SUM of ``dense`` across ranks, in place, under a name unique to
        ``agg``; return a handle for :meth:`_wait_fallback`."""
        raise NotImplementedError

    def _wait_fallback(self, handle) -> None:
        """Wait for a handle of :meth:`_start_fallback` or :meth:`_start_partial`."""
        raise NotImplementedError

    def _start_partial(self, agg, values: torch.Tensor):
        """Start an exact SUM of ``values`` (a 1-D tensor, the same size on every rank) across ranks,
        in place, under a name unique to ``agg``; return a handle for :meth:`_wait_fallback`."""
        raise NotImplementedError

    def _after_step(self) -> None:
        """Called once the last tensor of a step is decoded and its fallbacks are done."""

    # -- inspection --------------------------------------------------------------------------------
    def stats(self) -> dict:
        """Counters over all tensors so far (see :class:`lossless_hc.training.aggregate.AggregationStats`)."""
        return self._stats.as_dict()

    def aggregators(self) -> dict:
        """Per-parameter aggregators by name (capacity, block size, whether compressed)."""
        return {a.name: a for a in self._aggregators.values()}


def wire_numel(agg) -> int:
    """Elements of the payload ``agg`` sends at its next encode (the codec's, or the dense tensor's)."""
    if hasattr(agg, "payload_numel"):   # auto (training.strategies.AutoAggregator): its first payload
        return agg.payload_numel()
    codec = agg.codec
    return codec.payload_numel if codec is not None else math.prod(agg.shape)


def _with_policy(policy, kwargs: dict) -> dict:
    # Only a given policy joins the aggregator options (and the spec's repr).
    return {**kwargs, "policy": policy} if policy is not None else kwargs


class CompressionFactory:
    """The ``Compression`` namespace of an engine adapter, defined once for every engine.

    An adapter subclasses it and sets ``compressor`` to its :class:`CompressorAdapter` subclass
    (built from one spec); ``lossless``, ``topk`` and ``thc`` then validate their arguments into a
    spec and build that compressor. The aggregator options a spec names (``passthrough``) go to the
    per-tensor aggregators (:mod:`lossless_hc.training.aggregate`) unchanged; any other keyword is a
    TypeError.
    """

    compressor: type = CompressorAdapter
    compressor_options: tuple = ()   # keyword arguments the engine's compressor takes itself (not the spec)

    @classmethod
    def _build(cls, spec_type, *args, **kwargs):
        own = {k: kwargs.pop(k) for k in cls.compressor_options if k in kwargs}
        return cls.compressor(spec_type(*args, **kwargs), **own)

    @classmethod
    def lossless(cls, max_density: float = 0.01, block_size: Optional[int] = None, seed: int = 0,
                 index: str = "auto", policy=None, **kwargs):
        """Exact aggregation of sparse gradients; each rank may send ``max_density`` of a tensor's
        coordinates before that tensor falls back (and grows). ``block_size`` None: a 2-D tensor's
        row length (embedding rows), else 1. ``policy``: a
        :class:`lossless_hc.training.capacity.CapacityPolicy` adapting capacity and index to the
        observed aggregate densities (None: fixed capacity, grown only after a failure)."""
        return cls._build(LosslessSpec, max_density, block_size, seed, index, **_with_policy(policy, kwargs))

    @classmethod
    def topk(cls, ratio: float = 0.01, seed: int = 0, index: str = "auto", policy=None, **kwargs):
        """Top-k (``ratio`` of each tensor) with error feedback, the selections summed by the LHC codec
        within its exactness contract (each value within ``rtol``, keys it cannot prove re-aggregated
        densely; not bit for bit); ``policy`` sizes the sketch for the observed union of the ranks'
        selections."""
        return cls._build(TopKSpec, ratio, seed, index, **_with_policy(policy, kwargs))

    @classmethod
    def thc(cls, bits: int = 4, granularity: int = 30, overflow_freq: float = 32, seed: int = 0,
            non_finite: str = "raise", **kwargs):
        """THC: each coordinate quantized to ``bits`` onto integer levels in [0, granularity] after a
        shared random rotation, summed as integers by the engine; unbiased, with error feedback.
        The first step only agrees on a norm (its gradient goes out at the second step).
        ``non_finite``: a step where some rank's gradient holds NaN/Inf raises ``FloatingPointError``
        on every rank ("raise"), or gives an all-NaN gradient on every rank ("propagate": AMP's
        GradScaler then skips the step and training goes on)."""
        return cls._build(THCSpec, bits, granularity, overflow_freq, seed, non_finite, **kwargs)


def refuse_uncalled(factory) -> None:
    """Give the factory classmethod ``factory`` ``compress``/``decompress`` that raise a clear TypeError:
    an engine handed ``Compression.lossless`` itself (not called) calls them from its backward hooks,
    where Python's AttributeError ("'function' object has no attribute 'compress'") says nothing of
    the cause. A bound method reads attributes from its function."""
    func = factory.__func__

    def uncalled(*args, **kwargs):
        raise TypeError(f"Compression.{func.__name__} is a factory: pass Compression.{func.__name__}(...), called, "
                        "as compression=")
    func.compress = func.decompress = uncalled


for _factory in (CompressionFactory.lossless, CompressionFactory.topk, CompressionFactory.thc):
    refuse_uncalled(_factory)
