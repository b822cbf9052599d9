"""Horovod adapter: compressors for ``hvd.DistributedOptimizer(compression=...)``.

    import horovod.torch as hvd
    from lossless_hc.plugins.horovod import Compression
    comp = Compression.lossless(max_density=0.01)
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                   compression=comp, op=hvd.Average)
    ...
    comp.stats()   # bytes sent vs dense, fallbacks, encode/decode time

Horovod calls ``compress(grad)`` in each parameter's gradient hook, allreduces the returned payload
in place (SUM or AVERAGE), and calls ``decompress(payload, ctx)`` from ``optimizer.step()``. The
policy (dense or compressed, capacity, error feedback) is :mod:`lossless_hc.aggregate`; this module
only finds which parameter a gradient belongs to and runs the dense fallback on Horovod.

Which parameter? ``compress`` receives only the tensor. The optimizer's hook calls it from
``_allreduce_grad_async(self, p)`` (or a comprehension over ``ps`` for ``groups=``), so the caller's
frame holds the parameter ``p`` and the optimizer, whose ``_parameter_names`` give its name. That
keeps error feedback attached to the parameter whatever happens to ``p.grad`` (``set_to_none``,
``sparse_as_dense`` copies).

Fallback without deadlock: a payload that fails to decode is re-aggregated densely with an
*asynchronous* Horovod allreduce issued from ``decompress``; the compressor waits for all of them
when the last outstanding tensor of the step has been decompressed. Every rank issues the same
fallbacks (they decode the same aggregate), and Horovod matches asynchronous operations by name, so
the order in which ranks reach them does not matter.
"""
from __future__ import annotations

import sys
from typing import Optional

import torch

from lossless_hc.aggregate import AggregationStats, CapacityPolicy, TensorAggregator, THCAggregator, TopKAggregator

try:
    import horovod.torch as hvd
except ImportError as e:  # pragma: no cover - exercised only without Horovod
    raise ImportError("lossless_hc.plugins.horovod needs Horovod (scripts/setup_horovod.sh builds it)") from e


def _find_optimizer_frame(depth_limit: int = 4):
    """(parameter, optimizer) from the Horovod optimizer frame that called ``compress``, or None."""
    frame = sys._getframe(2)
    for _ in range(depth_limit):
        if frame is None:
            break
        loc = frame.f_locals
        opt = loc.get("self")
        p = loc.get("p")
        if opt is not None and hasattr(opt, "_parameter_names") and isinstance(p, torch.nn.Parameter):
            return p, opt
        frame = frame.f_back
    return None


class _LosslessCompressor:
    """Base of the compressors: one aggregator per parameter, the dense fallback, the statistics."""

    def __init__(self, seed: int, index: str):
        self.seed = seed
        self.index = index
        self._aggregators: dict = {}
        self._stats = AggregationStats()
        self._pending = 0            # compressed tensors of this step not yet decompressed
        self._fallbacks: list = []   # (handle, tensor, outcome, aggregator) issued this step
        self._optimizer = None       # the hvd.DistributedOptimizer that calls us (found on first use)
        self._process_set = hvd.global_process_set

    # -- Horovod's Compressor interface --------------------------------------------------------
    def compress(self, tensor: torch.Tensor):
        found = _find_optimizer_frame()
        if found is None:
            raise RuntimeError(f"{type(self).__name__} must be used as hvd.DistributedOptimizer(compression=...): "
                               "it keeps per-parameter state and finds the parameter from the optimizer's call")
        p, opt = found
        if tensor.requires_grad or tensor is p:
            raise ValueError("Adasum is non-linear (it is not a sum), so a homomorphic sketch cannot pass through it; "
                             "use op=hvd.Average or op=hvd.Sum with lossless_hc compression")
        agg = self._aggregator(p, opt, tensor)
        payload, ctx = agg.encode(tensor)
        self._pending += 1
        return payload, (agg, ctx)

    def decompress(self, tensor: torch.Tensor, ctx) -> torch.Tensor:
        agg, ectx = ctx
        if self._optimizer is not None:
            # Every gradient exists by now; a sparse one went around the compressor.
            self._check_sparse_gradients(self._optimizer)
            self._optimizer = None
        self._pending -= 1
        outcome = agg.decode(tensor, ectx)
        result = outcome.value
        if outcome.needs_fallback:
            dense = ectx.dense_value.detach().clone()
            handle = hvd.allreduce_async_(dense, name=f"lhc.fallback.{agg.name}", op=hvd.Sum,
                                          process_set=self._process_set)
            self._fallbacks.append((handle, dense, outcome, agg))
            result = dense  # filled in place by the allreduce; waited for below
        if self._pending <= 0:
            self._pending = 0
            self._finish_fallbacks()
        return result

    # -- helpers -------------------------------------------------------------------------------
    def _finish_fallbacks(self) -> None:
        fallbacks, self._fallbacks = self._fallbacks, []
        for handle, dense, outcome, agg in fallbacks:
            hvd.synchronize(handle)
            agg.finish_fallback(dense, outcome)

    def _aggregator(self, p: torch.nn.Parameter, opt, tensor: torch.Tensor):
        agg = self._aggregators.get(p)
        if agg is None:
            if not self._aggregators:
                self._optimizer = opt
            name = opt._parameter_names.get(p) or f"param{len(self._aggregators)}"
            self._process_set = getattr(opt, "process_set", hvd.global_process_set)
            agg = self._make(name, tensor, self._process_set.size(), self._process_set.rank())
            self._aggregators[p] = agg
        return agg

    def _check_sparse_gradients(self, opt) -> None:
        """Horovod aggregates sparse gradients itself (allgather) unless ``sparse_as_dense=True``,
        so they would silently bypass the compressor: refuse instead."""
        if getattr(opt, "sparse_as_dense", False):
            return
        for group in opt.param_groups:
            for q in group["params"]:
                if isinstance(getattr(q, "grad", None), torch.Tensor) and q.grad.is_sparse:
                    raise ValueError(f"parameter {opt._parameter_names.get(q)!r} has a sparse gradient, which Horovod "
                                     "sends uncompressed; pass sparse_as_dense=True to hvd.DistributedOptimizer")

    def _make(self, name: str, tensor: torch.Tensor, world_size: int, rank: int):
        raise NotImplementedError

    def stats(self) -> dict:
        """Counters over all tensors so far (see :class:`lossless_hc.aggregate.AggregationStats`)."""
        return self._stats.as_dict()

    def aggregators(self) -> dict:
        """Per-parameter aggregators by name (capacity, block size, whether compressed)."""
        return {a.name: a for a in self._aggregators.values()}


