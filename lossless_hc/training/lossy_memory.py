"""The lossy strategies' error-feedback memories of one tensor under the planner: THC's and top-k's.

``topk`` and ``topk_allgather`` make the same selection of ``x + e`` and share one residual ``e`` (a
re-plan between them loses nothing); THC keeps its own. A memory is built at its strategy's first use
and, when the plan leaves its strategies, flushed into the next gradient sent (so every coordinate's
error mass is sent once: error feedback conserves it), or taken by a caller that aggregates the tensor
by other means from then on (PowerSGD, the step guard's dense verdict).
"""
from __future__ import annotations

from typing import Optional

import torch

from lossless_hc.training.aggregate import AggregationStats
from lossless_hc.training.topk_aggregate import TopKAggregator
from lossless_hc.training.planner import TOPK_STRATEGIES
from lossless_hc.training.thc_aggregate import THCAggregator


class LossyMemories:
    """Mixed into :class:`~lossless_hc.training.strategies.AutoAggregator`, which sets what these read:
    ``name``, ``numel``, ``world_size``, ``rank``, ``seed``, ``device``, ``thc_bits``, ``topk_ratio``, the
    planned ``strategy``, and ``_thc`` / ``_topk`` (None until built)."""

    def thc_aggregator(self) -> THCAggregator:
        """The THC strategy's aggregator (its codec's norm and error memory), built at first use.
        ``non_finite="propagate"``: a NaN/Inf input decodes to NaN, as a dense plan's sum would carry it
        (an AMP scaler then skips the step); THC's own default raises."""
        if self._thc is None:
            self._thc = THCAggregator(self.name, (self.numel,), torch.float32, self.world_size, self.rank,
                                      bits=self.thc_bits, seed=self.seed, stats=AggregationStats(),
                                      non_finite="propagate")
        return self._thc

    def topk_aggregator(self) -> TopKAggregator:
        """The top-k strategies' aggregator (its error-feedback residual, which ``topk`` and ``topk_allgather``
        share: the same selection of ``x + residual``), built at first use. Its LHC codec only once the plan
        is ``topk``: ``topk_allgather`` sends the pairs, and the codec would refuse more than 1024 ranks."""
        sketch = self.strategy == "topk"
        if self._topk is None:
            self._topk = TopKAggregator(self.name, (self.numel,), torch.float32, self.world_size, self.topk_ratio,
                                        seed=self.seed, stats=AggregationStats(), device=self.device, sketch=sketch)
        elif sketch:
            self._topk.use_sketch()
        return self._topk

    def take_lossy_memory(self) -> Optional[torch.Tensor]:
        """What THC's or top-k's error feedback still holds (flat float32; None if nothing), removed from
        this aggregator: a caller that aggregates the tensor by other means from now on (a DDP bucket
        going to PowerSGD, :mod:`lossless_hc.training.powersgd`) adds it to the gradient, so that no
        error mass is lost."""
        err = None
        if self._thc is not None:
            err = self._thc.pending_error()
            self._thc = None
        if self._topk is not None:
            if self._topk.residual is not None:
                res = self._topk.residual.reshape(-1).to(torch.float32)
                err = res if err is None else err.to(res.device) + res
            self._topk = None
        return err

    def add_lossy_memory_to(self, grad: torch.Tensor) -> None:
        """Add what :meth:`take_lossy_memory` takes to ``grad`` in place (its shape and dtype): for a
        caller that aggregates the tensor by other means from now on (a bucket's switch to PowerSGD, the
        DDP step guard's dense verdict)."""
        err = self.take_lossy_memory()
        if err is not None:
            grad.add_(err.to(device=grad.device, dtype=grad.dtype).reshape(grad.shape))

    _carried_memory = False   # the next step's gradient carries error memory sent late

    def carry_memory(self) -> None:
        """The next step's gradient carries error memory its engine adapter added (the DDP step guard's
        PowerSGD trial memory after its verdict): its counts are not statistics (:meth:`PlanTracker.skip
        <lossless_hc.training.plan_tracker.PlanTracker.skip>`), as when leaving THC or top-k flushes theirs
        (:meth:`_flush_lossy_memory`). Call it on every rank alike (plans must agree)."""
        self._carried_memory = True

    def _flush_lossy_memory(self, flat: torch.Tensor) -> torch.Tensor:
        """Leaving THC or top-k: what their error feedback still holds goes out with this gradient."""
        if self.strategy != "thc" and self._thc is not None:
            err = self._thc.pending_error()
            if err is not None:
                flat = flat.to(torch.float32) + err.to(flat.device)
                self._carried_memory = True   # its rows are many steps': not this step's statistics
            self._thc = None   # a later THC plan starts afresh (its first step agrees on a norm)
        if self.strategy not in TOPK_STRATEGIES and self._topk is not None:
            if self._topk.residual is not None:
                flat = flat.to(torch.float32) + self._topk.residual
                self._carried_memory = True
            self._topk = None
        return flat
