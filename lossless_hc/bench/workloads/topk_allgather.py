"""Top-k sent as (index, value) pairs by allgather: a baseline for the cluster benchmark.

This is the usual sparse-communication scheme that lossless_hc is compared against, not part of
the library (so it lives with the workloads, not in ``plugins/``). Each rank keeps the ``ratio``
largest-magnitude coordinates of its gradient plus error-feedback residual, every rank allgathers
every rank's pairs (``world_size * k`` pairs arrive at each rank, so the traffic grows with the
world size, unlike an allreduce), and each rank scatters them into a dense average.

Pairs travel as one float32 tensor ``[values | indices]`` per tensor: the int32 indices are
bit-cast, which a collective that only copies (allgather) carries unchanged.
"""
from __future__ import annotations

import time

import torch

from lossless_hc.training import topk_aggregate


def topk_count(numel: int, ratio: float) -> int:
    """Coordinates each rank sends for a tensor of ``numel`` elements: the library's count
    (``topk_aggregate.topk_count``, ceil(ratio numel), at least 1), so that this baseline and the planner's
    ``topk_allgather`` send as many pairs."""
    if not 0.0 < ratio <= 1.0:
        raise ValueError(f"top-k ratio must be in (0, 1], got {ratio}")
    return topk_aggregate.topk_count(numel, ratio)


class TopKAllgather:
    """Per-tensor state (error-feedback residuals, keyed by a caller's name) and the statistics in
    the plugins' format (``stats()``: encode/decode seconds, payload and dense bytes, fallbacks)."""

    def __init__(self, ratio: float):
        topk_count(1, ratio)  # validates
        self.ratio = ratio
        self._residual: dict = {}
        self.encode_seconds = self.decode_seconds = 0.0
        self.payload_bytes = self.dense_bytes = 0

    def encode(self, key, flat: torch.Tensor) -> torch.Tensor:
        """Pack the top-k of ``flat`` + residual as ``[values | int32 indices as float32]``; the
        residual keeps what was not sent."""
        t0 = time.perf_counter()
        flat = flat.reshape(-1).float()
        res = self._residual.get(key)
        if res is None or res.numel() != flat.numel():  # DDP rebuilds its buckets after step 1
            res = self._residual[key] = torch.zeros_like(flat)
        acc = res.add_(flat)
        k = topk_count(acc.numel(), self.ratio)
        idx = acc.abs().topk(k, sorted=False).indices
        vals = acc[idx]
        acc[idx] = 0.0
        packed = torch.cat([vals, idx.to(torch.int32).view(torch.float32)])
        self.encode_seconds += time.perf_counter() - t0
        self.payload_bytes += packed.numel() * 4
        self.dense_bytes += flat.numel() * flat.element_size()
        return packed

    def decode(self, gathered: torch.Tensor, world_size: int, out: torch.Tensor) -> torch.Tensor:
        """Average of the ranks' pairs in ``gathered`` (``world_size`` packed tensors end to end),
        written densely into ``out`` (any shape with the original number of elements). Ranks are
        added one after another, in rank order, so every rank computes the same bits: within a rank
        the indices are distinct, so even CUDA's atomic ``index_add_`` has one order, which one
        ``index_add_`` over all ranks' pairs would not (replicas would drift apart)."""
        t0 = time.perf_counter()
        parts = gathered.reshape(world_size, 2, -1)
        vals = parts[:, 0]
        idx = parts[:, 1].contiguous().view(torch.int32).long()
        flat = torch.zeros(out.numel(), dtype=torch.float32, device=out.device)
        for r in range(world_size):
            flat.index_add_(0, idx[r], vals[r])
        out.copy_(flat.div_(world_size).view_as(out))
        self.decode_seconds += time.perf_counter() - t0
        return out

    def stats(self) -> dict:
        return {"encode_seconds": self.encode_seconds, "decode_seconds": self.decode_seconds,
                "payload_bytes": self.payload_bytes, "dense_bytes": self.dense_bytes, "fallbacks": 0}


class HorovodTopKAllgatherOptimizer:
    """Wraps a torch optimizer: ``step()`` aggregates every gradient by top-k + ``hvd.allgather``
    (all tensors' allgathers in flight together), then steps. Unlike ``hvd.DistributedOptimizer``
    it starts communicating only after backward, which is how simple allgather baselines run."""

    def __init__(self, optimizer, named_parameters, ratio: float, hvd):
        self.optimizer, self.hvd = optimizer, hvd
        self.named_parameters = [(n, p) for n, p in named_parameters if p.requires_grad]
        self.codec = TopKAllgather(ratio)

    def zero_grad(self):
        self.optimizer.zero_grad()

    def step(self):
        pending = []
        for name, p in self.named_parameters:
            if p.grad is None:
                continue
            grad = p.grad.to_dense() if p.grad.is_sparse else p.grad
            packed = self.codec.encode(name, grad)
            pending.append((p, grad, self.hvd.allgather_async(packed, name=f"topk_allgather.{name}")))
        for p, grad, handle in pending:
            p.grad = self.codec.decode(self.hvd.synchronize(handle), self.hvd.size(), torch.empty_like(grad))
        self.optimizer.step()


def ddp_topk_allgather_hook(state: TopKAllgather, bucket):
    """DDP comm hook: the bucket's top-k pairs by ``all_gather``, decoded into the bucket."""
    import torch.distributed as dist

    buf = bucket.buffer()
    packed = state.encode(bucket.index(), buf)
    world = dist.get_world_size()
    gathered = [torch.empty_like(packed) for _ in range(world)]
    fut = dist.all_gather(gathered, packed, async_op=True).get_future()

    def decode(_):
        return state.decode(torch.cat(gathered), world, buf)
    return fut.then(decode)