class LosslessCompressor(_LosslessCompressor):
    """``Compression.lossless``: naturally sparse gradients, aggregated exactly."""

    def __init__(self, max_density: float = 0.01, block_size: Optional[int] = None, seed: int = 0,
                 index: str = "auto", policy: Optional[CapacityPolicy] = None):
        super().__init__(seed, index)
        self.policy = policy
        if not 0.0 < max_density <= 1.0:
            raise ValueError(f"max_density must be in (0, 1], got {max_density}")
        self.max_density = max_density
        self.block_size = block_size

    def _make(self, name, tensor, world_size, rank):
        return TensorAggregator(name, tensor.shape, tensor.dtype, world_size, self.max_density,
                                block_size=self.block_size, seed=self.seed, index=self.index, stats=self._stats,
                                policy=self.policy)


class TopKCompressor(_LosslessCompressor):
    """``Compression.topk``: top-k with error feedback, the selected values aggregated exactly."""

    def __init__(self, ratio: float = 0.01, seed: int = 0, index: str = "auto",
                 policy: Optional[CapacityPolicy] = None):
        super().__init__(seed, index)
        self.policy = policy
        if not 0.0 < ratio <= 1.0:
            raise ValueError(f"ratio must be in (0, 1], got {ratio}")
        self.ratio = ratio

    def _make(self, name, tensor, world_size, rank):
        return TopKAggregator(name, tensor.shape, tensor.dtype, world_size, self.ratio, seed=self.seed,
                              index=self.index, stats=self._stats, policy=self.policy)


class THCCompressor(_LosslessCompressor):
    """``Compression.thc``: THC quantization of dense gradients (lossy, unbiased, error feedback)."""

    def __init__(self, bits: int = 4, granularity: int = 30, overflow_freq: float = 32, seed: int = 0):
        super().__init__(seed, "auto")
        self.bits, self.granularity, self.overflow_freq = bits, granularity, overflow_freq

    def _make(self, name, tensor, world_size, rank):
        return THCAggregator(name, tensor.shape, tensor.dtype, world_size, rank, self.bits, self.granularity,
                             self.overflow_freq, seed=self.seed, stats=self._stats)


class Compression:
    """Factories for ``hvd.DistributedOptimizer(compression=...)``; Horovod's own ``none`` and
    ``fp16`` are re-exported so examples can switch with one name."""

    none = hvd.Compression.none
    fp16 = hvd.Compression.fp16

    @staticmethod
    def lossless(max_density: float = 0.01, block_size: Optional[int] = None, seed: int = 0,
                 index: str = "auto", policy: Optional[CapacityPolicy] = None) -> LosslessCompressor:
        """Exact aggregation of sparse gradients; each rank may send ``max_density`` of a tensor's
        coordinates before that tensor falls back (and grows). ``block_size`` None: a 2-D
        tensor's row length (embedding rows), else 1. ``policy``: a
        :class:`lossless_hc.aggregate.CapacityPolicy` adapting capacity and index to the observed
        aggregate densities."""
        return LosslessCompressor(max_density, block_size, seed, index, policy)

    @staticmethod
    def topk(ratio: float = 0.01, seed: int = 0, index: str = "auto",
             policy: Optional[CapacityPolicy] = None) -> TopKCompressor:
        """Top-k (``ratio`` of each tensor) with error feedback, aggregated exactly; ``policy`` sizes
        the sketch for the observed union of the ranks' selections."""
        return TopKCompressor(ratio, seed, index, policy)

    @staticmethod
    def thc(bits: int = 4, granularity: int = 30, overflow_freq: float = 32, seed: int = 0) -> THCCompressor:
        """THC: each coordinate quantized to ``bits`` onto integer levels in [0, granularity] after a
        shared random rotation, summed as integers by the engine; unbiased, with error feedback.
        The first step only agrees on a norm (its gradient goes out at the second step)."""
        return THCCompressor(bits, granularity, overflow_freq, seed)
