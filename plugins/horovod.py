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
policy (dense or compressed, capacity, error feedback) is :mod:`lossless_hc.training.aggregate`, and the
per-parameter bookkeeping shared with the BytePS plugin is :mod:`lossless_hc.training.adapter`; this module
only adds what is Horovod's: process sets, the Adasum and sparse-gradient checks, and the dense
fallback as a Horovod allreduce.

Which parameter? ``compress`` receives only the tensor. The optimizer's hook calls it from
``_allreduce_grad_async(self, p)`` (or a comprehension over ``ps`` for ``groups=``), so the caller's
frame holds the parameter ``p`` and the optimizer, whose ``_parameter_names`` give its name
(:func:`lossless_hc.training.adapter.find_optimizer_frame`). That
keeps error feedback attached to the parameter whatever happens to ``p.grad`` (``set_to_none``,
``sparse_as_dense`` copies).

Fallback without deadlock: a payload that fails to decode is re-aggregated densely with an
*asynchronous* Horovod allreduce issued from ``decompress``; the compressor waits for all of them
when the last outstanding tensor of the step has been decompressed. Every rank issues the same
fallbacks (they decode the same aggregate), and Horovod matches asynchronous operations by name, so
the order in which ranks reach them does not matter. A tensor whose decode reported a few inexact
keys is completed the same way with a Horovod allreduce of just those keys' coordinates
(``lhc.partial.<name>``), issued when the step's last tensor has been decompressed.
"""
from __future__ import annotations


import torch

from lossless_hc.training.adapter import CompressionFactory, CompressorAdapter, require_optimizer_frame
from lossless_hc.training.aggregate import CapacityPolicy  # noqa: F401  (re-exported for users)

try:
    import horovod.torch as hvd
except ImportError as e:  # pragma: no cover - exercised only without Horovod
    raise ImportError("lossless_hc.plugins.horovod needs Horovod (scripts/setup_horovod.sh builds it)") from e


class HorovodCompressor(CompressorAdapter):
    """Horovod's Compressor interface over :class:`CompressorAdapter` (one per ``Compression`` factory call)."""

    def __init__(self, spec):
        super().__init__(spec)
        self._optimizer = None       # the hvd.DistributedOptimizer that calls us (found on first use)
        self._process_set = hvd.global_process_set

    # -- Horovod's Compressor interface --------------------------------------------------------
    def compress(self, tensor: torch.Tensor):
        p, opt = require_optimizer_frame(self, "hvd.DistributedOptimizer(compression=...)")
        if tensor.requires_grad or tensor is p:
            raise ValueError("Adasum is non-linear (it is not a sum), so a homomorphic sketch cannot pass through it; "
                             "use op=hvd.Average or op=hvd.Sum with lossless_hc compression")
        agg = self._aggregator(p, opt, tensor)
        return self.encode(agg, tensor)

    def decompress(self, tensor: torch.Tensor, ctx) -> torch.Tensor:
        if ctx is None:
            # Horovod sends a sparse gradient around compress() (an allgather) and still calls
            # decompress(output, None): a model whose gradients are all sparse gets here first.
            raise ValueError("a sparse gradient reached the compressor, which Horovod sends uncompressed; pass "
                             "sparse_as_dense=True to hvd.DistributedOptimizer")
        if self._optimizer is not None:
            # Every gradient exists by now; a sparse one went around the compressor.
            self._check_sparse_gradients(self._optimizer)
            self._optimizer = None
        return self.decode(tensor, ctx)

    # -- the dense fallback on Horovod -----------------------------------------------------------
    def _start_fallback(self, agg, dense):
        return hvd.allreduce_async_(dense, name=f"lhc.fallback.{agg.name}", op=hvd.Sum,
                                    process_set=self._process_set)

    def _start_partial(self, agg, values):
        return hvd.allreduce_async_(values, name=f"lhc.partial.{agg.name}", op=hvd.Sum,
                                    process_set=self._process_set)

    def _wait_fallback(self, handle) -> None:
        hvd.synchronize(handle)

    # -- helpers -------------------------------------------------------------------------------
    def _aggregator(self, p: torch.nn.Parameter, opt, tensor: torch.Tensor):
        if p not in self._aggregators:
            if not self._aggregators:
                self._optimizer = opt
            self._process_set = getattr(opt, "process_set", hvd.global_process_set)
        name = opt._parameter_names.get(p) or f"param{len(self._aggregators)}"
        return self.aggregator(p, name, tensor, self._process_set.size(), self._process_set.rank())

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


class Compression(CompressionFactory):
    """Factories for ``hvd.DistributedOptimizer(compression=...)`` (:class:`CompressionFactory`:
    ``lossless``, ``topk``, ``thc``); Horovod's own ``none`` and ``fp16`` are re-exported so examples
    can switch with one name."""

    compressor = HorovodCompressor
    none = hvd.Compression.none
    fp16 = hvd.Compression.fp16
