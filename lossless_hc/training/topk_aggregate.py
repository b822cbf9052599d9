"""Top-k sparsification with error feedback (``Compression.topk``): :class:`TopKAggregator`, a
:class:`~lossless_hc.training.aggregate.TensorAggregator` whose input is each step's selection of the
gradient plus the residual, and :func:`topk_count`, the k that it and the planner's top-k strategies use.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from lossless_hc.backends import backend_for
from lossless_hc.lhc.codec import DecodeReport
from lossless_hc.lhc.status import DecodeStatus
from lossless_hc.training.aggregate import AggregationStats, TensorAggregator
from lossless_hc.training.capacity import CapacityPolicy


def topk_count(numel: int, ratio: float) -> int:
    """Coordinates a top-k selection keeps of ``numel`` at ``ratio``: ``k = ceil(ratio numel)``, at least 1 and at
    most ``numel`` (:class:`TopKAggregator`'s k; the planner prices its top-k strategies with it)."""
    return min(numel, max(1, math.ceil(ratio * numel)))


def _held_in(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` (float32) as ``dtype`` holds it: rounded to nearest, a finite value beyond the dtype's range
    clamped to its largest (where a plain conversion would make it infinite); NaN and infinities kept."""
    if dtype == x.dtype:
        return x
    if dtype.is_floating_point and torch.finfo(dtype).max < torch.finfo(x.dtype).max:
        big = torch.finfo(dtype).max
        x = torch.where(torch.isfinite(x), x.clamp(-big, big), x)
    return x.to(dtype)


def _rounds(dtype: torch.dtype) -> bool:
    """Whether ``dtype`` holds fewer bits of a float32 value (float16, bfloat16): only then can sending in it
    leave something out."""
    return dtype.is_floating_point and torch.finfo(dtype).bits < 32


def _left_out(x: torch.Tensor, held: torch.Tensor) -> torch.Tensor:
    """``x - held`` (float32, exact: a rounding's or a clamp's remainder) where ``x`` is finite, else 0: a
    NaN or infinity goes out as it is, and nothing of it stays behind for the next step."""
    return torch.where(torch.isfinite(x), x - held.float(), 0.0)


class TopKAggregator(TensorAggregator):
    r"""Top-k sparsification with error feedback, aggregated losslessly (``Compression.topk``).

    Per step, with residual :math:`e` (zero at first):

    .. math:: a = g + e, \quad s = \mathrm{top}_k(|a|) \text{ entries of } a, \quad e \leftarrow a - s

    and :math:`\sum_r s_r` is aggregated losslessly, within :class:`TensorAggregator`'s exactness contract
    (the sum's exact support, each value within the codec's ``rtol``, keys the decoder cannot prove
    re-aggregated densely; not bit for bit). The codec's per-rank capacity is k, so no rank can overload
    it. The residual keeps what was not sent, so every gradient coordinate is eventually applied
    (error feedback, Karimireddy et al. 2019). It lives here, keyed by the parameter, so it
    survives ``zero_grad(set_to_none=True)``. :math:`a` is float32; for a float16 or bfloat16 tensor
    :math:`s` is what that dtype holds of :math:`a` there (rounded, and a finite value beyond its range
    clamped to it), so the residual also keeps what the rounding left out: :math:`a` is the sent tensor
    plus the new residual, exactly (within float32 rounding where a value was clamped).

    ``sketch``: whether the selections are summed through the LHC codec (``topk``). False: the caller
    sends them as (index, value) pairs (:meth:`select_indices`; ``topk_allgather``, FSDP2's reduce-scatter),
    so no codec is built (it takes at most 1024 ranks) and :attr:`compressed` is False (:meth:`select`
    sends the tensor whole, with its residual) until :meth:`use_sketch`.
    """

    def __init__(self, name: str, shape, dtype: torch.dtype, world_size: int, ratio: float, seed: int = 0,
                 index: str = "auto", stats: Optional[AggregationStats] = None,
                 policy: Optional[CapacityPolicy] = None, device="cpu", sketch: bool = True):
        self.sketch = bool(sketch)   # read by _decide_codec, which the base class's constructor calls
        super().__init__(name, shape, dtype, world_size, max_density=ratio, block_size=1, seed=seed,
                         index=index, stats=stats, policy=policy, device=device)
        self.k = topk_count(self.numel, ratio)
        self.min_capacity = self.k  # every rank sends exactly k: only the union adapts
        self.residual: Optional[torch.Tensor] = None

    def _decide_codec(self) -> None:
        if self.sketch:
            super()._decide_codec()
        else:
            self._codec = None

    def use_sketch(self) -> None:
        """Sum the selections through the LHC codec from now on (built now; the residual kept)."""
        if not self.sketch:
            self.sketch = True
            self._decide_codec()

    def select(self, x: torch.Tensor) -> torch.Tensor:
        if not self.compressed:
            # Sent dense: everything goes, including what earlier steps left over.
            if self.residual is None:
                return x
            total = x.detach().reshape(-1).float() + self.residual
            sent = _held_in(total, self.dtype)
            self.residual = None
            if _rounds(self.dtype):
                rest = _left_out(total, sent)   # what a narrower dtype's rounding left out: sent later
                self.residual = rest if bool(rest.any()) else None
            return sent.reshape(self.shape)
        idx, values = self.select_pairs(x)
        # A fresh dense output (the adapters keep it until the decode completes), zeroed in memory
        # advised to huge pages: a third of torch.zeros_like's time on the CPU, whose page faults are
        # most of it.
        sparse = backend_for(values.device).empty(self.numel, values.device).zero_()
        sparse[idx] = values.float()   # float32 holds a narrower dtype's values exactly
        return sparse.reshape(self.shape).to(self.dtype)

    def select_pairs(self, x: torch.Tensor) -> tuple:
        """:meth:`select_indices` with the values as this tensor's dtype holds them (:meth:`select`'s
        selection): for float16 or bfloat16, rounded (a finite value beyond the range clamped to it) and
        what that left out kept in the residual, so the pairs plus the residual are ``a``."""
        idx, values = self.select_indices(x)
        if _rounds(self.dtype):
            held = _held_in(values, self.dtype)
            self.residual[idx] = _left_out(values, held)   # zero there after the selection: now the rounding's
            return idx, held
        return idx, values

    def select_indices(self, x: torch.Tensor) -> tuple:
        """:meth:`select`'s selection of a compressed tensor as ``(indices, values)``: the k flat
        indices (int64, ascending) and ``a`` there, float32 (the residual updated as :meth:`select`
        updates it; float32: :meth:`select_pairs` has them in this tensor's dtype)."""
        # resolve_neg: the kernels read memory, not torch's negative bit (a gradient that is a negative view)
        flat = x.detach().reshape(-1).to(torch.float32).contiguous().resolve_neg()
        if self.residual is None:
            self.residual = torch.zeros(self.numel, dtype=torch.float32, device=flat.device)
        # One pass (backends' topk_feedback): acc = flat + residual, exactly k indices (k <= numel: the
        # k largest |acc|, ties to the lower index, the same on every rank, thread count and device,
        # so the codec's capacity k is never exceeded), and the residual updated in place to acc with
        # those coordinates zeroed. The gradient itself is never written.
        return backend_for(flat.device).topk_feedback(flat, self.residual, self.k)

    def after_failure(self, report: DecodeReport) -> None:
        """:meth:`TensorAggregator.after_failure`; after a step where some rank's g + e held NaN/Inf (an
        AMP scaler's overflow step, which the scaler then skips) every rank also drops its residual: the
        non-finite one would make every later step non-finite (the scale halving at each, for ever), and
        the others hold values at the scale that overflowed, which the scaler now halves."""
        super().after_failure(report)
        if report.status == DecodeStatus.NON_FINITE_INPUT:
            self.residual = None
